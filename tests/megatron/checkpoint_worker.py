"""Several forge CLI runs (and conversions) in one set of processes, so megatron-core is imported once.

``python -m torch.distributed.run --nproc-per-node N checkpoint_worker.py PLAN.json`` (gloo, CPU shim), run in
the directory the runs write to. ``PLAN.json`` is a list of steps, each one of

* ``{"name": ..., "args": [...]}``: ``ForgeCLI(args)`` (``fit ...``); ``"expect_error": true`` records the error
  message instead of failing;
* ``{"name": ..., "megatron_to_hf": [CHECKPOINT_DIR, OUT_DIR]}``: ``forge-convert megatron-to-hf``.

A step may also give ``"log"``: a file (``{rank}`` in its name is replaced) that takes this process's output
(stdout and stderr, at the file-descriptor level) while the step runs, so that each run has its own output.

Every rank writes ``results_<world size>_rank<rank>.json`` after every step, global rank 0 also
``results_<world size>.json`` (the same): for each step done so far its error message (``null`` when it
succeeded), its seconds, and ``left``: megatron state the step left behind (its parallel state, which
``MegatronStrategy.teardown`` destroys; the worker destroys what it finds, so the next step starts clean).

A hung collective fails with every thread's stack, not silently: after 240 s for the whole plan (before the
300 s timeout of test_checkpoint.py's launch) or, with the environment variable ``WATCHDOG_S``, after that many
seconds in any one step.
"""

import contextlib
import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(step: dict) -> None:
    if "megatron_to_hf" in step:
        from forge_lightning.tools.megatron_convert import megatron_to_hf

        megatron_to_hf(*step["megatron_to_hf"])
        return
    from forge_lightning.cli import ForgeCLI

    ForgeCLI(args=step["args"])


@contextlib.contextmanager
def _output_to(log: str | None):
    """This process's stdout and stderr (file descriptors 1 and 2, so C++ and faulthandler output too) go to
    ``log`` while the block runs."""
    if log is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log.format(rank=os.environ["RANK"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _clean_up() -> list[str]:
    """What megatron-core state the last step left (destroyed here), for its result: ``MegatronStrategy.teardown``
    destroys megatron's parallel state and empties its MoE logging tracker (a module-level dict whose ``values`` are
    sized by the model's layer count), so that the next run of the process starts clean."""
    left = []
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        left.append("megatron's parallel state (model_parallel_is_initialized() after the run)")
        parallel_state.destroy_model_parallel()
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None and moe_utils.get_moe_layer_wise_logging_tracker():
        left.append("megatron's MoE logging tracker (not empty after the run)")
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    return left


def main(plan_file: Path) -> None:
    # Imports here, not at module level: megatron's checkpoint writer starts a `spawn` multiprocessing manager,
    # which imports this script again (as __mp_main__); that import stays cheap.
    sys.path.insert(0, str(HERE))
    import cuda_shim
    from worker_exit import exit_worker

    cuda_shim.install()
    import torch.distributed as dist

    import forge_lightning.cli  # noqa: F401  (imported before the first step's clock starts)

    per_step = os.environ.get("WATCHDOG_S")
    if per_step is None:
        faulthandler.dump_traceback_later(240, exit=True)
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    results = {}
    for step in json.loads(plan_file.read_text()):
        if per_step is not None:
            faulthandler.dump_traceback_later(float(per_step), exit=True)
        start = time.perf_counter()
        with _output_to(step.get("log")):
            try:
                _run(step)
                error = None
            except (Exception, SystemExit) as err:  # an expected error is a result; any other fails its test
                if isinstance(err, SystemExit) and err.code in (0, None):
                    error = None
                else:
                    if not step.get("expect_error"):
                        traceback.print_exc()
                    error = f"{type(err).__name__}: {err}"
            left = _clean_up()
        if per_step is not None:
            faulthandler.cancel_dump_traceback_later()
        results[step["name"]] = {
            "error": error,
            "seconds": round(time.perf_counter() - start, 2),
            "left": left,
        }
        text = json.dumps(results, indent=2)
        Path(f"results_{world}_rank{rank}.json").write_text(text)
        if rank == "0":
            Path(f"results_{world}.json").write_text(text)
    if per_step is not None:
        faulthandler.dump_traceback_later(60, exit=True)
    if dist.is_initialized():
        dist.barrier()
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

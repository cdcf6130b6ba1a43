"""Several forge CLI runs (and conversions) in one set of processes, so megatron-core is imported once.

``python -m torch.distributed.run --nproc-per-node N checkpoint_worker.py PLAN.json`` (gloo, CPU shim), run in
the directory the runs write to. ``PLAN.json`` is a list of steps, each one of

* ``{"name": ..., "args": [...]}``: ``ForgeCLI(args)`` (``fit ...``); ``"expect_error": true`` records the error
  message instead of failing;
* ``{"name": ..., "megatron_to_hf": [CHECKPOINT_DIR, OUT_DIR]}``: ``forge-convert megatron-to-hf``.

Global rank 0 writes ``results_<world size>.json``: for each step its error message (``null`` when it succeeded)
and its seconds.
"""

import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_shim
from worker_exit import exit_worker

cuda_shim.install()

import torch.distributed as dist  # noqa: E402

from forge_lightning.cli import ForgeCLI  # noqa: E402


def _run(step: dict) -> None:
    if "megatron_to_hf" in step:
        from forge_lightning.strategies.megatron.convert import megatron_to_hf

        megatron_to_hf(*step["megatron_to_hf"])
        return
    ForgeCLI(args=step["args"])


def main(plan_file: Path) -> None:
    # A hung collective fails with every thread's stack (before the test's own 300 s timeout), not silently.
    faulthandler.dump_traceback_later(240, exit=True)
    results = {}
    for step in json.loads(plan_file.read_text()):
        start = time.perf_counter()
        try:
            _run(step)
            error = None
        except Exception as err:  # an expected error is a result; any other fails the test that reads it
            if not step.get("expect_error"):
                traceback.print_exc()
            error = f"{type(err).__name__}: {err}"
        results[step["name"]] = {"error": error, "seconds": round(time.perf_counter() - start, 2)}
    if os.environ["RANK"] == "0":
        Path(f"results_{os.environ['WORLD_SIZE']}.json").write_text(json.dumps(results, indent=2))
    if dist.is_initialized():
        dist.barrier()
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

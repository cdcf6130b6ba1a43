"""How long a ``forge fit`` takes to end after its last training step, per strategy.

Each run is the product path: ``forge fit --config <recipe>`` in a child process, with a clock callback added on
the command line. The table splits, per strategy, the time from the end of the last training step to the process's
exit into stages: the ``on_train_end`` hooks (``ModelCheckpoint`` writes the last checkpoint there), the strategy's
teardown, the rest of ``fit``, and the interpreter's exit (exit handlers, process-group and CUDA shutdown), with the
last checkpoint's size. From the last step on, the child prints every thread's stack every ``--stacks-every``
seconds; a child that has not exited ``--exit-timeout`` seconds after its last step is stopped, and its row says so.

GPU (one H200; the quick-start corpus, built on the spot, as data)::

    python benchmarks/run_endings.py --runs megatron fsdp2 ddp --steps 40 --out benchmarks/results/run_endings.json

CPU script check (the tiny quick-start model; megatron-core on a CPU needs the test suite's shim)::

    PYTHONPATH=tests/megatron/cpu_site python benchmarks/run_endings.py --device cpu --runs single fsdp2 megatron \\
        --steps 3 --out /tmp/run_endings.json
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import harness
from lightning.pytorch import Callback, LightningModule, Trainer

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPES = {
    "megatron": (
        "configs/llm/llama3.2-1b/pretrain_megatron_tp2.yaml",
        [
            "--trainer.strategy.tensor_model_parallel_size=1",
            "--trainer.strategy.sequence_parallel=false",
        ],
    ),
    "fsdp2": ("configs/llm/llama3.2-1b/pretrain_fsdp2.yaml", []),
    "ddp": ("configs/llm/llama3.2-1b/pretrain_ddp_fp8.yaml", []),
}
CPU_STRATEGIES = {
    "single": [],
    "fsdp2": ["--trainer.strategy=fsdp2"],
    "megatron": ["--trainer.strategy=megatron"],
}


class RunClock(Callback):
    """Prints ``CLOCK <event> <unix time>`` at each stage of a run's ending, on global rank 0.

    The events, in order: ``last_step`` (the last training step ended), ``train_end`` (the first ``on_train_end``
    hook; Lightning runs ``ModelCheckpoint``'s, which writes the last checkpoint, after the others),
    ``teardown_start`` / ``teardown_end`` (the strategy's teardown), ``fit_end`` (``on_fit_end``), and, printed by
    the child itself, ``fit_returned`` and ``atexit`` (the last exit handler). From ``last_step`` on, every
    thread's stack is printed every ``stacks_every`` seconds (``faulthandler``, from a thread of its own, so a
    process stuck in native code prints it too).
    """

    def __init__(self, steps: int, stacks_every: float = 0.0) -> None:
        self.steps, self.stacks_every = steps, stacks_every

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy_teardown = trainer.strategy.teardown

        def teardown() -> None:
            self._clock(trainer, "teardown_start")
            strategy_teardown()
            self._clock(trainer, "teardown_end")

        trainer.strategy.teardown = teardown  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        if trainer.global_step == self.steps:
            self._clock(trainer, "last_step")
            if self.stacks_every and trainer.is_global_zero:
                faulthandler.dump_traceback_later(self.stacks_every, repeat=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock(trainer, "train_end")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock(trainer, "fit_end")

    @staticmethod
    def _clock(trainer: Trainer, event: str) -> None:
        if trainer.is_global_zero:
            harness.emit(f"CLOCK {event} {time.time()}")


# (stage name, first clock, last clock): the table's columns; "exit" is the process's end, seen by the parent.
STAGES = (
    ("last step -> train end", "last_step", "train_end"),
    ("last checkpoint + on_train_end", "train_end", "teardown_start"),
    ("strategy teardown", "teardown_start", "teardown_end"),
    ("fit end -> fit returned", "teardown_end", "fit_returned"),
    ("fit returned -> exit", "fit_returned", "exit"),
)


def _child_args(args: argparse.Namespace, run: str) -> list[str]:
    data = Path(args.data)
    clock = f"{{class_path: run_endings.RunClock, init_args: {{steps: {args.steps}, stacks_every: {args.stacks_every}}}}}"
    common = [
        f"--data.data_prefix={data / 'stdlib_text_document'}",
        f"--data.tokenizer={data / 'tokenizer'}",
        f"--trainer.max_steps={args.steps}",
        "--trainer.devices=1",
        f"--trainer.default_root_dir={Path(args.work) / run}",
        f'--trainer.logger={{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: {Path(args.work) / run}, name: ""}}}}',
        f"--trainer.callbacks+={clock}",
    ]
    if args.device == "cpu":
        return ["fit", "--config", str(REPO / "configs/quickstart/llm.yaml"), *CPU_STRATEGIES[run], *common]
    recipe, overrides = GPU_RECIPES[run]
    return ["fit", "--config", str(REPO / recipe), *overrides, *common]


def _child(argv: list[str]) -> None:
    """The ``forge`` command (:func:`forge_lightning.cli.run`: ``main``, then ``exit_now``), with the clocks of the
    process's own end: ``fit_returned`` and ``atexit`` (registered first, so it runs after every other exit
    handler)."""
    atexit.register(lambda: harness.emit(f"CLOCK atexit {time.time()}"))
    from forge_lightning.cli import exit_now, main

    main(argv)
    harness.emit(f"CLOCK fit_returned {time.time()}")
    exit_now(0)


def disk_write_gbps(directory: Path, gb: float = 4.0) -> float:
    """The disk's sequential write speed in GB/s: ``gb`` GB in 16 MiB blocks, fsync'd, like a checkpoint's files."""
    block = os.urandom(16 * 2**20)
    path = directory / ".disk_probe"
    start = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(max(1, int(gb * 1e9 / len(block)))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    written = path.stat().st_size
    path.unlink()
    return written / 1e9 / seconds


def _checkpoint_gb(work: Path) -> float | None:
    """Size of the newest ``last.ckpt`` (a file or a sharded checkpoint's directory) under ``work``, in GB."""
    found = sorted(work.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)
    if not found:
        return None
    last = found[-1].resolve()
    files = [last] if last.is_file() else [f for f in last.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files) / 1e9


def measure(args: argparse.Namespace, run: str) -> dict:
    """One run: its clock lines, the seconds of each stage of its ending, its last checkpoint's size and its
    throughput summary line."""
    cmd = [sys.executable, __file__, "child", *_child_args(args, run)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    clocks: dict[str, float] = {}
    last_step = threading.Event()

    def read() -> None:  # a thread, so that the child never blocks on a full pipe
        for line in proc.stdout:
            lines.append(line)
            if match := re.match(r"CLOCK (\w+) ([\d.]+)", line):
                clocks[match[1]] = float(match[2])
                if match[1] == "last_step":
                    last_step.set()
        last_step.set()  # the child ended (perhaps before its last step)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    last_step.wait()
    try:
        proc.wait(timeout=args.exit_timeout if "last_step" in clocks else None)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        hung = True
    clocks["exit"] = time.time()
    reader.join(timeout=30)
    log = "".join(lines)
    Path(args.work, f"{run}.log").write_text(log)
    throughput = re.findall(r"tokens_per_sec=([\d.e+]+)", log)
    row: dict = {"run": run, "returncode": proc.returncode, "hung": hung}
    if "last_step" not in clocks or (proc.returncode and not hung):
        error = harness.failed(log.strip().splitlines()[-1] if log.strip() else "no output")
        return {**row, "error": error, "log_tail": log[-8000:]}
    if hung:
        row["stack"] = log[-6000:]
    row["stages_s"] = {
        name: clocks[last] - clocks[first]
        for name, first, last in STAGES
        if first in clocks and last in clocks
    }
    row["atexit_to_exit_s"] = clocks["exit"] - clocks["atexit"] if "atexit" in clocks else None
    row["total_s"] = clocks["exit"] - clocks["last_step"]
    row["checkpoint_gb"] = _checkpoint_gb(Path(args.work) / run)
    if not args.keep_runs:  # the checkpoints of a 1B model take ~15 GB per run
        shutil.rmtree(Path(args.work) / run, ignore_errors=True)
    row["tokens_per_s"] = float(throughput[-1]) if throughput else None
    return row


def _table(rows: list[dict]) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    cells = []
    for r in rows:
        stages = r.get("stages_s", {})
        status = r.get("error") or ("exited" if not r["hung"] else "stopped: did not exit")
        gb = r.get("checkpoint_gb")
        cells.append(
            (
                r["run"],
                status,
                *(seconds(stages.get(name)) for name, _, _ in STAGES),
                seconds(r.get("total_s")),
                "-" if gb is None else f"{gb:.1f}",
                "-" if gb is None or not stages.get(STAGES[1][0]) else f"{gb / stages[STAGES[1][0]]:.2f}",
                "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s'] / 1e3:.1f}k",
            )
        )
    columns = ["run", "status", *(f"{name} (s)" for name, _, _ in STAGES), "last step -> exit (s)"]
    return harness.markdown_table([*columns, "last checkpoint (GB)", "its write (GB/s)", "tokens/s"], cells)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["megatron", "fsdp2", "ddp"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--data", default="data/quickstart", help="forge-data quickstart output (built if missing)"
    )
    p.add_argument(
        "--work", default="runs/run_endings", help="where the runs write their logs and checkpoints"
    )
    p.add_argument(
        "--exit-timeout", type=float, default=150.0, help="seconds after the last step before a stop"
    )
    p.add_argument(
        "--stacks-every",
        type=float,
        default=15.0,
        help="after the last step, print every thread's stack every N s",
    )
    p.add_argument("--keep-runs", action="store_true", help="keep each run's checkpoints and logs directory")
    p.add_argument("--out", default=None, help="results JSON")
    return p


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        _child(sys.argv[2:])
        return
    args = _parser().parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if not (Path(args.data) / "tokenizer").exists():
        quickstart = [sys.executable, "-m", "forge_lightning.tools.data", "quickstart", "--output", args.data]
        subprocess.run(quickstart, check=True)
    known = CPU_STRATEGIES if args.device == "cpu" else GPU_RECIPES
    disk = disk_write_gbps(Path(args.work))
    rows: list[dict] = []
    for run in (r for r in args.runs if r in known):
        rows.append(measure(args, run))
        if args.out:  # after every run: a launch stopped midway keeps the rows it has
            record = {"meta": harness.run_meta(__file__), "disk_write_gbps_fsync": disk, "results": rows}
            harness.write_json(args.out, record)
    print(f"the work directory's disk: {disk:.2f} GB/s written and fsync'd", flush=True)
    print(_table(rows), flush=True)


if __name__ == "__main__":
    main()

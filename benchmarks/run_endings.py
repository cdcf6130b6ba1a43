"""How long a ``forge fit`` takes to end after its last training step, per strategy.

Each run is the product path: ``forge fit --config <recipe>`` in a child process, with a clock callback added on
the command line. The table gives, per strategy, the seconds from the end of the last training step to the end of
training (the callbacks' ``on_train_end``: checkpoints, exports, samples), from there to the process's exit
(teardown, process-group shutdown, interpreter exit), and in all. A child that has not exited ``--exit-timeout``
seconds after its last step prints every thread's stack (``faulthandler``) and is stopped: its row says so.

GPU (one H200; the quick-start corpus, built on the spot, as data)::

    python benchmarks/run_endings.py --runs megatron fsdp2 ddp --steps 40 --out benchmarks/results/run_endings.json

CPU script check (the tiny quick-start model; megatron-core on a CPU needs the test suite's shim)::

    PYTHONPATH=tests/megatron/cpu_site python benchmarks/run_endings.py --device cpu --runs single fsdp2 megatron \\
        --steps 3 --out /tmp/run_endings.json
"""

from __future__ import annotations

import argparse
import os
import re
import signal
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
    """Prints ``CLOCK <event> <unix time>`` when the last training step ends and when training ends."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        if trainer.global_step == self.steps and trainer.is_global_zero:
            harness.emit(f"CLOCK last_step {time.time()}")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            harness.emit(f"CLOCK train_end {time.time()}")


def _child_args(args: argparse.Namespace, run: str) -> list[str]:
    data = Path(args.data)
    common = [
        f"--data.data_prefix={data / 'stdlib_text_document'}",
        f"--data.tokenizer={data / 'tokenizer'}",
        f"--trainer.max_steps={args.steps}",
        "--trainer.devices=1",
        f"--trainer.default_root_dir={Path(args.work) / run}",
        f"--trainer.logger.init_args.save_dir={Path(args.work) / run}",
        f"--trainer.callbacks+={{class_path: run_endings.RunClock, init_args: {{steps: {args.steps}}}}}",
    ]
    if args.device == "cpu":
        return ["fit", "--config", str(REPO / "configs/quickstart/llm.yaml"), *CPU_STRATEGIES[run], *common]
    recipe, overrides = GPU_RECIPES[run]
    return ["fit", "--config", str(REPO / recipe), *overrides, *common]


def _child(argv: list[str]) -> None:
    """The forge CLI, with every thread's stack printed on SIGUSR1 (the parent's signal for a run that hangs)."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from forge_lightning.cli import main

    main(argv)


def measure(args: argparse.Namespace, run: str) -> dict:
    """One run: its clock lines, its exit time, and its throughput summary line."""
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
    hung = _wait_for_exit(proc, args.exit_timeout, args.stacks_every)
    exited = time.time()
    reader.join(timeout=30)
    log = "".join(lines)
    Path(args.work, f"{run}.log").write_text(log)
    throughput = re.findall(r"tokens_per_sec=([\d.e+]+)", log)
    row = {"run": run, "returncode": proc.returncode, "hung": hung}
    if "last_step" not in clocks:
        return {**row, "error": harness.failed(log.strip().splitlines()[-1] if log.strip() else "no output")}
    if hung:
        exited = clocks["last_step"] + args.exit_timeout
        row["stack"] = log[-4000:]
    row["train_end_s"] = clocks.get("train_end", exited) - clocks["last_step"]
    row["exit_s"] = exited - clocks.get("train_end", clocks["last_step"])
    row["total_s"] = exited - clocks["last_step"]
    row["tokens_per_s"] = float(throughput[-1]) if throughput else None
    return row


def _wait_for_exit(proc: subprocess.Popen, timeout: float, stacks_every: float) -> bool:
    """Wait up to ``timeout`` seconds for the child to exit, printing its stacks every ``stacks_every`` seconds (0:
    only when it is stopped); stop it if it has not exited. Returns whether it had to be stopped."""
    deadline = time.time() + timeout
    while True:
        wait = deadline - time.time() if not stacks_every else min(stacks_every, deadline - time.time())
        try:
            proc.wait(timeout=max(wait, 0.0))
            return False
        except subprocess.TimeoutExpired:
            if time.time() >= deadline:
                break
            proc.send_signal(signal.SIGUSR1)  # where it is now: every thread's stack into the log
    proc.send_signal(signal.SIGUSR1)
    time.sleep(5)
    proc.kill()
    proc.wait()
    return True


def _table(rows: list[dict]) -> str:
    def seconds(r: dict, key: str) -> str:
        return (
            "-" if key not in r else f"{r[key]:.1f}" + (" (hung)" if r["hung"] and key == "total_s" else "")
        )

    cells = [
        (
            r["run"],
            r.get("error") or ("exited" if not r["hung"] else "did not exit"),
            seconds(r, "train_end_s"),
            seconds(r, "exit_s"),
            seconds(r, "total_s"),
            "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s'] / 1e3:.1f}k",
        )
        for r in rows
    ]
    columns = [
        "run",
        "status",
        "last step -> train end (s)",
        "train end -> exit (s)",
        "last step -> exit (s)",
    ]
    return harness.markdown_table([*columns, "tokens/s"], cells)


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
        "--stacks-every", type=float, default=0.0, help="after the last step, dump stacks every N s"
    )
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
    rows = [measure(args, run) for run in args.runs if run in known]
    if args.out:
        harness.write_json(args.out, {"meta": harness.run_meta(__file__), "results": rows})
    print(_table(rows), flush=True)


if __name__ == "__main__":
    main()

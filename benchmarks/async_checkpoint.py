"""The training time a checkpoint costs, written synchronously or with ``FSDP2Strategy(async_checkpoint=True)``.

Both runs are the product path, ``forge fit`` of the Llama-3.2-1B FSDP2 recipe on one GPU, saving one checkpoint
(weights, fp32 masters and Adam state: ~16 GB) after step ``--save-at`` and training ``--steps`` in all (fewer than
twice ``--save-at``: one save). A clock
callback prints each step's end. The table shows, per mode: the median step; the step that saves, and how much
longer than the median it took (the time the save held training); the median step while the asynchronous write was
going on (what the background write costs the steps it overlaps); and the time from the last step to the
process's exit (an asynchronous save still in flight is completed there), with the checkpoint's size.

GPU (one H200; the quick-start corpus, built on the spot, as data)::

    python benchmarks/async_checkpoint.py --steps 35 --save-at 20 --out benchmarks/results/async_checkpoint.json

CPU script check (the tiny quick-start model)::

    python benchmarks/async_checkpoint.py --device cpu --steps 5 --save-at 3 --out /tmp/async_checkpoint.json
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
from lightning.pytorch import Callback, LightningModule, Trainer

REPO = Path(__file__).resolve().parents[1]
RECIPES = {
    "cuda": ["--config", str(REPO / "configs/llm/llama3.2-1b/pretrain_fsdp2.yaml")],
    "cpu": [
        "--config",
        str(REPO / "configs/quickstart/llm.yaml"),
        "--trainer.strategy=forge_lightning.strategies.FSDP2Strategy",
    ],
}
MODES = {"sync": "false", "async": "true"}


class StepClock(Callback):
    """Prints ``STEP <global step> <unix time>`` when each training step ends (global rank 0), before
    ``ModelCheckpoint`` (Lightning runs checkpoint callbacks last) saves after it."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        if trainer.is_global_zero:
            harness.emit(f"STEP {trainer.global_step} {time.time()}")


def _child_args(args: argparse.Namespace, mode: str) -> list[str]:
    data, work = Path(args.data), Path(args.work) / mode
    checkpoint = (
        "{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: "
        f"{{dirpath: {work / 'checkpoints'}, every_n_train_steps: {args.save_at}, save_top_k: 1, "
        "monitor: step, mode: max, save_last: false}}"
    )
    return [
        "fit",
        *RECIPES[args.device],
        f"--data.data_prefix={data / 'stdlib_text_document'}",
        f"--data.tokenizer={data / 'tokenizer'}",
        f"--trainer.max_steps={args.steps}",
        "--trainer.devices=1",
        "--trainer.limit_val_batches=0",
        f'--trainer.logger={{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: {work}, name: ""}}}}',
        f"--trainer.callbacks=[{checkpoint}, {{class_path: async_checkpoint.StepClock}}]",
        f"--trainer.strategy.async_checkpoint={MODES[mode]}",
    ]


def measure(args: argparse.Namespace, mode: str) -> dict:
    """One run: the step clocks, turned into the table's numbers."""
    start = time.time()
    cmd = [sys.executable, "-m", "forge_lightning", *_child_args(args, mode)]
    path = os.pathsep.join(
        filter(None, [str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH")])
    )
    env = {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=args.timeout
    )
    exited = time.time()
    log = proc.stdout + proc.stderr
    Path(args.work, f"{mode}.log").write_text(log)
    ends = {int(m[1]): float(m[2]) for m in re.finditer(r"STEP (\d+) ([\d.]+)", log)}
    row: dict = {"mode": mode, "returncode": proc.returncode}
    if proc.returncode or sorted(ends) != list(range(1, args.steps + 1)):
        error = harness.failed(log.strip().splitlines()[-1] if log.strip() else "no output")
        return {**row, "error": error, "log_tail": log[-8000:]}
    steps = {s: ends[s] - ends[s - 1] for s in range(2, args.steps + 1)}
    save_step = args.save_at + 1  # the save runs after step save_at ends, so it lands in the next interval
    plain = [t for s, t in steps.items() if s != save_step and s > 3]
    after = [steps[s] for s in range(save_step + 1, min(save_step + 11, args.steps + 1))]
    checkpoints = Path(args.work) / mode / "checkpoints"
    size = (
        sum(p.stat().st_size for p in checkpoints.rglob("*") if p.is_file()) / 1e9
        if checkpoints.exists()
        else 0
    )
    row.update(
        median_step_s=statistics.median(plain),
        save_step_s=steps[save_step],
        save_held_training_s=steps[save_step] - statistics.median(plain),
        median_step_after_save_s=statistics.median(after) if after else None,
        last_step_to_exit_s=exited - ends[args.steps],
        wall_s=exited - start,
        checkpoint_gb=size,
    )
    shutil.rmtree(Path(args.work) / mode, ignore_errors=True)
    return row


def _table(rows: list[dict]) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    cells = [
        (
            r["mode"],
            r.get("error") or "ok",
            seconds(r.get("median_step_s")),
            seconds(r.get("save_step_s")),
            seconds(r.get("save_held_training_s")),
            seconds(r.get("median_step_after_save_s")),
            seconds(r.get("last_step_to_exit_s")),
            "-" if r.get("checkpoint_gb") is None else f"{r['checkpoint_gb']:.1f}",
        )
        for r in rows
    ]
    columns = [
        "checkpoint",
        "status",
        "median step (s)",
        "step that saves (s)",
        "save held training (s)",
        "median of the 10 steps after (s)",
        "last step -> exit (s)",
        "checkpoint (GB)",
    ]
    return harness.markdown_table(columns, cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(RECIPES), default="cuda", help="cpu: the quick-start model")
    p.add_argument("--steps", type=int, default=35)
    p.add_argument("--save-at", type=int, default=20, help="the step after which the checkpoint is saved")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["sync", "async"])
    p.add_argument(
        "--data", default="data/quickstart", help="forge-data quickstart output (built if missing)"
    )
    p.add_argument("--work", default="runs/async_checkpoint", help="where the runs write")
    p.add_argument("--timeout", type=float, default=500.0, help="seconds a run may take")
    p.add_argument("--out", default=None, help="results JSON")
    args = p.parse_args()
    if not args.save_at + 2 <= args.steps < 2 * args.save_at:
        p.error("--steps must be more than --save-at + 1 and less than twice it: the run saves once")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if not (Path(args.data) / "tokenizer").exists():
        quickstart = [sys.executable, "-m", "forge_lightning.tools.data", "quickstart", "--output", args.data]
        subprocess.run(quickstart, check=True)
    rows = []
    for mode in args.modes:
        rows.append(measure(args, mode))
        if args.out:
            harness.write_json(args.out, {"meta": harness.run_meta(__file__), "results": rows})
    print(_table(rows), flush=True)


if __name__ == "__main__":
    main()

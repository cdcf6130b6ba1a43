"""Elastic fault tolerance: under ``torchrun --max-restarts 1``, one of two ranks killed in the middle of a step
restarts the job, which resumes from the run's newest checkpoint by itself; the loss curve continues as if the run
had not been interrupted (the same losses as one process at the same global batch)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

from procs import assert_clean_exit

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"
STEPS = 6
KILLED_AT = 3  # the optimizer step rank 1 dies in; checkpoints are written after steps 2 and 4


def _args(corpus, name: str, devices: int, batch: int) -> list[str]:
    return [
        "fit",
        "--config",
        str(TINY_YAML),
        "--data.data_prefix",
        str(corpus["prefix"]),
        "--data.tokenizer",
        str(corpus["tokenizer"]),
        "--trainer.max_steps",
        str(STEPS),
        "--trainer.limit_val_batches",
        "0",
        "--trainer.devices",
        str(devices),
        "--data.batch_size",
        str(batch),
        "--trainer.logger.init_args.name",
        name,
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=2",
        "--trainer.callbacks.save_top_k=-1",
    ]


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


def _losses(root: Path, name: str) -> dict[int, dict[int, float]]:
    """Per ``version_N`` (one per attempt): step -> train loss."""
    out = {}
    for folder in sorted((root / "runs" / "tests" / name).glob("version_*")):
        rows = csv.DictReader((folder / "metrics.csv").open())
        out[int(folder.name.split("_")[1])] = {
            int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")
        }
    return out


def test_a_rank_killed_mid_step_restarts_the_job_which_resumes_and_continues_the_loss_curve(
    tiny_corpus, tmp_path
):
    reference = _run([sys.executable, "-m", "forge_lightning", *_args(tiny_corpus, "one", 1, 4)], tmp_path)
    assert_clean_exit(reference)
    expected = _losses(tmp_path, "one")[0]
    assert sorted(expected) == list(range(STEPS))

    kill = f"--trainer.callbacks+={{class_path: kill_callback.KillRankMidStep, init_args: {{step: {KILLED_AT}}}}}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    torchrun += ["--max-restarts", "1", "--monitor-interval", "0.5", "-m", "forge_lightning"]
    elastic = _run([*torchrun, *_args(tiny_corpus, "elastic", 2, 2), kill], tmp_path)
    output = elastic.stdout + elastic.stderr
    assert_clean_exit(elastic)
    checkpoints = tmp_path / "runs" / "tests" / "elastic" / "version_0" / "checkpoints"
    assert (
        f"elastic restart 1: resuming from the newest checkpoint, {checkpoints / 'epoch=0-step=2.ckpt'}"
        in output
    ), output[-4000:]
    attempts = _losses(tmp_path, "elastic")
    assert sorted(attempts) == [0, 1], attempts
    first, restarted = attempts[0], attempts[1]
    assert sorted(first) == list(range(KILLED_AT)), first  # step 3 died before it was applied or logged
    assert sorted(restarted) == list(range(2, STEPS)), restarted  # from the step-2 checkpoint on
    curve = {**first, **restarted}
    deltas = {s: abs(curve[s] - expected[s]) for s in range(STEPS)}
    assert max(deltas.values()) <= 2e-6, deltas
    assert all(abs(first[s] - restarted[s]) <= 2e-6 for s in (2,)), "step 2 redone identically"

"""The VLA quick start end to end (slow: minutes on 2 cores): expert demonstrations, ``forge fit`` of the tiny
Pi0.5, ``forge-eval`` against a random policy; the trained policy must reach the quick start's bar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout


@pytest.mark.slow
def test_quickstart_policy_beats_the_bar(tmp_path):
    config = str(REPO / "configs" / "quickstart" / "vla.yaml")
    python = sys.executable
    _run(
        [python, "-m", "forge_lightning.sim.record", "--output", "data/vla_quickstart", "--episodes", "1000"],
        tmp_path,
    )
    _run(
        [
            python,
            "-m",
            "forge_lightning",
            "fit",
            "--config",
            config,
            "--trainer.enable_progress_bar",
            "false",
        ],
        tmp_path,
    )
    ckpt = tmp_path / "runs" / "vla_quickstart" / "checkpoints" / "last.ckpt"
    evaluate = "from forge_lightning.tools.evaluate import main; main()"
    out = _run(
        [
            python,
            "-c",
            evaluate,
            "--config",
            config,
            "--ckpt",
            str(ckpt),
            "--episodes",
            "200",
            "--baseline",
            "random",
            "--output",
            "eval",
        ],
        tmp_path,
    )
    trained = json.loads((tmp_path / "eval" / "policy" / "metrics.json").read_text())
    random = json.loads((tmp_path / "eval" / "random" / "metrics.json").read_text())
    assert trained["success_rate"] >= 0.5, out
    assert trained["success_rate"] >= 3 * random["success_rate"], out

"""Pi0.5 under every native strategy, with per-component settings, on 2 gloo processes.

The policy draws its flow-matching noise and times from each rank's generator, so a 2-process run cannot equal a
1-process run; DDP is the reference instead (its equality with one process is tested on the LLM in
tests/strategies/test_layouts.py). ZeRO-1, FSDP2 (every component sharded), FSDP2 with the vision tower
replicated (its own ``replicate x 1`` mesh, gradients all-reduced) and FSDP2 with the frozen vision tower left
unsharded must reproduce DDP's losses, step by step.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import assert_clean_exit

pytest.importorskip("pyarrow")
pytest.importorskip("av")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STEPS = 4


def _config(root: Path, name: str, strategy: dict, freeze: list[str]) -> Path:
    config = {
        "seed_everything": 3,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "max_steps": STEPS,
            "strategy": strategy,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "log_every_n_steps": 1,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root), "name": name}},
        },
        "model": {
            "class_path": "forge_lightning.modules.embodied.Pi05Policy",
            "init_args": {"config": "debug", "tokenizer": str(FIXTURES / "pi05" / "tokenizer"), "freeze": freeze},
        },
        "data": {
            "class_path": "forge_lightning.datamodules.lerobot.LeRobotDataModule",
            "init_args": {
                "roots": [str(FIXTURES / "lerobot" / "v30")],
                "delta_timestamps": {"action": [0.0, 0.1, 0.2, 0.3, 0.4]},
                "normalization": {"observation.state": "quantiles", "action": "quantiles"},
                "batch_size": 2,
                "num_workers": 0,
                "pin_memory": False,
            },
        },
        "optimizer": {"lr": 1e-3},
        "scheduler": {"name": "constant"},
    }  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _fit(root: Path, name: str, strategy: dict, freeze: list[str] | None = None) -> list[float]:
    path = _config(root, name, strategy, freeze or [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "forge_lightning", "fit", "--config", str(path)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_clean_exit(proc)
    rows = csv.DictReader((root / name / "version_0" / "metrics.csv").open())
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


DDP = {"class_path": "forge_lightning.strategies.DDPStrategy"}
ZERO1 = {"class_path": "forge_lightning.strategies.ZeRO1Strategy"}


def _fsdp2(**options) -> dict:
    return {"class_path": "forge_lightning.strategies.FSDP2Strategy", "init_args": options}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pi05_strategies")


@pytest.fixture(scope="module")
def ddp_losses(root) -> list[float]:
    losses = _fit(root, "ddp", DDP)
    assert len(losses) == STEPS and len(set(losses)) == STEPS  # it trains
    return losses


@pytest.fixture(scope="module")
def ddp_frozen_vision_losses(root) -> list[float]:
    return _fit(root, "ddp_frozen", DDP, freeze=["vision"])


@pytest.mark.parametrize(
    ("name", "strategy"),
    [
        ("zero1", ZERO1),
        ("fsdp2", _fsdp2()),
        ("fsdp2_vision_replicated", _fsdp2(replicated_components=["vision"])),
    ],
)
def test_pi05_strategies_match_ddp(root, ddp_losses, name, strategy):
    losses = _fit(root, name, strategy)
    assert losses == pytest.approx(ddp_losses, rel=2e-5, abs=1e-6)


def test_pi05_fsdp2_with_the_frozen_vision_tower_unsharded_matches_ddp(root, ddp_frozen_vision_losses):
    losses = _fit(root, "fsdp2_vision_unsharded", _fsdp2(unsharded_components=["vision"]), freeze=["vision"])
    assert losses == pytest.approx(ddp_frozen_vision_losses, rel=2e-5, abs=1e-6)

"""Shared fixtures: the committed LeRobot datasets and lerobot's own readings of them.

``tests/fixtures/lerobot/`` holds datasets written by lerobot (v2.1 by 0.3.3, v3.0 by 0.4.4), a v2.0 copy of
the v2.1 one (read by lerobot 0.3.3), and one written by ``LeRobotWriter`` (read by lerobot 0.4.4), each with
``NAME_reading.safetensors``: what ``lerobot.datasets.lerobot_dataset.LeRobotDataset`` returned for it.
Rebuild them with ``scripts/make_lerobot_fixtures.sh``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("av")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot"
DATASETS = ("v20", "v21", "v30", "forge_v30")


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def delta_timestamps() -> dict[str, list[float]]:
    """The delta_timestamps lerobot's ``delta/*`` readings were taken with."""
    return json.loads((FIXTURES / "v30_reading.json").read_text())["delta_timestamps"]


@pytest.fixture(scope="session")
def reference():
    """Loads lerobot's saved reading of a fixture (tensors keyed ``plain/*``, ``delta/*``, ``stats/*``)."""
    from safetensors.torch import load_file

    return lambda name: load_file(str(FIXTURES / f"{name}_reading.safetensors"))


@pytest.fixture
def copy_of(tmp_path: Path):
    """Copies a fixture dataset into a temporary directory (for tests that modify it)."""
    return lambda name: Path(shutil.copytree(FIXTURES / name, tmp_path / name))

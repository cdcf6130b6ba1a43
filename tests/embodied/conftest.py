"""Shared fixtures: the committed Pi0.5 reference made by lerobot 0.6.1's own ``PI05Policy``.

``tests/fixtures/pi05/`` holds a tiny random Pi0.5 in lerobot's checkpoint layout, its tokenizer, the inputs and
lerobot's outputs for them; ``scripts/make_pi05_fixture.sh`` rebuilds it (see docs/embodied.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pi05"


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    return FIXTURE


@pytest.fixture(scope="session")
def meta() -> dict[str, Any]:
    """Sizes, versions, cameras, tasks and the prompts lerobot built."""
    return json.loads((FIXTURE / "tiny_sizes.json").read_text())


@pytest.fixture(scope="session")
def inputs() -> dict[str, torch.Tensor]:
    """Raw images, normalised state and actions, noise, flow times, lerobot's tokens."""
    return load_file(str(FIXTURE / "inputs.safetensors"))


@pytest.fixture(scope="session")
def expected() -> dict[str, torch.Tensor]:
    """lerobot's outputs: preprocessed images, prefix embeddings, losses, sampled actions."""
    return load_file(str(FIXTURE / "expected.safetensors"))


@pytest.fixture()
def lerobot_batch(inputs: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The fixture's observation and actions as a LeRobot data-module batch (state and actions normalised)."""
    batch: dict[str, Any] = {key: inputs[key] for key in meta["present_cameras"]}
    batch["observation.state"] = inputs["observation.state"]
    batch["action"] = inputs["action"]
    batch["task"] = list(meta["tasks"])
    return batch

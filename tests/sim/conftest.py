"""Shared fixtures: Reach2D expert demonstrations written as a LeRobot v3.0 dataset, its prompt tokenizer, and a
scripted policy that plays Reach2D from the camera image alone (no privileged state)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("gymnasium")
pytest.importorskip("pyarrow")
pytest.importorskip("av")

NUM_EPISODES = 12


@pytest.fixture(scope="session")
def reach_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """12 expert episodes (seeds 0-11) and the tokenizer, as ``python -m forge_lightning.sim.record`` writes them."""
    from forge_lightning.sim.record import main as record

    root = tmp_path_factory.mktemp("reach2d") / "data"
    record(["--output", str(root), "--episodes", str(NUM_EPISODES)])
    return {"dataset": root / "reach2d", "tokenizer": root / "tokenizer", "episodes": NUM_EPISODES}


class ImagePolicy:
    """Finds the red target in the camera image (red-weighted centroid) and plans the expert's straight path to it
    from the state: a scripted policy that works only if the rollout hands it the image and state correctly.

    Args:
        chunk_size: actions per chunk.
        max_speed: the env's ``max_speed``.
    """

    def __init__(self, chunk_size: int = 4, max_speed: float = 0.1) -> None:
        self.chunk_size, self.max_speed = chunk_size, max_speed
        self.calls: list[int] = []

    def target(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        """Target positions ``[B, 2]`` in arena units from images ``[B, 3, H, W]`` in ``[0, 1]``."""
        H, W = images_BCHW.shape[-2:]
        redness = (images_BCHW[:, 0] - images_BCHW[:, 1]).clamp(min=0)  # [B, H, W]
        xs = ((torch.arange(W) + 0.5) / W * 2 - 1).view(1, 1, W)
        ys = (1 - (torch.arange(H) + 0.5) / H * 2).view(1, H, 1)
        total = redness.sum(dim=(1, 2))
        return torch.stack(
            [(redness * xs).sum(dim=(1, 2)) / total, (redness * ys).sum(dim=(1, 2)) / total], -1
        )

    def predict_action_chunk(self, batch: Mapping[str, Any]) -> torch.Tensor:
        target = self.target(batch["observation.images.top"])
        position = batch["observation.state"].clone()
        self.calls.append(position.shape[0])
        chunk = []
        for _ in range(self.chunk_size):
            action = ((target - position) / self.max_speed).clamp(-1, 1)
            position = position + action * self.max_speed
            chunk.append(action)
        return torch.stack(chunk, dim=1)  # [B, C, 2]


@pytest.fixture()
def image_policy() -> ImagePolicy:
    return ImagePolicy()


def _first_observation(seed: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from forge_lightning.sim.envs import make_env

    env = make_env("forge/Reach2D-v0")
    obs, info = env.reset(seed=seed)
    env.close()
    return obs, info


@pytest.fixture()
def first_observation():
    """``seed -> (obs, info)`` of the Reach2D episode that ``reset(seed=seed)`` starts."""
    return _first_observation

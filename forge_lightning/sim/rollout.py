"""Closed-loop rollouts of an action-chunking policy in a vector env.

::

    env obs ─ adapter ─ LeRobot features ─ as the data module yields them (frames CHW in [0, 1], normalised
        state: the policy's own Normalizer) ─ policy.predict_action_chunk ─ chunk [n, C, A] in dataset units
        ─ adapter ─ first n_action_steps actions queued per env, executed open-loop, then the env re-plans

Each env re-plans when its queue runs dry; envs that need a plan in the same step share one policy call.
Finished envs are reset at once with the seed of the next episode (episode ``i``: ``seed + i``), so the results
do not depend on the number of envs except through the batching of the policy's noise draws.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from forge_lightning.sim.adapters import EnvAdapter
from forge_lightning.sim.metrics import EpisodeRecord


class ChunkPolicy(Protocol):
    """Anything that maps a batch of observations to action chunks ``[B, C, A]`` (e.g. ``Pi05Policy``)."""

    def predict_action_chunk(self, batch: Mapping[str, Any]) -> torch.Tensor: ...


class RandomPolicy:
    """Uniformly random actions inside an action space: the baseline a trained policy must beat.

    Args:
        action_space: the env's (single) action space, in the units the adapter passes on unchanged.
        chunk_size: actions per chunk.
        seed: seed of its generator.
    """

    def __init__(self, action_space: spaces.Box, chunk_size: int = 1, seed: int = 0) -> None:
        self.low, self.high = action_space.low, action_space.high
        self.chunk_size = chunk_size
        self.rng = np.random.default_rng(seed)

    def predict_action_chunk(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Random chunks ``[B, chunk_size, A]`` for a batch of ``B`` observations (counted by its tasks)."""
        shape = (len(batch["task"]), self.chunk_size, *self.low.shape)
        return torch.from_numpy(self.rng.uniform(self.low, self.high, size=shape))


def policy_batch(
    features: Mapping[str, np.ndarray],
    rows: Sequence[int],
    task: str,
    *,
    normalizer: Any = None,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """A policy batch of some envs' features, converted the way ``LeRobotDataset`` yields training frames.

    Cameras (uint8 ``(N, H, W, 3)``) become float ``[n, 3, H, W]`` in ``[0, 1]``; features the normalizer has a
    mode for are normalised with its ``normalize`` (the data module's statistics, stored with the policy).

    Args:
        features: the adapter's features of every env.
        rows: the envs to put in the batch.
        task: the task string of every sample.
        normalizer: a :class:`~forge_lightning.datamodules.lerobot.Normalizer` (``None``: none).
        device: where the tensors go.
    """
    batch: dict[str, Any] = {}
    for key, value in features.items():
        tensor = torch.from_numpy(np.ascontiguousarray(value[list(rows)]))
        if tensor.dtype == torch.uint8 and tensor.ndim == 4:
            tensor = tensor.permute(0, 3, 1, 2).to(torch.float32) / 255
        if normalizer is not None and key in normalizer.modes:
            tensor = normalizer.normalize(key, tensor)
        batch[key] = tensor.to(device)
    batch["task"] = [task] * len(rows)
    return batch


class Rollout:
    """Runs a policy for a number of episodes in a vector env (autoreset disabled, see :mod:`.envs`).

    Args:
        policy: the policy (its ``normalizer`` and ``device`` attributes are used when present).
        envs: the vector env.
        adapter: the env's adapter.
        n_action_steps: actions executed from each chunk before re-planning (default: the whole chunk).
        task: the task string (default: the adapter's).
        num_videos: the first episodes whose camera frames are kept.
    """

    def __init__(
        self,
        policy: ChunkPolicy,
        envs: gym.vector.VectorEnv,
        adapter: EnvAdapter,
        *,
        n_action_steps: int | None = None,
        task: str | None = None,
        num_videos: int = 0,
    ) -> None:
        if n_action_steps is not None and n_action_steps < 1:
            raise ValueError(f"n_action_steps ({n_action_steps}) must be positive")
        self.policy, self.envs, self.adapter = policy, envs, adapter
        self.n_action_steps, self.num_videos = n_action_steps, num_videos
        self.task = adapter.task if task is None else task
        self.normalizer = getattr(policy, "normalizer", None)
        self.device = getattr(policy, "device", "cpu")
        self.action_space = envs.single_action_space
        n = envs.num_envs
        self.queues: list[deque[np.ndarray]] = [deque() for _ in range(n)]
        self.active: list[EpisodeRecord | None] = [None] * n
        self._next = self._total = self._seed = 0  # next episode index, episodes to run, base seed

    def run(self, num_episodes: int, seed: int = 0) -> list[EpisodeRecord]:
        """Episodes ``0 .. num_episodes - 1``, episode ``i`` from ``reset(seed=seed + i)``, in index order."""
        if num_episodes < 1:
            raise ValueError(f"num_episodes ({num_episodes}) must be positive")
        self._next, self._total, self._seed = 0, num_episodes, seed
        finished: list[EpisodeRecord] = []
        obs = self._reset(np.ones(self.envs.num_envs, dtype=bool))
        while len(finished) < num_episodes:
            features = self.adapter.observation(obs)
            self._plan(features)
            actions = np.stack([self._next_action(i) for i in range(self.envs.num_envs)])
            for i, record in enumerate(self.active):
                if record is not None and record.frames is not None:
                    record.frames.append(features[self.adapter.video_key][i])
            obs, reward, terminated, truncated, info = self.envs.step(actions)
            done = np.logical_or(terminated, truncated)
            final = self.adapter.observation(obs) if done.any() else {}
            for i, record in enumerate(self.active):
                if record is None:
                    continue
                record.reward += float(reward[i])
                record.length += 1
                record.success = record.success or self.adapter.success(info, i)
                if done[i]:
                    if record.frames is not None:
                        record.frames.append(final[self.adapter.video_key][i])
                    finished.append(record)
            if done.any():
                obs = self._reset(done)
        return sorted(finished, key=lambda r: r.index)

    def _reset(self, mask: np.ndarray) -> Any:
        """Resets the masked envs: each gets the next episode, or none (idle) when all are handed out."""
        seeds: list[int | None] = [None] * self.envs.num_envs
        for i in np.flatnonzero(mask):
            self.queues[i].clear()
            self.active[i] = None
            if self._next < self._total:
                index = self._next
                self._next += 1
                seeds[i] = self._seed + index
                frames: list[np.ndarray] | None = [] if index < self.num_videos else None
                self.active[i] = EpisodeRecord(index=index, seed=self._seed + index, frames=frames)
        obs, _ = self.envs.reset(seed=seeds, options={"reset_mask": np.asarray(mask, dtype=bool)})
        return obs

    def _plan(self, features: Mapping[str, np.ndarray]) -> None:
        rows = [i for i, record in enumerate(self.active) if record is not None and not self.queues[i]]
        if not rows:
            return
        batch = policy_batch(features, rows, self.task, normalizer=self.normalizer, device=self.device)
        chunk = self.policy.predict_action_chunk(batch)
        chunk_NCA = chunk.detach().to("cpu", torch.float64).numpy()
        steps = (
            chunk_NCA.shape[1]
            if self.n_action_steps is None
            else min(self.n_action_steps, chunk_NCA.shape[1])
        )
        for row, actions in zip(rows, chunk_NCA):
            self.queues[row].extend(self.adapter.action(actions[:steps], self.action_space))

    def _next_action(self, i: int) -> np.ndarray:
        if self.active[i] is None:  # idle env: any valid action, its result is ignored
            return ((self.action_space.low + self.action_space.high) / 2).astype(self.action_space.dtype)
        return self.queues[i].popleft()

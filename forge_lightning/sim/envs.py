"""Building single and vectorised gymnasium envs by id, with the adapter's package imported and its defaults.

Vector envs run with autoreset disabled: the rollout resets each finished env itself, with the seed of the
next episode, so episode ``i`` always starts from ``reset(seed=seed + i)`` whatever the number of envs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import gymnasium as gym

from forge_lightning.sim.adapters import adapter_for

VECTORIZATIONS = ("sync", "async")


def make_env(
    env_id: str, env_kwargs: Mapping[str, Any] | None = None, max_episode_steps: int | None = None
) -> gym.Env:
    """One env: ``gym.make(env_id)`` with the adapter's default keyword arguments updated by ``env_kwargs``.

    Args:
        env_id: a supported id (see :data:`forge_lightning.sim.adapters.ADAPTERS`).
        env_kwargs: keyword arguments of the env (override the adapter's).
        max_episode_steps: time limit (default: the id's registered one).
    """
    adapter = adapter_for(env_id)
    adapter.prepare()
    kwargs = {**adapter.env_kwargs, **(env_kwargs or {})}
    if max_episode_steps is not None:
        kwargs["max_episode_steps"] = max_episode_steps
    return gym.make(env_id, **kwargs)


def make_vector_env(
    env_id: str,
    num_envs: int,
    *,
    vectorization: str = "sync",
    env_kwargs: Mapping[str, Any] | None = None,
    max_episode_steps: int | None = None,
) -> gym.vector.VectorEnv:
    """``num_envs`` copies of an env in a ``SyncVectorEnv`` (one process) or ``AsyncVectorEnv`` (one process
    each), autoreset disabled.

    Async workers are spawned, never forked: the caller is often a training process with CUDA, NCCL or OpenMP
    threads, whose locks a forked child would inherit held.

    Args:
        env_id: a supported id.
        num_envs: envs stepped together.
        vectorization: ``sync`` or ``async``.
        env_kwargs: keyword arguments of each env.
        max_episode_steps: time limit (default: the id's registered one).
    """
    if vectorization not in VECTORIZATIONS:
        raise ValueError(f"vectorization ({vectorization!r}) must be one of {VECTORIZATIONS}")
    if num_envs < 1:
        raise ValueError(f"num_envs ({num_envs}) must be positive")
    adapter_for(env_id).prepare()  # fail here, in this process, when the package is missing
    factory = functools.partial(make_env, env_id, dict(env_kwargs or {}), max_episode_steps)
    mode = gym.vector.AutoresetMode.DISABLED
    if vectorization == "async":
        return gym.vector.AsyncVectorEnv([factory] * num_envs, autoreset_mode=mode, context="spawn")
    return gym.vector.SyncVectorEnv([factory] * num_envs, autoreset_mode=mode)

"""Simulators for closed-loop evaluation: env adapters, vectorised rollouts, metrics, videos, and the
project's own ``forge/Reach2D-v0`` with a scripted expert.

Needs gymnasium (the ``embodied`` extra); PushT and the ALOHA tasks need the ``sim`` extra. Public names are
imported lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ADAPTERS": "adapters",
    "EnvAdapter": "adapters",
    "adapter_for": "adapters",
    "make_env": "envs",
    "make_vector_env": "envs",
    "EvalConfig": "evaluate",
    "EvalReport": "evaluate",
    "evaluate_policy": "evaluate",
    "EpisodeRecord": "metrics",
    "mean_interval": "metrics",
    "summarize": "metrics",
    "wilson_interval": "metrics",
    "Reach2DEnv": "reach",
    "Reach2DExpert": "reach",
    "RandomPolicy": "rollout",
    "Rollout": "rollout",
    "policy_batch": "rollout",
    "write_video": "video",
}

__all__ = [
    "ADAPTERS",
    "EnvAdapter",
    "EpisodeRecord",
    "EvalConfig",
    "EvalReport",
    "RandomPolicy",
    "Reach2DEnv",
    "Reach2DExpert",
    "Rollout",
    "adapter_for",
    "evaluate_policy",
    "make_env",
    "make_vector_env",
    "mean_interval",
    "policy_batch",
    "summarize",
    "wilson_interval",
    "write_video",
]

if TYPE_CHECKING:
    from forge_lightning.sim.adapters import ADAPTERS, EnvAdapter, adapter_for
    from forge_lightning.sim.envs import make_env, make_vector_env
    from forge_lightning.sim.evaluate import EvalConfig, EvalReport, evaluate_policy
    from forge_lightning.sim.metrics import EpisodeRecord, mean_interval, summarize, wilson_interval
    from forge_lightning.sim.reach import Reach2DEnv, Reach2DExpert
    from forge_lightning.sim.rollout import RandomPolicy, Rollout, policy_batch
    from forge_lightning.sim.video import write_video


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

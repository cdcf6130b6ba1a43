"""Closed-loop evaluation of a policy: settings, the run, its report, videos and logging.

Shared by ``forge-eval`` (:mod:`forge_lightning.tools.evaluate`) and the ``ClosedLoopEval`` callback.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from forge_lightning.sim.adapters import adapter_for
from forge_lightning.sim.envs import VECTORIZATIONS, make_vector_env
from forge_lightning.sim.metrics import EpisodeRecord, summarize
from forge_lightning.sim.rollout import ChunkPolicy, Rollout
from forge_lightning.sim.video import write_video


@dataclass(kw_only=True)
class EvalConfig:
    """What a closed-loop evaluation runs.

    Args:
        env: gymnasium id of a supported env (``forge/Reach2D-v0``, ``gym_pusht/PushT-v0``,
            ``gym_aloha/AlohaInsertion-v0``, ``gym_aloha/AlohaTransferCube-v0``).
        env_kwargs: keyword arguments of the env (override its adapter's defaults).
        num_episodes: episodes to run.
        num_envs: envs stepped together (vectorised).
        vectorization: ``sync`` (one process) or ``async`` (one process per env).
        n_action_steps: actions executed from each predicted chunk before re-planning (default: all).
        max_episode_steps: time limit (default: the env's registered one).
        task: the task string given to the policy (default: the adapter's).
        seed: episode ``i`` starts from ``reset(seed=seed + i)``; keep it away from the seeds of the training
            demonstrations.
        num_videos: the first episodes written as mp4 videos.
        video_fps: frame rate of the videos.
        confidence: level of the reported intervals.
    """

    env: str = "forge/Reach2D-v0"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    num_episodes: int = 50
    num_envs: int = 8
    vectorization: str = "sync"
    n_action_steps: int | None = None
    max_episode_steps: int | None = None
    task: str | None = None
    seed: int = 1_000_000
    num_videos: int = 2
    video_fps: int = 10
    confidence: float = 0.95

    def __post_init__(self) -> None:
        adapter_for(self.env)  # an unknown id fails here, naming the supported ones
        for name in ("num_episodes", "num_envs", "video_fps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        if self.vectorization not in VECTORIZATIONS:
            raise ValueError(f"vectorization ({self.vectorization!r}) must be one of {VECTORIZATIONS}")
        if self.num_videos < 0:
            raise ValueError(f"num_videos ({self.num_videos}) must not be negative")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> EvalConfig:
        """The fields of ``values`` that this class has (e.g. a ``ClosedLoopEval`` callback's ``init_args``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


@dataclass
class EvalReport:
    """The result of an evaluation.

    Args:
        metrics: success rate, mean reward and length with their intervals (see :func:`.metrics.summarize`),
            plus ``seconds``.
        episodes: the episode records (frames dropped once written).
        videos: the written mp4 files.
    """

    metrics: dict[str, float]
    episodes: list[EpisodeRecord]
    videos: list[Path] = field(default_factory=list)

    def format(self, name: str = "policy") -> str:
        """One line: success rate with its interval, mean reward and length with theirs, episodes."""
        m = self.metrics
        return (
            f"{name}: success {m['success_rate']:.3f} [{m['success_ci_low']:.3f}, {m['success_ci_high']:.3f}], "
            f"reward {m['mean_reward']:.3f} [{m['reward_ci_low']:.3f}, {m['reward_ci_high']:.3f}], "
            f"length {m['mean_length']:.1f} [{m['length_ci_low']:.1f}, {m['length_ci_high']:.1f}] "
            f"over {int(m['episodes'])} episodes ({m['seconds']:.1f} s)"
        )


def evaluate_policy(
    policy: ChunkPolicy, config: EvalConfig, *, video_dir: str | Path | None = None
) -> EvalReport:
    """Runs ``config.num_episodes`` episodes of ``policy`` in closed loop and summarises them.

    A ``torch.nn.Module`` policy runs in eval mode (its mode is restored afterwards); the global torch RNG is
    seeded from ``config.seed`` for the policy's noise and restored afterwards, so a run inside training neither
    depends on nor disturbs the training's random stream.

    Args:
        policy: anything with ``predict_action_chunk(batch)`` (e.g. ``Pi05Policy``).
        config: what to run.
        video_dir: where the first ``config.num_videos`` episodes are written as mp4 (``None``: no videos).
    """
    adapter = adapter_for(config.env)
    envs = make_vector_env(
        config.env,
        min(config.num_envs, config.num_episodes),
        vectorization=config.vectorization,
        env_kwargs=config.env_kwargs,
        max_episode_steps=config.max_episode_steps,
    )
    num_videos = config.num_videos if video_dir is not None else 0
    rollout = Rollout(
        policy, envs, adapter, n_action_steps=config.n_action_steps, task=config.task, num_videos=num_videos
    )
    was_training = isinstance(policy, torch.nn.Module) and policy.training
    start = time.perf_counter()
    try:
        if isinstance(policy, torch.nn.Module):
            policy.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(config.seed)
            episodes = rollout.run(config.num_episodes, seed=config.seed)
    finally:
        envs.close()
        if was_training:
            policy.train()
    metrics = {**summarize(episodes, config.confidence), "seconds": time.perf_counter() - start}
    videos = _write_videos(episodes, video_dir, config.video_fps) if video_dir is not None else []
    return EvalReport(metrics=metrics, episodes=episodes, videos=videos)


def _write_videos(episodes: Sequence[EpisodeRecord], video_dir: str | Path, fps: int) -> list[Path]:
    written = []
    for record in episodes:
        if record.frames:
            outcome = "success" if record.success else "failure"
            written.append(
                write_video(Path(video_dir) / f"episode_{record.index:03d}_{outcome}.mp4", record.frames, fps)
            )
            record.frames = None
    return written


def log_report(
    loggers: Sequence[Any], report: EvalReport, *, prefix: str = "eval", step: int | None = None
) -> None:
    """Logs the metrics to every Lightning logger and the videos to those that take videos (W&B)."""
    metrics = {f"{prefix}/{k}": v for k, v in report.metrics.items()}
    for logger in loggers:
        logger.log_metrics(metrics, step=step)
        if report.videos and hasattr(logger, "log_video"):
            captions = [path.stem for path in report.videos]
            logger.log_video(f"{prefix}/videos", [str(p) for p in report.videos], step=step, caption=captions)

"""Closed-loop evaluation of a policy in a simulator during and after training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from forge_lightning.contracts import traits_of


class ClosedLoopEval(Callback):
    """Runs the policy in a gymnasium simulator every ``every_n_steps`` optimizer steps and at the end of training,
    logging ``eval/success_rate`` (with its Wilson interval), ``eval/mean_reward``, ``eval/mean_length`` and the
    first episodes' videos (to W&B when a ``WandbLogger`` is configured; mp4 files under ``video_dir``).

    The policy is anything with ``predict_action_chunk(batch)`` (``Pi05Policy``); observations are converted and
    normalised as the data module does for training (see :mod:`forge_lightning.sim.rollout`). The evaluation runs
    on global rank 0 while the other ranks wait: a model sharded across ranks (FSDP2, Megatron) cannot run a
    forward on one rank, and is refused. ``forge-eval --config`` reads these arguments from the run's YAML.

    Args:
        env: gymnasium id of a supported env (see :data:`forge_lightning.sim.adapters.ADAPTERS`).
        num_episodes: episodes per evaluation.
        num_envs: envs stepped together.
        every_n_steps: evaluate every ``n`` optimizer steps (``None``: only at the end of training).
        at_train_end: also evaluate when training ends.
        n_action_steps: actions executed from each chunk before re-planning (default: the whole chunk).
        env_kwargs: keyword arguments of the env.
        vectorization: ``sync`` or ``async``.
        max_episode_steps: time limit (default: the env's registered one).
        task: the task string (default: the env adapter's).
        seed: episode ``i`` starts from ``reset(seed=seed + i)``.
        num_videos: episodes written as videos per evaluation.
        video_dir: where videos go (default: ``<log_dir>/closed_loop``), in a folder per step.
    """

    def __init__(
        self,
        env: str = "forge/Reach2D-v0",
        num_episodes: int = 20,
        num_envs: int = 8,
        every_n_steps: int | None = None,
        at_train_end: bool = True,
        n_action_steps: int | None = None,
        env_kwargs: dict[str, Any] | None = None,
        vectorization: str = "sync",
        max_episode_steps: int | None = None,
        task: str | None = None,
        seed: int = 1_000_000,
        num_videos: int = 1,
        video_dir: str | None = None,
    ) -> None:
        from forge_lightning.sim.evaluate import EvalConfig

        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps ({every_n_steps}) must be positive or null")
        self.config = EvalConfig(
            env=env,
            env_kwargs=dict(env_kwargs or {}),
            num_episodes=num_episodes,
            num_envs=num_envs,
            vectorization=vectorization,
            n_action_steps=n_action_steps,
            max_episode_steps=max_episode_steps,
            task=task,
            seed=seed,
            num_videos=num_videos,
        )
        self.every_n_steps, self.at_train_end, self.video_dir = every_n_steps, at_train_end, video_dir
        self.history: list[tuple[int, dict[str, float]]] = []  # rank 0's results
        self._last_step: int | None = None  # on every rank, so all ranks agree on when to evaluate

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "predict_action_chunk"):
            raise TypeError(
                f"ClosedLoopEval needs a policy with predict_action_chunk(batch); got {type(pl_module).__name__}"
            )
        if trainer.world_size > 1 and traits_of(trainer.strategy).shards_model:
            raise ValueError(
                f"ClosedLoopEval runs the policy on rank 0 only, which a sharded model ({type(trainer.strategy).__name__}) "
                "cannot do: evaluate its checkpoint with forge-eval instead"
            )

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float] | None:
        """Runs one evaluation on rank 0 (the other ranks wait) and logs it; returns the metrics on rank 0."""
        from forge_lightning.sim.evaluate import evaluate_policy, log_report

        step = trainer.global_step
        self._last_step = step
        metrics = None
        if trainer.is_global_zero:
            root = Path(self.video_dir or Path(trainer.log_dir or trainer.default_root_dir) / "closed_loop")
            report = evaluate_policy(pl_module, self.config, video_dir=root / f"step_{step:06d}")
            metrics = report.metrics
            self.history.append((step, metrics))
            log_report(trainer.loggers, report, step=step)
            rank_zero_info(report.format(f"closed-loop eval at step {step} ({self.config.env})"))
        trainer.strategy.barrier("closed_loop_eval")
        return metrics

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        due = self.every_n_steps and step > 0 and step % self.every_n_steps == 0
        if due and self._last_step != step:  # accumulation: several batches end at one optimizer step
            self.evaluate(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.at_train_end and self._last_step != trainer.global_step:
            self.evaluate(trainer, pl_module)

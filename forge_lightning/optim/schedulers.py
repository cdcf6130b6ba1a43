"""Learning-rate schedules as multipliers of the peak learning rate, stepped once per optimizer step.

::

    cosine:  warmup ──/‾‾‾‾\\___ min_lr_ratio     (linear warmup, cosine decay over the remaining steps)
    wsd:     warmup ──/‾‾‾‾‾‾‾‾‾\\_ min_lr_ratio   (warmup, stable, then linear or cosine decay in the last part)
    constant: warmup ──/‾‾‾‾‾‾‾‾‾‾‾
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

_SCHEDULES = ("cosine", "linear", "constant", "wsd")


@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate schedule settings.

    Args:
        name: ``cosine`` (warmup + cosine), ``linear`` (warmup + linear decay), ``constant`` (warmup then
            flat) or ``wsd`` (warmup-stable-decay).
        warmup_steps: optimizer steps of linear warmup from 0 to the peak.
        total_steps: steps over which the schedule runs; ``None`` takes the trainer's estimate
            (``max_steps`` or epochs × steps per epoch).
        min_lr_ratio: final learning rate as a fraction of the peak.
        decay_fraction: for ``wsd``, the fraction of ``total_steps`` spent decaying at the end.
        decay_shape: for ``wsd``, ``linear``, ``cosine`` or ``sqrt`` decay.
    """

    name: str = "cosine"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    decay_shape: str = "linear"

    def __post_init__(self) -> None:
        if self.name not in _SCHEDULES:
            raise ValueError(f"scheduler.name ({self.name!r}) must be one of {_SCHEDULES}")
        if self.warmup_steps < 0:
            raise ValueError(f"scheduler.warmup_steps ({self.warmup_steps}) must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"scheduler.min_lr_ratio ({self.min_lr_ratio}) must be in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"scheduler.decay_fraction ({self.decay_fraction}) must be in (0, 1]")
        if self.decay_shape not in ("linear", "cosine", "sqrt"):
            raise ValueError(f"scheduler.decay_shape ({self.decay_shape!r}) must be linear, cosine or sqrt")


def _decay(progress: float, shape: str) -> float:
    """Multiplier going from 1 at progress 0 to 0 at progress 1."""
    progress = min(max(progress, 0.0), 1.0)
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "sqrt":
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


def lr_lambda(step: int, config: SchedulerConfig, total_steps: int) -> float:
    """The learning-rate multiplier at optimizer step ``step`` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    floor = config.min_lr_ratio
    if config.name == "constant":
        return 1.0
    if config.name == "wsd":
        decay_steps = max(1, round(config.decay_fraction * total_steps))
        decay_start = max(config.warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return floor + (1.0 - floor) * _decay(progress, config.decay_shape)
    progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
    shape = "cosine" if config.name == "cosine" else "linear"
    return floor + (1.0 - floor) * _decay(progress, shape)


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: SchedulerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following ``config`` over ``total_steps`` optimizer steps."""
    if total_steps <= 0:
        raise ValueError(
            f"the learning-rate schedule needs a positive number of steps, got {total_steps}: "
            "set trainer.max_steps or scheduler.total_steps"
        )
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_lambda, config=config, total_steps=total_steps)
    )

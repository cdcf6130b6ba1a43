"""Episode records and their summary: success rate with a Wilson interval, mean return and length with a
normal-approximation interval."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np


@dataclass
class EpisodeRecord:
    """One evaluated episode.

    Args:
        index: episode number within the evaluation.
        seed: the seed its env was reset with.
        success: whether the env reported success at any step.
        reward: the sum of its rewards.
        length: steps taken.
        frames: camera frames ``(H, W, 3)`` uint8 when the episode is recorded for a video.
    """

    index: int
    seed: int
    success: bool = False
    reward: float = 0.0
    length: int = 0
    frames: list[np.ndarray] | None = field(default=None, repr=False)


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence ({confidence}) must be in (0, 1)")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a success probability (Wilson, 1927): sound at 0 or ``trials`` successes too.

    ``(p + z^2 / 2n ± z sqrt(p (1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n)`` with ``p = successes / trials``.
    """
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes ({successes}) <= trials ({trials}) and trials >= 1")
    z, n, p = _z(confidence), trials, successes / trials
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    denominator = 1 + z * z / n
    return max(0.0, (centre - half) / denominator), min(1.0, (centre + half) / denominator)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and its normal-approximation interval ``mean ± z * std / sqrt(n)`` (sample std; zero width for one
    value)."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        raise ValueError("no values to average")
    mean = float(array.mean())
    if array.size == 1:
        return mean, mean, mean
    half = _z(confidence) * float(array.std(ddof=1)) / math.sqrt(array.size)
    return mean, mean - half, mean + half


def summarize(records: Sequence[EpisodeRecord], confidence: float = 0.95) -> dict[str, float]:
    """Success rate, mean return and mean length of the episodes, each with its ``confidence`` interval."""
    successes = sum(r.success for r in records)
    low, high = wilson_interval(successes, len(records), confidence)
    reward, reward_low, reward_high = mean_interval([r.reward for r in records], confidence)
    length, length_low, length_high = mean_interval([r.length for r in records], confidence)
    return {
        "episodes": float(len(records)),
        "success_rate": successes / len(records),
        "success_ci_low": low,
        "success_ci_high": high,
        "mean_reward": reward,
        "reward_ci_low": reward_low,
        "reward_ci_high": reward_high,
        "mean_length": length,
        "length_ci_low": length_low,
        "length_ci_high": length_high,
    }

"""Feature statistics (mean / std / min / max / quantiles) and per-feature normalisation.

Stats follow LeRobot's layout: per feature, arrays of the feature's shape (cameras: per channel, ``(3, 1, 1)``,
in ``[0, 1]`` pixel units) named ``min``, ``max``, ``mean``, ``std``, ``count`` and ``q01`` ... ``q99``.
Per-episode stats are exact (quantiles by linear interpolation; camera stats of uint8 frames from per-channel
256-bin histograms, :func:`image_stats`); several episodes are aggregated the way
LeRobot does (count-weighted means, the parallel variance formula, count-weighted quantiles), so a v2.1
dataset's per-episode stats give the same dataset stats LeRobot computes.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
NORMALIZATION_MODES = ("identity", "mean_std", "min_max", "quantiles", "quantile10")
_MODE_STATS = {
    "mean_std": ("mean", "std"),
    "min_max": ("min", "max"),
    "quantiles": ("q01", "q99"),
    "quantile10": ("q10", "q90"),
}
EPS = 1e-8
# Smallest std / range a feature is normalised by (in the feature's own units); see Normalizer.
SCALE_FLOOR = 1e-4


def quantile_name(q: float) -> str:
    """LeRobot's stat name of a quantile: ``0.01 -> 'q01'``."""
    return f"q{round(q * 100):02d}"


def feature_stats(values: np.ndarray, *, image: bool = False) -> dict[str, np.ndarray]:
    """Exact stats of one episode's values.

    Args:
        values: ``(frames, *shape)``; for cameras ``(frames, channels, height, width)`` in ``[0, 1]``.
        image: reduce over frames and pixels, keeping one value per channel as ``(channels, 1, 1)``.

    Returns:
        ``min``, ``max``, ``mean``, ``std`` (population), ``count`` (frames) and the ``QUANTILES``.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 1:
        values = values[:, None]
    axes: tuple[int, ...] = (0, 2, 3) if image else (0,)
    keep = image
    stats = {
        "min": values.min(axis=axes, keepdims=keep),
        "max": values.max(axis=axes, keepdims=keep),
        "mean": values.mean(axis=axes, keepdims=keep),
        "std": values.std(axis=axes, keepdims=keep),
        "count": np.array([values.shape[0]]),
    }
    for q in QUANTILES:
        stats[quantile_name(q)] = np.quantile(values, q, axis=axes, keepdims=keep)
    if image:  # (1, C, 1, 1) -> (C, 1, 1)
        stats = {k: v[0] if k != "count" else v for k, v in stats.items()}
    return stats


def image_stats(frames: np.ndarray, *, channel_axis: int = -1) -> dict[str, np.ndarray]:
    """Exact per-channel stats of one episode's uint8 frames, in ``[0, 1]`` pixel units, from 256-bin histograms.

    The same values as ``feature_stats(frames / 255, image=True)`` (up to float64 rounding, ~1e-16) at a
    fraction of its cost: one ``bincount`` per channel instead of float64 copies, reductions and sorts of every
    pixel (~10 s per camera for 300 frames at 224x224). With ``counts[k]`` pixels at level ``k / 255``:
    mean and (population) std are count-weighted sums over the 256 levels, min / max the first / last level
    present, and quantile ``q`` interpolates linearly (numpy's default) between the order statistics
    ``floor(q (n - 1))`` and the next one, read off the cumulative counts.

    Args:
        frames: uint8 frames ``(frames, ..., channels, ...)``, e.g. ``(T, H, W, C)`` or ``(T, C, H, W)``.
        channel_axis: the axis of ``frames`` holding the channels.

    Returns:
        ``min``, ``max``, ``mean``, ``std``, the ``QUANTILES`` (each ``(channels, 1, 1)``) and ``count``
        (frames), as :func:`feature_stats` gives them.

    Raises:
        TypeError: If ``frames`` is not uint8.
    """
    if frames.dtype != np.uint8:
        raise TypeError(
            f"image_stats needs uint8 frames, got {frames.dtype}: use feature_stats(..., image=True)"
        )
    frames = np.moveaxis(frames, channel_axis, -1)
    counts_CL = np.stack(
        [np.bincount(frames[..., c].ravel(), minlength=256) for c in range(frames.shape[-1])]
    ).astype(np.float64)  # [channels, 256 levels]
    stats = _histogram_stats(counts_CL, np.arange(256) / 255.0)
    stats = {name: value[:, None, None] for name, value in stats.items()}
    stats["count"] = np.array([frames.shape[0]])
    return stats


def _histogram_stats(counts_CL: np.ndarray, levels_L: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row stats of values given as counts per level (levels ascending); every row non-empty."""
    n_C = counts_CL.sum(axis=1)
    mean_C = counts_CL @ levels_L / n_C
    variance_C = (counts_CL * (levels_L - mean_C[:, None]) ** 2).sum(axis=1) / n_C
    present_CL = counts_CL > 0
    last = len(levels_L) - 1
    stats = {
        "min": levels_L[present_CL.argmax(axis=1)],
        "max": levels_L[last - present_CL[:, ::-1].argmax(axis=1)],
        "mean": mean_C,
        "std": np.sqrt(variance_C),
    }
    cumulative_CL = np.cumsum(counts_CL, axis=1)  # values at or below each level

    def order_statistic(k_C: np.ndarray) -> np.ndarray:  # the k-th smallest value (0-based) of each row
        return levels_L[(cumulative_CL <= k_C[:, None]).sum(axis=1)]

    for q in QUANTILES:
        position_C = q * (n_C - 1)
        below_C = np.floor(position_C)
        low_C, high_C = order_statistic(below_C), order_statistic(np.minimum(below_C + 1, n_C - 1))
        stats[quantile_name(q)] = low_C + (position_C - below_C) * (high_C - low_C)
    return stats


def aggregate_stats(
    episodes: list[Mapping[str, Mapping[str, np.ndarray]]],
) -> dict[str, dict[str, np.ndarray]]:
    """Dataset stats from per-episode stats (the combination rule LeRobot uses).

    Args:
        episodes: one ``{feature: {stat: array}}`` per episode.
    """
    keys = sorted({key for stats in episodes for key in stats})
    result = {}
    for key in keys:
        parts = [stats[key] for stats in episodes if key in stats]
        means = np.stack([np.asarray(p["mean"], dtype=np.float64) for p in parts])
        counts = np.stack([np.asarray(p["count"], dtype=np.float64) for p in parts])
        total = counts.sum(axis=0)
        weights = counts.reshape(counts.shape + (1,) * (means.ndim - counts.ndim))
        mean = (means * weights).sum(axis=0) / total
        variances = np.stack([np.asarray(p["std"], dtype=np.float64) ** 2 for p in parts])
        variance = ((variances + (means - mean) ** 2) * weights).sum(axis=0) / total
        merged = {
            "min": np.min(np.stack([p["min"] for p in parts]), axis=0),
            "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
            "mean": mean,
            "std": np.sqrt(variance),
            "count": total.astype(np.int64),
        }
        for name in [n for n in parts[0] if n.startswith("q") and n[1:].isdigit()]:
            if all(name in p for p in parts):
                merged[name] = (np.stack([p[name] for p in parts]) * weights).sum(axis=0) / total
        result[key] = merged
    return result


def to_jsonable(stats: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Stats as nested lists (LeRobot's ``stats.json`` form)."""
    return {k: {n: np.asarray(v).tolist() for n, v in values.items()} for k, values in stats.items()}


def write_stats_json(root: str | Path, stats: Mapping[str, Mapping[str, Any]]) -> Path:
    """Writes ``meta/stats.json`` under ``root``."""
    path = Path(root) / "meta" / "stats.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(stats), indent=4))
    return path


@dataclass(frozen=True, kw_only=True)
class Normalizer:
    """Per-feature normalisation with a dataset's stats (LeRobot's formulas, eps ``1e-8``).

    ``mean_std``: ``(x - mean) / (std + eps)``; ``min_max``: ``2 (x - min) / (max - min) - 1``; ``quantiles``
    and ``quantile10``: the same with ``q01`` / ``q99`` or ``q10`` / ``q90``.

    A scale (``std``, or the range ``high - low``) below ``SCALE_FLOOR`` (``1e-4``, absolute, in the feature's
    units) is raised to it, with one warning per feature naming the values. Such a scale only comes from a
    dimension that is constant (or nearly) in the data, e.g. padding or a joint that never moved: its training
    values normalise to 0 (or -1) either way, but LeRobot's eps-sized divisor maps any other value, at
    inference or from another dataset's stats, to ~1e8 times its deviation; the floor keeps it at 1e4 times.
    Real scales are far above it (radians, metres, grippers in [0, 1], pixels in [0, 1]: std >= ~1e-3), so
    every dimension above the floor is normalised exactly as LeRobot does (the Pi0.5 parity holds). The floor
    is absolute, not relative to the mean: a relative one would change features with large offsets and small
    spreads (encoder ticks), which are real. Negative or non-finite scales raise ``ValueError``.

    Args:
        stats: ``{feature: {stat: array}}``.
        modes: ``{feature: mode}``; features not named are left as they are.
    """

    stats: Mapping[str, Mapping[str, Any]]
    modes: Mapping[str, str]

    def __post_init__(self) -> None:
        for key, mode in self.modes.items():
            if mode not in NORMALIZATION_MODES:
                raise ValueError(f"normalization[{key!r}] ({mode!r}) must be one of {NORMALIZATION_MODES}")
            needed = _MODE_STATS.get(mode, ())
            missing = [n for n in needed if n not in self.stats.get(key, {})]
            if missing:
                raise ValueError(
                    f"normalization[{key!r}] ({mode!r}) needs the stats {missing} of {key!r}, which the dataset "
                    "lacks: compute them with `forge-data lerobot-stats ROOT`"
                )
            if needed:
                self._check_scale(key, mode)

    def _check_scale(self, key: str, mode: str) -> None:
        """Refuses a negative or non-finite scale; warns (once per feature) about one below the floor."""
        low_name, high_name = _MODE_STATS[mode]
        low, high = (np.asarray(self.stats[key][n], dtype=np.float64) for n in (low_name, high_name))
        scale, name = (high, high_name) if mode == "mean_std" else (high - low, f"{high_name} - {low_name}")
        if not (np.isfinite(low).all() and np.isfinite(high).all()) or (scale < 0).any():
            raise ValueError(
                f"normalization[{key!r}] ({mode!r}): stats {low_name} {low.ravel().tolist()} / {high_name} "
                f"{high.ravel().tolist()} must be finite with {name} >= 0: recompute them with "
                "`forge-data lerobot-stats ROOT --force`"
            )
        tiny = np.flatnonzero(scale.ravel() < SCALE_FLOOR)
        if tiny.size:
            values = [float(v) for v in scale.ravel()[tiny]]
            # one warning location (this module): Python's default filter shows a given message once per
            # location, so the datasets and the module that each build a Normalizer from the same stats warn
            # once per feature
            warnings.warn(
                f"normalization[{key!r}] ({mode!r}): {name} is {values} at dimension(s) {tiny.tolist()}, below "
                f"{SCALE_FLOOR:g}: those dimensions are divided by {SCALE_FLOOR:g} instead (they are constant in "
                "the data; if they should not be, recompute the stats with `forge-data lerobot-stats ROOT --force`)",
                stacklevel=2,
            )

    def _low_scale(self, key: str, like: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor]:
        """The mode, the offset and the floored scale (std, or high - low) of ``key`` in ``like``'s dtype."""
        mode = self.modes[key]
        low, high = (
            torch.as_tensor(np.asarray(self.stats[key][n]), dtype=like.dtype) for n in _MODE_STATS[mode]
        )
        scale = high if mode == "mean_std" else high - low
        return mode, low, scale.clamp_min(SCALE_FLOOR)

    def normalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Normalises ``x`` (feature ``key``) by its mode; identity for unnamed features."""
        if self.modes.get(key, "identity") == "identity":
            return x
        mode, low, scale = self._low_scale(key, x)
        if mode == "mean_std":
            return (x - low) / (scale + EPS)
        return (x - low) / scale * 2 - 1

    def unnormalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`normalize`."""
        if self.modes.get(key, "identity") == "identity":
            return x
        mode, low, scale = self._low_scale(key, x)
        if mode == "mean_std":
            return x * (scale + EPS) + low
        return (x + 1) / 2 * scale + low

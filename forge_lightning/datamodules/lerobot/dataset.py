"""Map-style reader of LeRobot v2.0 / v2.1 / v3.0 datasets, item for item like ``lerobot``'s ``LeRobotDataset``.

Item ``i`` is the ``i``-th frame of the selected episodes (in episode order)::

    {"observation.state": (2,), "action": (2,), "observation.images.cam": (3, H, W) float in [0, 1],
     "timestamp", "frame_index", "episode_index", "index", "task_index": 0-d, "task": str}

With ``delta_timestamps`` a key becomes a stack over its offsets (``(T, ...)``) and gains ``KEY_is_pad``:
offsets that fall outside the frame's episode are clamped to its first / last frame and flagged as padding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from forge_lightning.datamodules.lerobot.meta import LeRobotFormatError, LeRobotMeta
from forge_lightning.datamodules.lerobot.stats import Normalizer
from forge_lightning.datamodules.lerobot.video import VideoFrames


def delta_indices(
    delta_timestamps: Mapping[str, Sequence[float]], fps: int, tolerance_s: float
) -> dict[str, list[int]]:
    """Frame offsets of ``delta_timestamps``; each must be a whole number of frames (within ``tolerance_s``)."""
    result = {}
    for key, deltas in delta_timestamps.items():
        offsets = []
        for delta in deltas:
            frames = round(delta * fps)
            if abs(delta - frames / fps) > tolerance_s:
                raise ValueError(
                    f"delta_timestamps[{key!r}] ({delta}) is not a multiple of 1/fps (fps {fps}) "
                    f"within tolerance_s {tolerance_s}"
                )
            offsets.append(frames)
        result[key] = offsets
    return result


class LeRobotDataset(Dataset):
    """Frames of a local LeRobot dataset, with history / action chunks and optional normalisation.

    Args:
        root: dataset root (holding ``meta/info.json``).
        episodes: episode indices to read (default: all).
        delta_timestamps: per feature, offsets in seconds relative to the frame (e.g. ``action: [0, 0.1]``).
        normalization: per feature, ``mean_std``, ``min_max``, ``quantiles``, ``quantile10`` or ``identity``,
            applied with the dataset's stats (``stats`` overrides them).
        stats: stats to normalise with instead of the dataset's own (e.g. those of a mix of datasets).
        video_backend: ``pyav`` (default) or ``torchcodec`` (when importable).
        tolerance_s: allowed deviation of a delta timestamp from a whole frame.

    Raises:
        LeRobotFormatError: For a missing root, an unsupported version or unreadable files.
        ValueError: For unknown episodes / features or delta timestamps off the frame grid.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        episodes: Sequence[int] | None = None,
        delta_timestamps: Mapping[str, Sequence[float]] | None = None,
        normalization: Mapping[str, str] | None = None,
        stats: Mapping[str, Mapping[str, Any]] | None = None,
        video_backend: str = "pyav",
        tolerance_s: float = 1e-4,
    ) -> None:
        self.meta = LeRobotMeta(root)
        self.root = self.meta.root
        self.episodes = sorted(self.meta.episodes) if episodes is None else sorted({int(e) for e in episodes})
        unknown = [e for e in self.episodes if e not in self.meta.episodes]
        if unknown or not self.episodes:
            raise ValueError(
                f"episodes ({unknown or 'empty'}) not in {self.root} (has {len(self.meta.episodes)})"
            )
        for key in list(delta_timestamps or ()) + list(normalization or ()):
            if key not in self.meta.features:
                raise ValueError(f"{key!r} is not a feature of {self.root}: {sorted(self.meta.features)}")
        self.delta_indices = delta_indices(delta_timestamps or {}, self.meta.fps, tolerance_s)
        self.normalizer = None
        if normalization:
            source = stats if stats is not None else self.meta.stats
            if source is None:
                raise ValueError(
                    f"normalization needs stats but {self.root} has none: run `forge-data lerobot-stats {self.root}`"
                )
            self.normalizer = Normalizer(stats=source, modes=dict(normalization))
        self.columns, self.row_of_index = self.meta.load_frames(self.episodes)
        # item i -> global frame index, episode by episode
        self.index = np.concatenate(
            [np.arange(self.meta.episodes[e].start, self.meta.episodes[e].end) for e in self.episodes]
        )
        self.videos = VideoFrames(video_backend)

    @property
    def fps(self) -> int:
        """Frames per second."""
        return self.meta.fps

    @property
    def num_episodes(self) -> int:
        """Episodes this reader covers."""
        return len(self.episodes)

    def __len__(self) -> int:
        return len(self.index)

    def _value(self, key: str, rows: np.ndarray | int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.columns[key][rows]))

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} frames")
        index = int(self.index[i])
        row = int(self.row_of_index[index])
        episode = self.meta.episodes[int(self.columns["episode_index"][row])]
        item: dict[str, Any] = {}
        queries: dict[str, list[int]] = {}
        for key, offsets in self.delta_indices.items():
            queries[key] = [min(max(index + d, episode.start), episode.end - 1) for d in offsets]
            item[f"{key}_is_pad"] = torch.tensor(
                [not episode.start <= index + d < episode.end for d in offsets]
            )
        for key in self.columns:
            if key in queries:
                item[key] = self._value(key, self.row_of_index[queries[key]])
            else:
                item[key] = self._value(key, row)
        for key in self.meta.video_keys:
            item[key] = self._frames(episode, key, queries.get(key, [index]), stacked=key in queries)
        item["task"] = self.meta.tasks[int(self.columns["task_index"][row])]
        if self.normalizer is not None:
            for key in self.normalizer.modes:
                item[key] = self.normalizer.normalize(key, item[key])
        return item

    def _frames(self, episode: Any, key: str, indices: list[int], *, stacked: bool) -> torch.Tensor:
        name, start_s = episode.videos[key]
        timestamps = self.columns["timestamp"][self.row_of_index[indices]]
        # frame index in the file: round(timestamp * fps), shifted by where the episode starts in it
        in_file = [round((start_s + float(t)) * self.fps) for t in timestamps]
        try:
            frames = self.videos.frames(self.root / name, in_file, self.fps)
        except LeRobotFormatError as error:
            raise LeRobotFormatError(f"episode {episode.index}, {key}: {error}") from None
        frames = frames.to(torch.float32) / 255
        return frames if stacked else frames[0]

"""Computes a LeRobot dataset's stats (incl. quantiles) and writes them in the layout of its version.

=======  =====================================================================================
v2.0     ``meta/stats.json`` (dataset stats)
v2.1     ``meta/episodes_stats.jsonl`` (one line of stats per episode; readers aggregate them)
v3.0     ``meta/stats.json`` and the ``stats/<feature>/<stat>`` columns of the episodes parquet files
=======  =====================================================================================

Camera stats are per channel over every decoded pixel of every frame, in ``[0, 1]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from forge_lightning.datamodules.lerobot.meta import LeRobotMeta, read_parquet
from forge_lightning.datamodules.lerobot.stats import (
    aggregate_stats,
    feature_stats,
    image_stats,
    to_jsonable,
    write_stats_json,
)
from forge_lightning.datamodules.lerobot.video import VideoFrames

EpisodeStats = dict[int, dict[str, dict[str, np.ndarray]]]


def compute_episode_stats(meta: LeRobotMeta, *, video_backend: str = "pyav") -> EpisodeStats:
    """Exact per-episode stats of every numeric and video feature of the dataset."""
    episodes = sorted(meta.episodes)
    columns, row_of_index = meta.load_frames(episodes)
    videos = VideoFrames(video_backend)
    result: EpisodeStats = {}
    try:
        for e in episodes:
            episode = meta.episodes[e]
            rows = row_of_index[episode.start : episode.end]
            stats = {}
            for key, values in columns.items():
                stats[key] = feature_stats(values[rows].reshape(len(rows), -1).astype(np.float64))
            for key in meta.video_keys:
                name, start_s = episode.videos[key]
                frames = [round((start_s + float(t)) * meta.fps) for t in columns["timestamp"][rows]]
                pixels = videos.frames(meta.root / name, frames, meta.fps).numpy()  # [T, 3, H, W] uint8
                stats[key] = image_stats(pixels, channel_axis=1)
            result[e] = stats
    finally:
        videos.close()
    return result


def write_dataset_stats(root: str | Path, *, force: bool = False, video_backend: str = "pyav") -> list[Path]:
    """Computes the stats of the dataset at ``root`` and writes them in its version's layout.

    Args:
        root: dataset root.
        force: overwrite stats the dataset already has.
        video_backend: decoder for camera stats.

    Returns:
        The files written.

    Raises:
        FileExistsError: If the dataset has stats and ``force`` is not set.
    """
    meta = LeRobotMeta(root)
    if meta.stats is not None and not force:
        raise FileExistsError(f"{meta.root} already has stats: pass --force to recompute them")
    per_episode = compute_episode_stats(meta, video_backend=video_backend)
    if meta.version == "v2.1":
        path = meta.root / "meta" / "episodes_stats.jsonl"
        lines = [json.dumps({"episode_index": e, "stats": to_jsonable(s)}) for e, s in per_episode.items()]
        path.write_text("\n".join(lines) + "\n")
        return [path]
    written = [write_stats_json(meta.root, aggregate_stats(list(per_episode.values())))]
    if meta.version == "v3.0":
        written += _write_v3_episode_stats(meta, per_episode)
    return written


def _write_v3_episode_stats(meta: LeRobotMeta, per_episode: EpisodeStats) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = []
    for path in sorted((meta.root / "meta" / "episodes").glob("chunk-*/file-*.parquet")):
        table = read_parquet(path)
        table = table.drop_columns([c for c in table.column_names if c.startswith("stats/")])
        indices = table.column("episode_index").to_pylist()
        names = [(k, n) for k, stats in per_episode[indices[0]].items() for n in stats]
        for key, name in names:
            values = [np.asarray(per_episode[e][key][name]).tolist() for e in indices]
            table = table.append_column(f"stats/{key}/{name}", pa.array(values))
        pq.write_table(table, path)
        written.append(path)
    return written

"""LeRobot dataset metadata (v2.0, v2.1, v3.0): info, episodes, tasks, stats and the frame table.

The three layouts under a dataset ``ROOT``::

    v2.0 / v2.1                                   v3.0
    meta/info.json                                meta/info.json
    meta/episodes.jsonl   (index, tasks, length)  meta/episodes/chunk-XXX/file-XXX.parquet (+ file / video
    meta/tasks.jsonl                              meta/tasks.parquet                     offsets, stats/*)
    meta/stats.json        (v2.0)                 meta/stats.json
    meta/episodes_stats.jsonl (v2.1, per episode)
    data/chunk-XXX/episode_XXXXXX.parquet         data/chunk-XXX/file-XXX.parquet (many episodes per file)
    videos/chunk-XXX/KEY/episode_XXXXXX.mp4       videos/KEY/chunk-XXX/file-XXX.mp4 (episodes concatenated;
                                                  an episode starts at its ``from_timestamp``)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
STAT_NAMES = ("min", "max", "mean", "std", "count")


class LeRobotFormatError(ValueError):
    """A LeRobot dataset that cannot be read (missing, unknown version, corrupt file); names the path."""


@dataclass(frozen=True)
class Episode:
    """One episode: its frames are the global indices ``[start, end)``.

    Attributes:
        index: episode index.
        start: global index of its first frame.
        end: one past the global index of its last frame.
        data_file: parquet file holding its rows (relative to the root).
        videos: per camera key, ``(mp4 file relative to the root, timestamp of the episode's first frame)``.
        tasks: the episode's task strings.
    """

    index: int
    start: int
    end: int
    data_file: str
    videos: dict[str, tuple[str, float]] = field(default_factory=dict)
    tasks: tuple[str, ...] = ()

    @property
    def length(self) -> int:
        """Number of frames."""
        return self.end - self.start


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LeRobotFormatError(f"{path} is missing: not a LeRobot dataset root") from None
    except json.JSONDecodeError as error:
        raise LeRobotFormatError(f"{path} is not valid JSON: {error}") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise LeRobotFormatError(f"{path} is missing")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise LeRobotFormatError(f"{path}:{number} is not valid JSON: {error}") from None
    return rows


def read_parquet(path: Path, columns: list[str] | None = None) -> Any:
    """Reads a parquet file with pyarrow, turning a missing or corrupt file into :class:`LeRobotFormatError`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.exists():
        raise LeRobotFormatError(f"{path} is missing")
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as error:
        raise LeRobotFormatError(f"{path} is not a readable parquet file: {error}") from None


def column_to_numpy(column: Any, shape: list[int] | tuple[int, ...]) -> np.ndarray:
    """A pyarrow column of scalars or (nested) lists as an array ``(rows, *shape)`` (``(rows,)`` for ``[1]``)."""
    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    rows = len(column)
    while hasattr(column, "flatten") and hasattr(column.type, "value_type"):
        column = column.flatten()
    values = column.to_numpy(zero_copy_only=False)
    if values.size == rows:
        return values.reshape(rows) if list(shape) == [1] else values.reshape(rows, *shape)
    return values.reshape(rows, *shape)


class LeRobotMeta:
    """Metadata of a LeRobot dataset root: version, features, episodes, tasks and stats.

    Args:
        root: dataset root (holding ``meta/info.json``).

    Raises:
        LeRobotFormatError: If the root or a metadata file is missing or the version is not supported.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise LeRobotFormatError(f"LeRobot dataset root {str(self.root)!r} does not exist")
        self.info: dict[str, Any] = _read_json(self.root / "meta" / "info.json")
        self.version = str(self.info.get("codebase_version"))
        if self.version not in SUPPORTED_VERSIONS:
            raise LeRobotFormatError(
                f"{self.root}: codebase_version {self.version!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_VERSIONS)}"
            )
        self.fps = int(self.info["fps"])
        self.features: dict[str, dict[str, Any]] = self.info["features"]
        self.video_keys = [k for k, f in self.features.items() if f["dtype"] == "video"]
        if any(f["dtype"] == "image" for f in self.features.values()):
            raise LeRobotFormatError(f"{self.root}: image features stored in parquet are not supported yet")
        if self.version == "v3.0":
            self.episodes, self.tasks = self._load_v3_episodes(), self._load_v3_tasks()
        else:
            self.episodes, self.tasks = self._load_v2_episodes(), self._load_v2_tasks()
        self.stats, self.episodes_stats = self._load_stats()

    @property
    def total_frames(self) -> int:
        """Frames over all episodes."""
        return sum(episode.length for episode in self.episodes.values())

    def _load_v2_episodes(self) -> dict[int, Episode]:
        chunk = int(self.info.get("chunks_size", 1000))
        episodes, start = {}, 0
        for row in sorted(
            _read_jsonl(self.root / "meta" / "episodes.jsonl"), key=lambda r: r["episode_index"]
        ):
            index, length = int(row["episode_index"]), int(row["length"])
            videos = {
                key: (
                    self.info["video_path"].format(
                        episode_chunk=index // chunk, video_key=key, episode_index=index
                    ),
                    0.0,
                )
                for key in self.video_keys
            }
            data_file = self.info["data_path"].format(episode_chunk=index // chunk, episode_index=index)
            episodes[index] = Episode(
                index, start, start + length, data_file, videos, tuple(row.get("tasks", ()))
            )
            start += length
        return episodes

    def _load_v2_tasks(self) -> list[str]:
        rows = _read_jsonl(self.root / "meta" / "tasks.jsonl")
        tasks = [""] * (max((int(r["task_index"]) for r in rows), default=-1) + 1)
        for row in rows:
            tasks[int(row["task_index"])] = row["task"]
        return tasks

    def _load_v3_episodes(self) -> dict[int, Episode]:
        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise LeRobotFormatError(f"{self.root / 'meta' / 'episodes'} holds no episodes parquet files")
        episodes = {}
        for path in files:
            table = read_parquet(path)
            rows = table.drop_columns([c for c in table.column_names if c.startswith("stats/")]).to_pylist()
            for row in rows:
                videos = {}
                for key in self.video_keys:
                    name = self.info["video_path"].format(
                        video_key=key,
                        chunk_index=row[f"videos/{key}/chunk_index"],
                        file_index=row[f"videos/{key}/file_index"],
                    )
                    videos[key] = (name, float(row[f"videos/{key}/from_timestamp"]))
                data_file = self.info["data_path"].format(
                    chunk_index=row["data/chunk_index"], file_index=row["data/file_index"]
                )
                index = int(row["episode_index"])
                episodes[index] = Episode(
                    index,
                    int(row["dataset_from_index"]),
                    int(row["dataset_to_index"]),
                    data_file,
                    videos,
                    tuple(row.get("tasks") or ()),
                )
        return dict(sorted(episodes.items()))

    def _load_v3_tasks(self) -> list[str]:
        table = read_parquet(self.root / "meta" / "tasks.parquet")
        # pandas writes the task strings as the frame's index: the column named in the pandas metadata
        names = [c for c in table.column_names if c != "task_index"]
        if "task" in table.column_names:
            names = ["task"]
        order = np.argsort(table.column("task_index").to_numpy())
        strings = table.column(names[0]).to_pylist()
        return [strings[i] for i in order]

    def _load_stats(self) -> tuple[dict[str, dict[str, np.ndarray]] | None, dict[int, dict] | None]:
        from forge_lightning.datamodules.lerobot.stats import aggregate_stats

        stats_file = self.root / "meta" / "stats.json"
        episodes_file = self.root / "meta" / "episodes_stats.jsonl"
        episodes_stats = None
        if self.version == "v2.1" and episodes_file.exists():
            episodes_stats = {
                int(row["episode_index"]): _as_arrays(row["stats"]) for row in _read_jsonl(episodes_file)
            }
            # lerobot's v2.1 reader aggregates the per-episode stats at load time; so do we
            return aggregate_stats(list(episodes_stats.values())), episodes_stats
        if stats_file.exists():
            return _as_arrays(_read_json(stats_file)), None
        return None, None

    def load_frames(self, episodes: list[int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Reads the non-video columns of ``episodes``.

        Returns:
            ``(columns, row_of_index)``: arrays ``(rows, *shape)`` per feature, and for every global frame
            index of these episodes its row in ``columns`` (``-1`` elsewhere).
        """
        import pyarrow as pa

        names = [k for k in self.features if k not in self.video_keys]
        files = sorted({self.episodes[e].data_file for e in episodes})
        tables = [read_parquet(self.root / name) for name in files]
        for name, table in zip(files, tables):
            missing = [c for c in names if c not in table.column_names]
            if missing:
                raise LeRobotFormatError(f"{self.root / name} lacks the columns {missing} named in info.json")
        table = pa.concat_tables([t.select(names) for t in tables])
        columns = {k: column_to_numpy(table.column(k), self.features[k]["shape"]) for k in names}
        wanted = np.isin(columns["episode_index"], episodes)
        columns = {k: v[wanted] for k, v in columns.items()}
        row_of_index = np.full(max(self.episodes[e].end for e in episodes), -1, dtype=np.int64)
        row_of_index[columns["index"]] = np.arange(len(columns["index"]))
        for e in episodes:
            ep = self.episodes[e]
            if (row_of_index[ep.start : ep.end] < 0).any():
                raise LeRobotFormatError(f"{self.root / ep.data_file}: episode {e} lacks some of its frames")
        return columns, row_of_index


def _as_arrays(stats: dict[str, dict[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
    return {key: {name: np.asarray(value) for name, value in values.items()} for key, values in stats.items()}

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

from forge_lightning.datamodules.lerobot.schema import (
    SUPPORTED_VERSIONS,
    LeRobotFormatError,
    check_column_shape,
    field_error,
    format_path,
    is_int,
    shown,
    validate_info,
)

__all__ = [
    "STAT_NAMES",
    "SUPPORTED_VERSIONS",
    "Episode",
    "LeRobotFormatError",
    "LeRobotMeta",
    "column_to_numpy",
    "read_parquet",
]

STAT_NAMES = ("min", "max", "mean", "std", "count")


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
        meta_file: the metadata file that lists it (relative to the root), for error messages.
    """

    index: int
    start: int
    end: int
    data_file: str
    videos: dict[str, tuple[str, float]] = field(default_factory=dict)
    tasks: tuple[str, ...] = ()
    meta_file: str = ""

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


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line."""
    if not path.exists():
        raise LeRobotFormatError(f"{path} is missing")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise LeRobotFormatError(f"{path}:{number} is not valid JSON: {error}") from None
            if not isinstance(row, dict):
                raise field_error(
                    f"{path}:{number}",
                    "(line)",
                    expected="a JSON object",
                    found=shown(row),
                    fix="write one JSON object per line",
                )
            rows.append((number, row))
    return rows


def _require_int(row: dict[str, Any], name: str, where: str, *, minimum: int, fix: str) -> int:
    """``row[name]``, which must be an integer >= ``minimum``."""
    value = row.get(name)
    if not is_int(value) or value < minimum:
        found = "nothing (the field is missing)" if name not in row else shown(value)
        raise field_error(where, name, expected=f"an integer >= {minimum}", found=found, fix=fix)
    return int(value)


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

    ``meta/info.json`` and the episodes metadata are validated on construction (see
    :mod:`~forge_lightning.datamodules.lerobot.schema`); the data files when :meth:`load_frames` reads them.

    Args:
        root: dataset root (holding ``meta/info.json``).

    Raises:
        LeRobotFormatError: If the root or a metadata file is missing, the version is not supported, or a field
            the reader needs is missing or wrong.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise LeRobotFormatError(f"LeRobot dataset root {str(self.root)!r} does not exist")
        self.info_file = self.root / "meta" / "info.json"
        self.info: dict[str, Any] = _read_json(self.info_file)
        validate_info(self.info, self.info_file)
        self.version: str = self.info["codebase_version"]
        self.fps = int(self.info["fps"])
        self.features: dict[str, dict[str, Any]] = self.info["features"]
        self.video_keys = [k for k, f in self.features.items() if f["dtype"] == "video"]
        images = [k for k, f in self.features.items() if f["dtype"] == "image"]
        if images:
            raise field_error(
                self.info_file,
                f"features.{images[0]}.dtype",
                expected="'video' for a camera",
                found="'image'",
                fix="image features stored in parquet are not supported yet: re-encode the cameras as videos",
            )
        if self.version == "v3.0":
            self.episodes, self.tasks = self._load_v3_episodes(), self._load_v3_tasks()
        else:
            self.episodes, self.tasks = self._load_v2_episodes(), self._load_v2_tasks()
        self._check_totals()
        self.stats, self.episodes_stats = self._load_stats()

    @property
    def total_frames(self) -> int:
        """Frames over all episodes."""
        return sum(episode.length for episode in self.episodes.values())

    def _check_totals(self) -> None:
        source = "meta/episodes.jsonl" if self.version != "v3.0" else "meta/episodes/*/*.parquet"
        for name, value in (("total_episodes", len(self.episodes)), ("total_frames", self.total_frames)):
            if self.info.get(name) is not None and self.info[name] != value:
                raise field_error(
                    self.info_file,
                    name,
                    expected=f"{value} (from {source})",
                    found=shown(self.info[name]),
                    fix=f"set {name} to {value} if the episodes metadata is right, otherwise correct or restore it",
                )

    def _load_v2_episodes(self) -> dict[int, Episode]:
        chunk = int(self.info.get("chunks_size") or 1000)
        path = self.root / "meta" / "episodes.jsonl"
        rows = {}
        for number, row in _read_jsonl(path):
            where = f"{path}:{number}"
            fix = "write each episode's index and its number of frames (its rows in the data file)"
            index = _require_int(row, "episode_index", where, minimum=0, fix=fix)
            length = _require_int(row, "length", where, minimum=1, fix=fix)
            if index in rows:
                raise field_error(
                    where,
                    "episode_index",
                    expected="each episode listed once",
                    found=f"{index} again",
                    fix="remove the duplicate line",
                )
            rows[index] = (length, tuple(row.get("tasks") or ()))
        episodes, start = {}, 0
        for index, (length, tasks) in sorted(rows.items()):
            values = {"episode_chunk": index // chunk, "episode_index": index}
            videos = {
                key: (self._path("video_path", str(path), video_key=key, **values), 0.0)
                for key in self.video_keys
            }
            data_file = self._path("data_path", str(path), **values)
            episodes[index] = Episode(
                index, start, start + length, data_file, videos, tasks, "meta/episodes.jsonl"
            )
            start += length
        return episodes

    def _path(self, name: str, file: str, **values: Any) -> str:
        """``info[name]`` filled with ``values``; ``file`` is where the values were read."""
        field = f"{name} filled with {values}"
        return format_path(self.info[name], file=file, field=field, **values)

    def _load_v2_tasks(self) -> list[str]:
        path = self.root / "meta" / "tasks.jsonl"
        tasks: dict[int, str] = {}
        for number, row in _read_jsonl(path):
            index = _require_int(
                row, "task_index", f"{path}:{number}", minimum=0, fix="number the tasks 0, 1, ..."
            )
            if not isinstance(row.get("task"), str):
                raise field_error(
                    f"{path}:{number}",
                    "task",
                    expected="the task string",
                    found=shown(row.get("task")),
                    fix="write the task's instruction as a string",
                )
            tasks[index] = row["task"]
        return [tasks.get(i, "") for i in range(max(tasks, default=-1) + 1)]

    def _v3_columns(self) -> list[str]:
        """The episodes-parquet columns the reader uses."""
        names = [
            "episode_index",
            "dataset_from_index",
            "dataset_to_index",
            "data/chunk_index",
            "data/file_index",
        ]
        for key in self.video_keys:
            names += [f"videos/{key}/chunk_index", f"videos/{key}/file_index", f"videos/{key}/from_timestamp"]
        return names

    def _load_v3_episodes(self) -> dict[int, Episode]:
        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise LeRobotFormatError(f"{self.root / 'meta' / 'episodes'} holds no episodes parquet files")
        episodes: dict[int, Episode] = {}
        for path in files:
            table = read_parquet(path)
            missing = [c for c in self._v3_columns() if c not in table.column_names]
            if missing:
                raise field_error(
                    path,
                    f"column {missing[0]!r}",
                    expected="a column of every v3.0 episodes file (with the videos/* columns of each camera)",
                    found=f"no such column (missing: {', '.join(missing)})",
                    fix="rewrite the episodes metadata with lerobot",
                )
            rows = table.drop_columns([c for c in table.column_names if c.startswith("stats/")]).to_pylist()
            for number, row in enumerate(rows):
                episode = self._v3_episode(row, path, number)
                if episode.index in episodes:
                    raise field_error(
                        path,
                        f"row {number}: episode_index",
                        expected="each episode listed once",
                        found=f"{episode.index} again",
                        fix="remove the duplicate row",
                    )
                episodes[episode.index] = episode
        _check_disjoint(self.root, list(episodes.values()))
        return dict(sorted(episodes.items()))

    def _v3_episode(self, row: dict[str, Any], path: Path, number: int) -> Episode:
        where = f"{path}: row {number}"
        fix = "rewrite the episodes metadata with lerobot"
        index = _require_int(row, "episode_index", where, minimum=0, fix=fix)
        start = _require_int(row, "dataset_from_index", where, minimum=0, fix=fix)
        end = _require_int(row, "dataset_to_index", where, minimum=start + 1, fix=fix)
        if row.get("length") is not None and row["length"] != end - start:
            raise field_error(
                where,
                "length",
                expected=f"dataset_to_index - dataset_from_index = {end - start}",
                found=shown(row["length"]),
                fix="make length and the frame range agree",
            )
        videos = {}
        for key in self.video_keys:
            values = {
                "chunk_index": row[f"videos/{key}/chunk_index"],
                "file_index": row[f"videos/{key}/file_index"],
            }
            timestamp = row[f"videos/{key}/from_timestamp"]
            if not isinstance(timestamp, (int, float)) or not np.isfinite(timestamp) or timestamp < 0:
                raise field_error(
                    where,
                    f"videos/{key}/from_timestamp",
                    expected="a time >= 0 in seconds",
                    found=shown(timestamp),
                    fix="write where the episode starts in its video file",
                )
            videos[key] = (self._path("video_path", where, video_key=key, **values), float(timestamp))
        values = {"chunk_index": row["data/chunk_index"], "file_index": row["data/file_index"]}
        data_file = self._path("data_path", where, **values)
        tasks = tuple(row.get("tasks") or ())
        return Episode(index, start, end, data_file, videos, tasks, str(path.relative_to(self.root)))

    def _load_v3_tasks(self) -> list[str]:
        path = self.root / "meta" / "tasks.parquet"
        table = read_parquet(path)
        # pandas writes the task strings as the frame's index: the column named in the pandas metadata
        names = [c for c in table.column_names if c != "task_index"]
        if "task" in table.column_names:
            names = ["task"]
        if "task_index" not in table.column_names or not names:
            raise field_error(
                path,
                "columns",
                expected="task_index and the task strings",
                found=shown(table.column_names),
                fix="rewrite meta/tasks.parquet with lerobot",
            )
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
                int(row["episode_index"]): _as_arrays(row["stats"]) for _, row in _read_jsonl(episodes_file)
            }
            # lerobot's v2.1 reader aggregates the per-episode stats at load time; so do we
            return aggregate_stats(list(episodes_stats.values())), episodes_stats
        if stats_file.exists():
            return _as_arrays(_read_json(stats_file)), None
        return None, None

    def load_frames(self, episodes: list[int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Reads the non-video columns of ``episodes``, checking each data file against the metadata.

        Returns:
            ``(columns, row_of_index)``: arrays ``(rows, *shape)`` per feature, and for every global frame
            index of these episodes its row in ``columns`` (``-1`` elsewhere).

        Raises:
            LeRobotFormatError: If a data file lacks a column, a column's per-frame shape is not the feature's,
                or an episode's rows disagree with its length and frame range in the episodes metadata.
        """
        by_file: dict[str, list[int]] = {}
        for e in episodes:
            by_file.setdefault(self.episodes[e].data_file, []).append(e)
        parts = [self._read_data_file(name, wanted) for name, wanted in sorted(by_file.items())]
        columns = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
        row_of_index = np.full(max(self.episodes[e].end for e in episodes), -1, dtype=np.int64)
        row_of_index[columns["index"]] = np.arange(len(columns["index"]))
        return columns, row_of_index

    def _read_data_file(self, name: str, wanted: list[int]) -> dict[str, np.ndarray]:
        """The rows of episodes ``wanted`` in data file ``name``, every non-video column checked."""
        path = self.root / name
        names = [k for k in self.features if k not in self.video_keys]
        table = read_parquet(path)
        missing = [c for c in names if c not in table.column_names]
        if missing:
            raise LeRobotFormatError(f"{path} lacks the columns {missing} named in info.json")
        check_column_shape(table.column("episode_index"), [1], file=path, key="episode_index")
        episode_of_row = column_to_numpy(table.column("episode_index"), [1])
        columns = {}
        for key in names:
            shape = self.features[key]["shape"]
            check_column_shape(table.column(key), shape, file=path, key=key, episode_of_row=episode_of_row)
            columns[key] = column_to_numpy(table.column(key), shape)
        keep = np.isin(episode_of_row, wanted)
        columns = {k: v[keep] for k, v in columns.items()}
        self._check_episode_rows(path, columns["episode_index"], columns["index"], wanted)
        self._check_task_indices(path, columns)
        return columns

    def _check_episode_rows(
        self, path: Path, episode_of_row: np.ndarray, index: np.ndarray, wanted: list[int]
    ) -> None:
        """Each episode has ``length`` rows whose ``index`` values are exactly its frame range."""
        found, counts = np.unique(episode_of_row, return_counts=True)
        rows = dict(zip(found.tolist(), counts.tolist()))
        for e in wanted:
            episode = self.episodes[e]
            if rows.get(e, 0) != episode.length:
                raise field_error(
                    path,
                    f"episode {e}",
                    expected=f"{episode.length} rows ({self._range(episode)})",
                    found=f"{rows.get(e, 0)} rows",
                    fix=f"correct the episode's metadata in {episode.meta_file}, or restore its rows",
                )
        order = np.lexsort((index, episode_of_row))  # by episode, then frame index
        begins = np.repeat(np.cumsum(counts) - counts, counts)  # where each row's episode begins in `order`
        starts = np.repeat([self.episodes[e].start for e in found.tolist()], counts)
        expected = starts + np.arange(len(order)) - begins
        bad = np.flatnonzero(index[order] != expected)
        if bad.size:
            row = order[bad[0]]
            episode = self.episodes[int(episode_of_row[row])]
            raise field_error(
                path,
                f"column 'index' of episode {episode.index}",
                expected=f"each of {episode.start}..{episode.end - 1} once ({self._range(episode)})",
                found=f"{int(index[row])} where {int(expected[bad[0]])} belongs",
                fix=f"correct the episode's metadata in {episode.meta_file}, or renumber its 'index' column",
            )

    def _range(self, episode: Episode) -> str:
        if self.version == "v3.0":
            return f"{episode.meta_file}: dataset_from_index {episode.start}, dataset_to_index {episode.end}"
        return f"{episode.meta_file}: length {episode.length}"

    def _check_task_indices(self, path: Path, columns: dict[str, np.ndarray]) -> None:
        task_index = columns["task_index"]
        bad = np.flatnonzero((task_index < 0) | (task_index >= len(self.tasks)))
        if bad.size:
            tasks_file = "meta/tasks.parquet" if self.version == "v3.0" else "meta/tasks.jsonl"
            raise field_error(
                path,
                f"column 'task_index' of episode {int(columns['episode_index'][bad[0]])}",
                expected=f"a task index in [0, {len(self.tasks)}) (the tasks in {tasks_file})",
                found=shown(task_index[bad[0]].item()),
                fix=f"add the missing task to {tasks_file}",
            )


def _check_disjoint(root: Path, episodes: list[Episode]) -> None:
    """No two episodes claim the same global frame indices."""
    ordered = sorted(episodes, key=lambda episode: episode.start)
    for previous, episode in zip(ordered, ordered[1:]):
        if episode.start < previous.end:
            raise field_error(
                root / episode.meta_file,
                f"episode {episode.index}: dataset_from_index",
                expected=f">= {previous.end} (episode {previous.index} ends there)",
                found=str(episode.start),
                fix="give every episode its own frame range",
            )


def _as_arrays(stats: dict[str, dict[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
    return {key: {name: np.asarray(value) for name, value in values.items()} for key, values in stats.items()}

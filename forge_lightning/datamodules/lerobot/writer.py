"""Writes LeRobot v3.0 datasets (one data file, one mp4 per camera, episodes metadata, stats) that lerobot reads.

Everything goes into chunk 0 / file 0: the writer targets the small datasets a project records or converts
itself; episodes in an mp4 are concatenated, each starting at its ``from_timestamp``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from forge_lightning.datamodules.lerobot.stats import (
    aggregate_stats,
    feature_stats,
    image_stats,
    write_stats_json,
)

DEFAULT_FEATURES = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"


class LeRobotWriter:
    """Records episodes frame by frame and writes a LeRobot v3.0 dataset on :meth:`finalize`.

    Args:
        root: output directory (must not exist yet).
        fps: frames per second.
        features: LeRobot features: ``{"dtype": "video", "shape": (H, W, 3)}`` for cameras (frames given as
            uint8 ``(H, W, 3)``), numeric dtypes with a ``shape`` for the rest.
        robot_type: free-form robot name stored in ``info.json``.
        codec: FFmpeg video encoder (LeRobot's default ``libsvtav1``).
        crf: constant rate factor of the encoder.
        gop: key-frame interval (LeRobot uses 2, so any frame is at most one frame from a key frame).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        fps: int,
        features: Mapping[str, Mapping[str, Any]],
        robot_type: str | None = None,
        codec: str = "libsvtav1",
        crf: int = 30,
        gop: int = 2,
    ) -> None:
        self.root = Path(root)
        if self.root.exists():
            raise FileExistsError(f"{self.root} exists: the writer creates a new dataset")
        if fps < 1:
            raise ValueError(f"fps ({fps}) must be positive")
        clash = sorted(set(features) & set(DEFAULT_FEATURES))
        if clash:
            raise ValueError(f"features {clash} are written by the writer itself; leave them out")
        self.fps, self.robot_type, self.codec, self.crf, self.gop = fps, robot_type, codec, crf, gop
        self.features = {k: {**v, "shape": list(v["shape"])} for k, v in features.items()}
        self.video_keys = [k for k, f in self.features.items() if f["dtype"] == "video"]
        self.tasks: dict[str, int] = {}
        self._rows: dict[str, list[Any]] = {
            k: [] for k in [*self.features, *DEFAULT_FEATURES] if k not in self.video_keys
        }
        self._buffer: list[tuple[dict[str, np.ndarray], str]] = []
        self._episodes: list[dict[str, Any]] = []
        self._episode_stats: list[dict[str, dict[str, np.ndarray]]] = []
        self._containers: dict[str, tuple[Any, Any]] = {}

    def add_frame(self, frame: Mapping[str, Any], *, task: str) -> None:
        """Buffers one frame of the current episode (every feature present, in its declared shape)."""
        missing = sorted(set(self.features) - set(frame))
        if missing:
            raise ValueError(f"frame lacks the features {missing}")
        values = {}
        for key, feature in self.features.items():
            value = np.asarray(frame[key])
            if list(value.shape) != feature["shape"]:
                raise ValueError(f"frame[{key!r}] has shape {list(value.shape)}, expected {feature['shape']}")
            values[key] = value.astype(np.uint8 if feature["dtype"] == "video" else feature["dtype"])
        self._buffer.append((values, task))

    def save_episode(self) -> None:
        """Appends the buffered frames as one episode (rows, video frames, episode stats)."""
        if not self._buffer:
            raise ValueError("save_episode called with no frames: add_frame first")
        episode, start = len(self._episodes), len(self._rows["index"])
        length = len(self._buffer)
        stats = {}
        for key in self.features:
            stacked = np.stack([values[key] for values, _ in self._buffer])
            if key in self.video_keys:
                self._encode(key, stacked)
                stats[key] = image_stats(stacked)  # [T, H, W, 3] uint8: per-channel histograms
            else:
                self._rows[key].extend(stacked)
                stats[key] = feature_stats(stacked.reshape(length, -1))
        for i, (_, task) in enumerate(self._buffer):
            self._rows["timestamp"].append(np.float32(i / self.fps))
            self._rows["frame_index"].append(i)
            self._rows["episode_index"].append(episode)
            self._rows["index"].append(start + i)
            self._rows["task_index"].append(self.tasks.setdefault(task, len(self.tasks)))
        for key in DEFAULT_FEATURES:
            stats[key] = feature_stats(
                np.asarray(self._rows[key][start:], dtype=np.float64).reshape(length, 1)
            )
        tasks = list(dict.fromkeys(task for _, task in self._buffer))
        self._episodes.append({"episode_index": episode, "tasks": tasks, "length": length, "start": start})
        self._episode_stats.append(stats)
        self._buffer = []

    def _encode(self, key: str, frames_NHWC: np.ndarray) -> None:
        import av

        if key not in self._containers:
            path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0)
            path.parent.mkdir(parents=True, exist_ok=True)
            container = av.open(str(path), "w")
            stream = container.add_stream(
                self.codec, rate=self.fps, options={"crf": str(self.crf), "g": str(self.gop)}
            )
            stream.height, stream.width = frames_NHWC.shape[1:3]
            stream.pix_fmt = "yuv420p"
            self._containers[key] = (container, stream)
        container, stream = self._containers[key]
        for image in frames_NHWC:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)

    def finalize(self) -> Path:
        """Flushes the videos and writes data, episodes, tasks, stats and ``info.json``; returns the root."""
        if self._buffer:
            raise ValueError(f"{len(self._buffer)} frames were added after the last save_episode")
        if not self._episodes:
            raise ValueError("no episodes to write: save_episode first")
        for container, stream in self._containers.values():
            for packet in stream.encode():
                container.mux(packet)
            container.close()
        self._write_data()
        self._write_episodes()
        self._write_tasks()
        write_stats_json(self.root, aggregate_stats(self._episode_stats))
        self._write_info()
        return self.root

    def _write_data(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {}
        for key, values in self._rows.items():
            feature = self.features.get(key) or DEFAULT_FEATURES[key]
            array = np.asarray(values, dtype=feature["dtype"])
            if feature["shape"] == [1]:
                columns[key] = pa.array(array.reshape(-1))
            else:
                columns[key] = _fixed_size_list(array)
        path = self.root / DATA_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(columns), path)

    def _write_episodes(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = []
        for meta, stats in zip(self._episodes, self._episode_stats):
            start, length = meta["start"], meta["length"]
            row: dict[str, Any] = {
                "episode_index": meta["episode_index"],
                "tasks": meta["tasks"],
                "length": length,
                "data/chunk_index": 0,
                "data/file_index": 0,
                "dataset_from_index": start,
                "dataset_to_index": start + length,
            }
            for key in self.video_keys:
                row |= {f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": 0}
                row |= {
                    f"videos/{key}/from_timestamp": start / self.fps,
                    f"videos/{key}/to_timestamp": (start + length) / self.fps,
                }
            for key, values in stats.items():
                row |= {f"stats/{key}/{name}": np.asarray(v).tolist() for name, v in values.items()}
            row |= {"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
            rows.append(row)
        path = self.root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), path)

    def _write_tasks(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        # lerobot reads this file with pandas, which takes the task strings from the index column named in the
        # pandas metadata
        names = list(self.tasks)
        table = pa.table(
            {"task_index": pa.array(list(self.tasks.values()), pa.int64()), "__index_level_0__": names}
        )
        pandas_meta = {
            "index_columns": ["__index_level_0__"],
            "column_indexes": [],
            "columns": [
                {
                    "name": "task_index",
                    "field_name": "task_index",
                    "pandas_type": "int64",
                    "numpy_type": "int64",
                    "metadata": None,
                },
                {
                    "name": None,
                    "field_name": "__index_level_0__",
                    "pandas_type": "unicode",
                    "numpy_type": "object",
                    "metadata": None,
                },
            ],
        }
        table = table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)})
        pq.write_table(table, self.root / "meta" / "tasks.parquet")

    def _write_info(self) -> None:
        features = {}
        for key, feature in self.features.items():
            features[key] = dict(feature)
            if key in self.video_keys:
                height, width, channels = feature["shape"]
                features[key]["info"] = {
                    "video.height": height, "video.width": width, "video.codec": self._codec_name(),
                    "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "video.fps": self.fps,
                    "video.channels": channels, "has_audio": False,
                }  # fmt: skip
        total = len(self._rows["index"])
        info = {
            "codebase_version": "v3.0",
            "robot_type": self.robot_type,
            "total_episodes": len(self._episodes),
            "total_frames": total,
            "total_tasks": len(self.tasks),
            "chunks_size": 1000,
            "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 200,
            "fps": self.fps,
            "splits": {"train": f"0:{len(self._episodes)}"},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if self.video_keys else None,
            "features": {**features, **DEFAULT_FEATURES},
        }
        (self.root / "meta" / "info.json").write_text(json.dumps(info, indent=4))

    def _codec_name(self) -> str:
        return {"libsvtav1": "av1", "libaom-av1": "av1", "libx264": "h264", "libx265": "hevc"}.get(
            self.codec, self.codec
        )


def _fixed_size_list(array: np.ndarray) -> Any:
    """A ``(rows, *shape)`` array as nested pyarrow fixed-size lists."""
    import pyarrow as pa

    flat = pa.array(array.reshape(-1))
    for size in reversed(array.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat

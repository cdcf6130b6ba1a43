"""Broken copies of the fixture datasets: each fault raises ``LeRobotFormatError`` naming the file and the field,
what was expected and what was found; tiny normalisation scales are floored with a warning."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from forge_lightning.datamodules import lerobot
from forge_lightning.datamodules.lerobot import (
    LeRobotDataset,
    LeRobotFormatError,
    LeRobotMeta,
    LeRobotWriter,
    Normalizer,
)
from forge_lightning.datamodules.lerobot.stats import SCALE_FLOOR

V30_DATA = Path("data") / "chunk-000" / "file-000.parquet"
V30_EPISODES = Path("meta") / "episodes" / "chunk-000" / "file-000.parquet"


def _edit_info(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = root / "meta" / "info.json"
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info))


def _edit_table(path: Path, edit: Callable[[pa.Table], pa.Table]) -> None:
    pq.write_table(edit(pq.read_table(path)), path)


def _replace(table: pa.Table, name: str, values: Any) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, values)


def _raises(root: Path, *patterns: str) -> str:
    """Opens ``root`` as a dataset; asserts ``LeRobotFormatError`` whose message holds every pattern."""
    with pytest.raises(LeRobotFormatError) as caught:
        LeRobotDataset(root)
    message = str(caught.value)
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    return message


def test_error_is_a_value_error_exported_by_the_package():
    assert issubclass(LeRobotFormatError, ValueError)
    assert lerobot.LeRobotFormatError is LeRobotFormatError and "LeRobotFormatError" in lerobot.__all__
    assert LeRobotFormatError.__doc__


@pytest.mark.parametrize("name", ["v20", "v21", "v30", "forge_v30"])
def test_valid_fixtures_still_load(name, fixtures_dir):
    dataset = LeRobotDataset(fixtures_dir / name)
    assert len(dataset) == 60 and dataset.meta.total_frames == dataset.meta.info["total_frames"]


def test_valid_dataset_without_cameras_loads(tmp_path):
    writer = LeRobotWriter(tmp_path / "ds", fps=5, features={"action": {"dtype": "float32", "shape": (3,)}})
    for length in (4, 6):
        for i in range(length):
            writer.add_frame({"action": np.full(3, i, dtype=np.float32)}, task="reach")
        writer.save_episode()
    dataset = LeRobotDataset(writer.finalize())
    assert dataset.meta.info["video_path"] is None and len(dataset) == 10
    assert dataset[9]["action"].tolist() == [5.0, 5.0, 5.0]


# ----- meta/info.json ------------------------------------------------------------------------------------------
def _drop(*path: str) -> Callable[[dict[str, Any]], None]:
    def edit(info: dict[str, Any]) -> None:
        for key in path[:-1]:
            info = info[key]
        del info[path[-1]]

    return edit


def _set(value: Any, *path: str) -> Callable[[dict[str, Any]], None]:
    def edit(info: dict[str, Any]) -> None:
        for key in path[:-1]:
            info = info[key]
        info[path[-1]] = value

    return edit


INFO_FAULTS = {
    "fps missing": ("v30", _drop("fps"), "fps", "a positive whole number", "nothing"),
    "fps a string": ("v30", _set("ten", "fps"), "fps", "a positive whole number", "'ten'"),
    "fps fractional": ("v21", _set(29.97, "fps"), "fps", "a positive whole number", "29.97"),
    "version missing": ("v30", _drop("codebase_version"), "codebase_version", "one of v2.0", "nothing"),
    "features missing": ("v21", _drop("features"), "features", "an object mapping", "nothing"),
    "dtype missing": (
        "v30",
        _drop("features", "action", "dtype"),
        r"features\.action\.dtype",
        "a numpy dtype",
        "nothing",
    ),
    "dtype unknown": (
        "v30",
        _set("float33", "features", "action", "dtype"),
        r"features\.action\.dtype",
        "numpy",
        "'float33'",
    ),
    "shape missing": (
        "v21",
        _drop("features", "observation.state", "shape"),
        r"features\.observation\.state\.shape",
        "positive integers",
        "nothing",
    ),
    "shape not a list": (
        "v30",
        _set("2", "features", "observation.state", "shape"),
        r"features\.observation\.state\.shape",
        "positive integers",
        "'2'",
    ),
    "shape zero": (
        "v30",
        _set([0], "features", "action", "shape"),
        r"features\.action\.shape",
        "positive",
        r"\[0\]",
    ),
    "index feature missing": (
        "v30",
        _drop("features", "task_index"),
        r"features\.task_index",
        "a feature",
        "missing",
    ),
    "index feature not [1]": (
        "v21",
        _set([2], "features", "index", "shape"),
        r"features\.index\.shape",
        r"\[1\]",
        r"\[2\]",
    ),
    "data_path missing": (
        "v30",
        _drop("data_path"),
        "data_path",
        r"\{chunk_index\}, \{file_index\}",
        "nothing",
    ),
    "data_path unknown placeholder": (
        "v21",
        _set("data/{episode:06d}.parquet", "data_path"),
        "data_path",
        r"\{episode_index\}",
        "unknown: episode",
    ),
    "video_path missing with cameras": (
        "v30",
        _set(None, "video_path"),
        "video_path",
        r"\{video_key\}",
        "None",
    ),
    "chunks_size zero": ("v21", _set(0, "chunks_size"), "chunks_size", "an integer >= 1", "0"),
    "total_frames mistyped": ("v30", _set("60", "total_frames"), "total_frames", "an integer >= 0", "'60'"),
    "total_episodes disagrees": (
        "v30",
        _set(4, "total_episodes"),
        "total_episodes",
        r"3 \(from meta/episodes",
        "4",
    ),
}


@pytest.mark.parametrize("case", INFO_FAULTS, ids=list(INFO_FAULTS))
def test_info_json_faults_name_the_field(case, copy_of):
    name, edit, field, expected, found = INFO_FAULTS[case]
    root = copy_of(name)
    _edit_info(root, edit)
    message = _raises(root, rf"meta/info\.json: {field}: expected [^;]*{expected}", rf"found [^;]*{found}")
    assert "; " in message  # followed by how to fix it


def test_info_json_not_an_object(copy_of):
    root = copy_of("v30")
    (root / "meta" / "info.json").write_text("[1, 2]")
    _raises(root, r"info\.json: \(top level\): expected a JSON object, found list")


# ----- paths that leave the root -------------------------------------------------------------------------------
ESCAPES = {
    "parent": ("v30", "data_path", "../outside/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"),
    "absolute": ("v30", "data_path", "/srv/elsewhere/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"),
    "windows parent": (
        "v30",
        "data_path",
        "data\\..\\..\\chunk-{chunk_index:03d}\\file-{file_index:03d}.parquet",
    ),
    "windows drive": ("v30", "data_path", "C:/data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"),
    "v2 video": ("v21", "video_path", "videos/../../{video_key}/episode_{episode_index:06d}.mp4"),
}


@pytest.mark.parametrize("case", ESCAPES, ids=list(ESCAPES))
def test_path_template_leaving_the_root_is_refused(case, copy_of, monkeypatch):
    name, field, template = ESCAPES[case]
    root = copy_of(name)
    outside = root.parent / "outside" / "chunk-000" / "file-000.parquet"
    outside.parent.mkdir(parents=True)
    shutil.copy(root / V30_DATA if name == "v30" else next((root / "data").rglob("*.parquet")), outside)
    _edit_info(root, _set(template, field))
    opened = []
    real = lerobot.meta.read_parquet
    monkeypatch.setattr(
        lerobot.meta, "read_parquet", lambda path, *a, **k: opened.append(path) or real(path, *a, **k)
    )
    _raises(
        root,
        rf"meta/info\.json: {field}: expected a path relative to the dataset root",
        re.escape(repr(template)),
    )
    assert opened == []  # refused before any parquet file, inside or outside, was opened


def test_filled_path_leaving_the_root_is_refused(copy_of):
    """The template is fine, but the episodes metadata fills it with a value that climbs out."""
    root = copy_of("v30")
    _edit_info(root, _set("data/{chunk_index}/file-{file_index:03d}.parquet", "data_path"))
    chunk = pa.array(["../../outside"] * 3)
    _edit_table(root / V30_EPISODES, lambda t: _replace(t, "data/chunk_index", chunk))
    _raises(
        root,
        r"file-000\.parquet: row 0: data_path filled with .*: expected a path relative to the dataset root",
        re.escape("'data/../../outside/file-000.parquet'"),
    )


def test_symlink_inside_the_root_may_point_elsewhere(copy_of, tmp_path):
    root = copy_of("v30")
    elsewhere = tmp_path / "shared_store"
    shutil.move(root / "data", elsewhere)
    (root / "data").symlink_to(elsewhere, target_is_directory=True)
    assert len(LeRobotDataset(root)) == 60


# ----- data against metadata -----------------------------------------------------------------------------------
def test_column_wider_than_its_feature_shape(copy_of):
    root = copy_of("v30")
    wide = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(180, dtype=np.float32)), 3)
    _edit_table(root / V30_DATA, lambda t: _replace(t, "action", wide))
    _raises(
        root,
        re.escape(f"{root / V30_DATA}: column 'action': expected per-frame shape [2] "),
        re.escape(
            "(meta/info.json: features.action.shape), found 3 values along axis 0 in row 0 (episode 0)"
        ),
    )


def test_feature_shape_wider_than_the_column(copy_of):
    root = copy_of("v21")
    _edit_info(root, _set([3], "features", "observation.state", "shape"))
    _raises(
        root,
        r"episode_000000\.parquet: column 'observation\.state': expected per-frame shape \[3\]",
        "found 2 values along axis 0 in row 0 (episode 0)".replace("(", r"\(").replace(")", r"\)"),
    )


def test_ragged_column_names_row_and_episode(copy_of):
    """Variable-length lists whose total happens to fit (3 + 1 values) are caught, not silently reshaped."""
    root = copy_of("v30")

    def ragged(table: pa.Table) -> pa.Table:
        values = table.column("action").to_pylist()
        values[25], values[26] = [*values[25], 0.0], values[26][:1]
        return _replace(table, "action", pa.array(values, pa.list_(pa.float32())))

    _edit_table(root / V30_DATA, ragged)
    _raises(
        root,
        r"column 'action': expected per-frame shape \[2\]",
        r"found 3 values along axis 0 in row 25 \(episode 1\)",
    )


def test_scalar_and_null_columns(copy_of):
    root = copy_of("v30")
    _edit_table(root / V30_DATA, lambda t: _replace(t, "action", pa.array(np.zeros(60, dtype=np.float32))))
    _raises(root, r"column 'action': expected per-frame shape \[2\]", "found one scalar per frame")
    root = copy_of("v21")
    path = root / "data" / "chunk-000" / "episode_000001.parquet"
    _edit_table(
        path, lambda t: _replace(t, "timestamp", pa.array([None, *t.column("timestamp").to_pylist()[1:]]))
    )
    _raises(
        root,
        r"episode_000001\.parquet: column 'timestamp'",
        r"found a null value at axis 0 in row 0 \(episode 1\)",
    )


def test_v2_episode_length_differs_from_its_rows(copy_of):
    root = copy_of("v21")
    lines = (root / "meta" / "episodes.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    rows[0]["length"] = 21
    (root / "meta" / "episodes.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    _edit_info(root, _set(61, "total_frames"))
    _raises(
        root,
        r"episode_000000\.parquet: episode 0: expected 21 rows \(meta/episodes\.jsonl: length 21\), found 20 rows",
        r"correct the episode's metadata in meta/episodes\.jsonl",
    )


@pytest.mark.parametrize("rows", [59, 61], ids=["a row missing", "a row too many"])
def test_v3_episode_length_differs_from_its_rows(rows, copy_of):
    """Before, one row too many gave numpy's IndexError."""
    root = copy_of("v30")

    def resize(table: pa.Table) -> pa.Table:
        if rows < 60:
            return table.slice(0, rows)
        extra = {c: table.column(c).slice(59, 1) for c in table.column_names}
        extra |= {"index": pa.array([60]), "frame_index": pa.array([20])}
        return pa.concat_tables([table, pa.table(extra, schema=table.schema)])

    _edit_table(root / V30_DATA, resize)
    _raises(
        root,
        re.escape(f"{root / V30_DATA}: episode 2: expected 20 rows ({V30_EPISODES.as_posix()}: "),
        rf"dataset_from_index 40, dataset_to_index 60\), found {rows - 40} rows",
    )


def test_v3_frame_range_differs_from_the_index_column(copy_of):
    root = copy_of("v30")
    _edit_table(root / V30_DATA, lambda t: _replace(t, "index", pa.array(np.r_[0:20, 21:41, 40:60])))
    _raises(root, r"column 'index' of episode 1: expected each of 20\.\.39 once", "found 21 where 20 belongs")


def test_v3_length_column_disagrees_with_frame_range(copy_of):
    root = copy_of("v30")
    _edit_table(root / V30_EPISODES, lambda t: _replace(t, "length", pa.array([20, 19, 20])))
    _raises(
        root,
        r"file-000\.parquet: row 1: length: expected dataset_to_index - dataset_from_index = 20, found 19",
    )


def test_v3_overlapping_frame_ranges(copy_of):
    root = copy_of("v30")

    def overlap(table: pa.Table) -> pa.Table:
        table = _replace(table, "dataset_from_index", pa.array([0, 10, 40]))
        return _replace(table, "dataset_to_index", pa.array([20, 30, 60]))

    _edit_table(root / V30_EPISODES, overlap)
    _raises(
        root,
        r"file-000\.parquet: episode 1: dataset_from_index: expected >= 20 \(episode 0 ends there\), found 10",
    )


def test_v3_episodes_file_lacks_a_video_column(copy_of):
    root = copy_of("v30")
    _edit_table(
        root / V30_EPISODES, lambda t: t.drop_columns(["videos/observation.images.cam/from_timestamp"])
    )
    _raises(
        root, r"file-000\.parquet: column 'videos/observation\.images\.cam/from_timestamp': expected a column"
    )


def test_v2_episode_line_lacks_its_length(copy_of):
    root = copy_of("v21")
    (root / "meta" / "episodes.jsonl").write_text('{"episode_index": 0}\n')
    _raises(root, r"episodes\.jsonl:1: length: expected an integer >= 1, found nothing")


def test_task_index_without_a_task(copy_of):
    root = copy_of("v30")
    _edit_table(root / V30_DATA, lambda t: _replace(t, "task_index", pa.array(np.r_[[0] * 59, 7])))
    _raises(root, r"column 'task_index' of episode 2: expected a task index in \[0, 2\)", "found 7")


# ----- normalisation scales ------------------------------------------------------------------------------------
def _stats(**std: list[float]) -> dict[str, dict[str, np.ndarray]]:
    return {
        key: {
            "mean": np.full(len(s), 0.5),
            "std": np.asarray(s),
            "min": np.zeros(len(s)),
            "max": np.asarray(s),
            "q01": np.zeros(len(s)),
            "q99": np.asarray(s),
        }
        for key, s in std.items()
    }


@pytest.mark.parametrize(
    ("mode", "stat"), [("mean_std", "std"), ("min_max", "max - min"), ("quantiles", "q99 - q01")]
)
def test_tiny_scale_is_floored_with_one_warning_per_feature(mode, stat):
    stats = _stats(action=[0.0, 0.3, 1e-7], **{"observation.state": [0.0]})
    with pytest.warns(UserWarning) as caught:
        normalizer = Normalizer(stats=stats, modes={"action": mode, "observation.state": mode})
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2  # one per feature, listing its dimensions
    assert f"normalization['action'] ({mode!r}): {stat} is [0.0, 1e-07] at dimension(s) [0, 2]" in messages[0]
    assert "observation.state" in messages[1]
    x = torch.tensor([0.5 + 1.0, 0.5, 0.5 + 1.0], dtype=torch.float64)
    y = normalizer.normalize("action", x)
    assert y.abs().max() <= 2 * 1.5 / SCALE_FLOOR + 1  # was ~3e8 with the eps-sized divisor
    assert torch.allclose(normalizer.unnormalize("action", y), x)


def test_real_scales_are_normalised_as_lerobot_does(fixtures_dir):
    """Above the floor nothing changes: LeRobot's formulas, bit for bit, and no warning."""
    stats = LeRobotMeta(fixtures_dir / "v30").stats
    x = torch.randn(16, 2, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normalizer = Normalizer(stats=stats, modes={"action": "mean_std", "observation.state": "quantiles"})
    mean, std = (torch.as_tensor(stats["action"][n], dtype=torch.float32) for n in ("mean", "std"))
    assert torch.equal(normalizer.normalize("action", x), (x - mean) / (std + 1e-8))
    q01, q99 = (torch.as_tensor(stats["observation.state"][n], dtype=torch.float32) for n in ("q01", "q99"))
    assert torch.equal(normalizer.normalize("observation.state", x), (x - q01) / (q99 - q01) * 2 - 1)


def test_same_stats_warn_once_per_process():
    """The datasets and the module each build a Normalizer from the same stats: the warning shows once."""
    stats = _stats(action=[0.0, 0.2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            Normalizer(stats=stats, modes={"action": "mean_std"})
    assert len(caught) == 1


def test_negative_or_non_finite_scale_is_refused():
    with pytest.raises(ValueError, match=r"normalization\['action'\] \('min_max'\).*max - min >= 0"):
        Normalizer(stats=_stats(action=[-0.1]), modes={"action": "min_max"})
    stats = _stats(action=[0.1])
    stats["action"]["std"] = np.array([np.nan])
    with pytest.raises(ValueError, match=r"must be finite.*forge-data lerobot-stats"):
        Normalizer(stats=stats, modes={"action": "mean_std"})


def test_dataset_with_a_constant_dimension_normalises_bounded(copy_of):
    root = copy_of("v30")
    stats = json.loads((root / "meta" / "stats.json").read_text())
    stats["action"]["std"][1] = 0.0
    (root / "meta" / "stats.json").write_text(json.dumps(stats))
    with pytest.warns(
        UserWarning,
        match=r"normalization\['action'\] \('mean_std'\): std is \[0\.0\] at dimension\(s\) \[1\]",
    ):
        dataset = LeRobotDataset(root, normalization={"action": "mean_std"})
    action = dataset[3]["action"]
    raw = LeRobotDataset(root)[3]["action"]
    assert torch.isclose(action[1], (raw[1] - stats["action"]["mean"][1]) / (SCALE_FLOOR + 1e-8))

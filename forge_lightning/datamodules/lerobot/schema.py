"""What a LeRobot dataset must look like to be read, checked so that a bad one fails with one
:class:`LeRobotFormatError` naming the file, the field, what was expected and what was found, and the fix.

When each part is checked::

    opening (LeRobotMeta)   meta/info.json: the fields the reader uses, their types, the path templates
                            (which must stay inside the root); the episodes metadata; info's totals
    reading (load_frames)   each data file: every column's per-frame shape against features.*.shape, each
                            episode's rows against its metadata length and frame range, task indices

``meta/info.json`` as lerobot writes it (v2.x: ``lerobot/common/datasets/utils.py``, v3.0:
``lerobot/datasets/utils.py::create_empty_dataset_info``); the reader uses the fields marked ``*``::

    codebase_version*   "v2.0" | "v2.1" | "v3.0"
    fps*                frames per second, a positive integer
    features*           {key: {"dtype"*: "video" | "image" | "string" | a numpy dtype,
                                "shape"*: [positive int, ...], "names": ..., "info": ...}},
                        incl. timestamp, episode_index, index and task_index, shape [1]
    data_path*          v2.x "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
                        v3.0 "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    video_path*         (when a feature is a video; otherwise null)
                        v2.x "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
                        v3.0 "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    chunks_size         episodes per chunk (v2.x; 1000 when absent)
    total_episodes, total_frames   checked against the episodes metadata when present
    robot_type, total_tasks, splits, ...   not used
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
INDEX_FEATURES = ("timestamp", "episode_index", "index", "task_index")
_SPECIAL_DTYPES = ("video", "image", "string")
# per layout and template: (placeholders allowed, placeholders required)
_TEMPLATES = {
    "v2": {
        "data_path": ({"episode_chunk", "episode_index"}, {"episode_index"}),
        "video_path": ({"episode_chunk", "episode_index", "video_key"}, {"episode_index", "video_key"}),
    },
    "v3": {
        "data_path": ({"chunk_index", "file_index"}, {"chunk_index", "file_index"}),
        "video_path": (
            {"chunk_index", "file_index", "video_key"},
            {"chunk_index", "file_index", "video_key"},
        ),
    },
}


class LeRobotFormatError(ValueError):
    """A LeRobot dataset that cannot be read as it is: a missing or corrupt file, an unsupported version, a
    field of ``meta/info.json`` that is missing or has the wrong type, data that disagrees with its metadata, or
    a path that leaves the dataset root. The message names the file and field, and says how to fix it."""


def field_error(file: Path | str, field: str, *, expected: str, found: str, fix: str) -> LeRobotFormatError:
    """The error for one bad field: ``FILE: FIELD: expected EXPECTED, found FOUND; FIX``."""
    return LeRobotFormatError(f"{file}: {field}: expected {expected}, found {found}; {fix}")


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: Any) -> bool:
    """An integer (JSON, numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


# ----- meta/info.json ----------------------------------------------------------------------------------------
def validate_info(info: Any, path: Path) -> None:
    """Checks the fields of ``meta/info.json`` (read from ``path``) that the reader uses.

    Raises:
        LeRobotFormatError: Naming the first field that is missing or wrong.
    """
    if not isinstance(info, Mapping):
        raise field_error(
            path, "(top level)", expected="a JSON object", found=type(info).__name__, fix=_FIX_INFO
        )
    version = _check_version(info, path)
    _check_fps(info, path)
    features = _check_features(info, path)
    layout = version[:2]  # "v2" | "v3"
    _check_template(info, "data_path", layout, path)
    if any(feature["dtype"] == "video" for feature in features.values()):
        _check_template(info, "video_path", layout, path)
    for name in ("chunks_size", "total_episodes", "total_frames"):
        if info.get(name) is not None:
            _check_count(info, name, path, minimum=1 if name == "chunks_size" else 0)


_FIX_INFO = "compare with the info.json of a dataset lerobot wrote (lerobot's create_empty_dataset_info)"


def _missing_or(info: Mapping[str, Any], name: str) -> str:
    return "nothing (the field is missing)" if name not in info else shown(info[name])


def _check_version(info: Mapping[str, Any], path: Path) -> str:
    version = info.get("codebase_version")
    if version not in SUPPORTED_VERSIONS:
        raise field_error(
            path,
            "codebase_version",
            expected=f"one of {', '.join(SUPPORTED_VERSIONS)}",
            found=_missing_or(info, "codebase_version"),
            fix="convert the dataset with lerobot's conversion scripts (convert_dataset_v21_to_v30 and others)",
        )
    return version


def _check_fps(info: Mapping[str, Any], path: Path) -> None:
    fps = info.get("fps")
    # frames are addressed as round(timestamp * fps): a fractional rate would misplace them
    whole = is_int(fps) or (isinstance(fps, float) and fps.is_integer())
    if not whole or fps < 1:
        raise field_error(
            path,
            "fps",
            expected="a positive whole number of frames per second",
            found=_missing_or(info, "fps"),
            fix="set fps to the rate the episodes were recorded at (lerobot writes an integer)",
        )


def _check_count(info: Mapping[str, Any], name: str, path: Path, *, minimum: int) -> None:
    value = info[name]
    if not is_int(value) or value < minimum:
        raise field_error(
            path,
            name,
            expected=f"an integer >= {minimum}",
            found=shown(value),
            fix=f"correct {name} (or remove it: the reader does not need it)",
        )


def _check_features(info: Mapping[str, Any], path: Path) -> Mapping[str, Mapping[str, Any]]:
    features = info.get("features")
    if not isinstance(features, Mapping) or not features:
        raise field_error(
            path,
            "features",
            expected="an object mapping each feature name to its dtype and shape",
            found=_missing_or(info, "features"),
            fix=_FIX_INFO,
        )
    for key, feature in features.items():
        _check_feature(key, feature, path)
    for key in INDEX_FEATURES:
        if key not in features:
            raise field_error(
                path,
                f"features.{key}",
                expected=f'a feature (lerobot writes {key} with "shape": [1])',
                found="nothing (the feature is missing)",
                fix=f"add {key} to features; every lerobot dataset has it in its data files",
            )
        if list(features[key]["shape"]) != [1]:
            raise field_error(
                path,
                f"features.{key}.shape",
                expected="[1]",
                found=shown(features[key]["shape"]),
                fix=f"{key} holds one value per frame: set its shape to [1]",
            )
    return features


def _check_feature(key: str, feature: Any, path: Path) -> None:
    if not isinstance(feature, Mapping):
        raise field_error(
            path,
            f"features.{key}",
            expected='an object with "dtype" and "shape"',
            found=shown(feature),
            fix=_FIX_INFO,
        )
    dtype = feature.get("dtype")
    if not isinstance(dtype, str) or not _known_dtype(dtype):
        raise field_error(
            path,
            f"features.{key}.dtype",
            expected=f"one of {', '.join(_SPECIAL_DTYPES)} or a numpy dtype name (float32, int64, bool, ...)",
            found=_missing_or(feature, "dtype"),
            fix="set the dtype the feature's values are stored with",
        )
    shape = feature.get("shape")
    if not isinstance(shape, (list, tuple)) or not shape or not all(is_int(n) and n >= 1 for n in shape):
        raise field_error(
            path,
            f"features.{key}.shape",
            expected="a non-empty list of positive integers (the per-frame shape, e.g. [2])",
            found=_missing_or(feature, "shape"),
            fix="set the shape of one frame's value ([H, W, C] for a video)",
        )


def _known_dtype(dtype: str) -> bool:
    if dtype in _SPECIAL_DTYPES:
        return True
    try:
        np.dtype(dtype)
    except TypeError:
        return False
    return True


# ----- paths inside the root ---------------------------------------------------------------------------------
def _check_template(info: Mapping[str, Any], name: str, layout: str, path: Path) -> None:
    template = info.get(name)
    allowed, required = _TEMPLATES[layout][name]
    placeholders = ", ".join(f"{{{p}}}" for p in sorted(required))
    if not isinstance(template, str):
        raise field_error(
            path,
            name,
            expected=f"a path template relative to the dataset root, with {placeholders}",
            found=_missing_or(info, name),
            fix=f"set {name} to the template the files were written with",
        )
    fields = _template_fields(template, name, path)
    unknown, absent = sorted(fields - allowed), sorted(required - fields)
    if unknown or absent:
        optional = ", ".join(f"{{{p}}}" for p in sorted(allowed - required))
        problem = f"unknown: {', '.join(unknown)}" if unknown else f"lacking: {', '.join(absent)}"
        raise field_error(
            path,
            name,
            expected=f"a template with the placeholders {placeholders}"
            + (f" (optional: {optional})" if optional else ""),
            found=f"{shown(template)} ({problem})",
            fix=f"use the {layout}.x layout's placeholders (meta/info.json of a dataset lerobot wrote)",
        )
    check_inside_root(template, str(path), name)


def _template_fields(template: str, name: str, path: Path) -> set[str]:
    try:
        return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as error:  # unbalanced braces
        raise field_error(
            path,
            name,
            expected="a str.format template",
            found=f"{shown(template)} ({error})",
            fix="balance the braces of the template",
        ) from None


def check_inside_root(relative: str, file: str, field: str) -> None:
    """Refuses a path (or path template) that is absolute or has a ``..`` component, before anything opens it.

    The check is on the text: symlinks inside the root are followed wherever they point, since datasets are
    often assembled that way (Hugging Face's cache links every file of a snapshot to a blob outside it).

    Raises:
        LeRobotFormatError: Naming ``field`` of ``file``.
    """
    parts = re.split(r"[\\/]", relative)
    absolute = relative.startswith(("/", "\\")) or bool(PureWindowsPath(relative).drive)
    if absolute or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise field_error(
            file,
            field,
            expected="a path relative to the dataset root, without '..' components",
            found=shown(relative),
            fix="keep every data and video file under the dataset root (use a symlink inside it if needed)",
        )


def format_path(template: str, *, file: str, field: str, **values: Any) -> str:
    """``template`` filled with ``values``, checked to stay inside the root.

    Raises:
        LeRobotFormatError: If the values do not fit the template or the result leaves the root.
    """
    try:
        relative = template.format(**values)
    except (KeyError, IndexError, ValueError, TypeError) as error:
        raise field_error(
            file,
            field,
            expected=f"values that fit the template {template!r}",
            found=f"{values} ({error})",
            fix="write integer chunk / file / episode indices",
        ) from None
    check_inside_root(relative, file, field)
    return relative


# ----- data files --------------------------------------------------------------------------------------------
def check_column_shape(
    column: Any, shape: list[int], *, file: Path, key: str, episode_of_row: np.ndarray | None = None
) -> None:
    """Checks that every row of a pyarrow column holds a value of the feature's per-frame ``shape``, and no nulls.

    Shape ``[1]`` may be stored as scalars or one-element lists. Only list lengths and null counts are read.

    Raises:
        LeRobotFormatError: Naming the column, the first bad row and its episode.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    level = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    dims = [] if list(shape) == [1] and not _is_list(level.type) else list(shape)
    for axis, size in enumerate([*dims, None]):
        if level.null_count:
            row = int(np.flatnonzero(level.is_null().to_numpy(zero_copy_only=False))[0])
            _raise_shape(file, key, shape, f"a null value at axis {axis}", _at(axis, row, episode_of_row))
        if size is None:
            if _is_list(level.type):
                _raise_shape(file, key, shape, f"lists nested {axis + 1} or more levels deep", "")
            return
        if not _is_list(level.type):
            found = "one scalar per frame" if axis == 0 else f"scalars at axis {axis}"
            _raise_shape(file, key, shape, found, "")
        lengths = pc.list_value_length(level).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != size)
        if bad.size:
            found = f"{lengths[bad[0]]} values along axis {axis}"
            _raise_shape(file, key, shape, found, _at(axis, int(bad[0]), episode_of_row))
        level = level.flatten()


def _is_list(arrow_type: Any) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    )


def _at(axis: int, row: int, episode_of_row: np.ndarray | None) -> str:
    """Where a bad value is: only rows of the outermost level are frames (deeper levels are flattened)."""
    if axis > 0:
        return ""
    return f" in row {row}" + (f" (episode {int(episode_of_row[row])})" if episode_of_row is not None else "")


def _raise_shape(file: Path, key: str, shape: list[int], found: str, where: str) -> None:
    raise field_error(
        file,
        f"column {key!r}",
        expected=f"per-frame shape {list(shape)} (meta/info.json: features.{key}.shape)",
        found=found + where,
        fix=f"make features.{key}.shape in meta/info.json match the data, or rewrite the column",
    )

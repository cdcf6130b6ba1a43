"""Atomic, durable replacement of files and directories: the one helper every writer of checkpoints, exports and
datasets uses.

A writer puts its output in a temporary sibling of the target, then :func:`replace` makes it the target::

    write tmp (file or directory) ─ fsync its files and tmp itself ─ rename over the target ─ fsync the parent

A process killed at any point leaves the previous target or the new one, never a torn one; after ``replace``
returns, the new content and the rename are on disk (a power loss cannot bring back the old one or a
half-written file). A directory target is first moved aside to a hidden ``.<name>.old`` sibling (POSIX cannot
rename a directory over a non-empty one), which is removed after the rename; a crash in between leaves it there,
and the readers' messages name it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's or a directory's entry to disk (``fsync`` of an ``O_RDONLY`` descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """``fsync`` every file and directory under ``path`` (and ``path`` itself), deepest first."""
    path = Path(path)
    if path.is_file():
        fsync_path(path)
        return
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(root)


def old_sibling(path: str | os.PathLike[str]) -> Path:
    """Where :func:`replace` moves a directory target aside while it renames the new one into place."""
    path = Path(path)
    return path.with_name(f".{path.name}.old")


def replace(tmp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Make the finished ``tmp`` (a file or a directory beside ``path``) the new ``path``, durably.

    Args:
        tmp: the new content, complete, in the same directory as ``path``.
        path: the target (need not exist; an existing file or directory is replaced).
    """
    tmp, path = Path(tmp), Path(path)
    fsync_tree(tmp)
    if path.is_dir() and not path.is_symlink():
        old = old_sibling(path)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        fsync_path(path.parent)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)
    fsync_path(path.parent)


def write_file(
    path: str | os.PathLike[str],
    write: Callable[[IO[bytes]], None],
    before_replace: Callable[[], None] | None = None,
) -> None:
    """Write ``path`` atomically: ``write(stream)`` into a temporary sibling, then :func:`replace`.

    On any error the temporary file is removed and ``path`` is left as it was.

    Args:
        path: the target file.
        write: writes the content into the open stream.
        before_replace: called once the content is written, before the rename (e.g. to write its manifest).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as stream:
            write(stream)
        if before_replace is not None:
            before_replace()
        replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

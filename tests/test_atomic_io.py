"""The one atomic-replace helper: files and directories are replaced whole, durably (their files, themselves and the
parent directory fsynced), and a failed write leaves the previous target untouched."""

import os
from pathlib import Path

import pytest

from forge_lightning import atomic_io


@pytest.fixture
def synced(monkeypatch) -> list[Path]:
    """The paths fsynced, in order (the real fsync still runs)."""
    seen: list[Path] = []
    real = atomic_io.fsync_path

    def record(path):
        seen.append(Path(path))
        real(path)

    monkeypatch.setattr(atomic_io, "fsync_path", record)
    return seen


def test_a_file_is_replaced_and_synced_with_its_directory(tmp_path, synced):
    target = tmp_path / "out" / "state.bin"
    atomic_io.write_file(target, lambda stream: stream.write(b"first"))
    atomic_io.write_file(target, lambda stream: stream.write(b"second"))
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.bin"]  # no temporary left
    # Each write: the temporary file's content, then the directory holding the rename.
    assert [p.name for p in synced if p.parent == target.parent] == [synced[0].name, synced[2].name]
    assert synced.count(target.parent) == 2


def test_a_failed_write_leaves_the_previous_file(tmp_path):
    target = tmp_path / "state.bin"
    target.write_bytes(b"kept")

    def fail(stream):
        stream.write(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        atomic_io.write_file(target, fail)
    assert target.read_bytes() == b"kept"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_a_directory_is_replaced_whole(tmp_path, synced):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old_only").write_text("old")
    tmp = tmp_path / ".ckpt.tmp"
    (tmp / "nested").mkdir(parents=True)
    (tmp / "nested" / "shard").write_text("new")
    atomic_io.replace(tmp, target)
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == ["nested", "nested/shard"]
    assert not tmp.exists() and not atomic_io.old_sibling(target).exists()
    # Every file and directory of the new content, then the parent (before and after the old copy is removed).
    assert synced[:3] == [tmp / "nested" / "shard", tmp / "nested", tmp]
    assert synced[3:] == [tmp_path, tmp_path]


def test_a_directory_target_that_does_not_exist_yet(tmp_path):
    tmp = tmp_path / ".new.tmp"
    tmp.mkdir()
    (tmp / "file").write_text("x")
    atomic_io.replace(tmp, tmp_path / "new")
    assert (tmp_path / "new" / "file").read_text() == "x"
    assert os.listdir(tmp_path) == ["new"]

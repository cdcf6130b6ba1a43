"""Content manifests: a hash and size per file of every checkpoint and export, written with it, checked on load.

A file that was overwritten in place, truncated or swapped (a disk error, a copy cut short, a stray write) loads as
well as a good one: torch and safetensors check their headers, not the bytes of the tensors. The manifest is what
says which bytes were written::

    epoch=0-step=3.ckpt                       a Lightning checkpoint file
    epoch=0-step=3.ckpt.manifest.json         its manifest, beside it
    epoch=0-step=9.ckpt/forge-manifest.json   a directory (DCP, megatron dist-checkpoint, Hugging Face export):
                                              one manifest inside, naming every other file below it

    {"format": "forge-manifest", "version": 1, "algorithm": "xxh3_128",
     "files": {"meta.pt": {"size": 2311, "hash": "5bd0..."}, ...}}

A directory's manifest is written into its temporary directory before the rename into place, so the checkpoint and
its manifest appear together. A file's manifest is replaced just before the file: a crash between the two leaves a
manifest that does not match, and the checkpoint is refused rather than trusted. The hash is xxHash's XXH3 (128
bits): it finds corruption, not tampering, at about the speed of reading memory.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import xxhash

from forge_lightning.atomic_io import write_file

MANIFEST_FILE = "forge-manifest.json"
SIDECAR_SUFFIX = ".manifest.json"
FORMAT = "forge-manifest"
VERSION = 1
ALGORITHM = "xxh3_128"
HASH_THREADS = 8
_BLOCK = 16 << 20


class ManifestError(RuntimeError):
    """A checkpoint or export whose files do not match its manifest (changed, missing, or the manifest itself is
    unreadable): it must not be loaded. The message names every such file."""


@dataclass(frozen=True)
class FileRecord:
    """One file's entry in a manifest."""

    size: int
    hash: str


@dataclass
class Verification:
    """What :func:`verify` found: the files checked and, per problem, the file and what is wrong."""

    path: Path
    manifest: Path | None
    checked: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems


class HashingWriter:
    """A binary stream that hashes what it writes on the way to ``stream`` (``torch.save`` into it, then read
    :meth:`record`)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream, self._hash, self._size = stream, xxhash.xxh3_128(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._hash.update(view)
        self._size += view.nbytes
        return self._stream.write(view)

    def flush(self) -> None:
        self._stream.flush()

    def record(self) -> FileRecord:
        return FileRecord(self._size, self._hash.hexdigest())


def hash_file(path: str | os.PathLike[str]) -> FileRecord:
    """The size and XXH3-128 hash of a file's content."""
    digest, size = xxhash.xxh3_128(), 0
    with open(path, "rb", buffering=0) as stream:
        buffer = bytearray(_BLOCK)
        view = memoryview(buffer)
        while n := stream.readinto(buffer):
            digest.update(view[:n])
            size += n
    return FileRecord(size, digest.hexdigest())


def hash_files(paths: Iterable[Path], threads: int = HASH_THREADS) -> dict[Path, FileRecord]:
    """:func:`hash_file` of each path, ``threads`` at a time (the hash releases the GIL)."""
    paths = list(paths)
    if len(paths) <= 1 or threads <= 1:
        return {p: hash_file(p) for p in paths}
    with ThreadPoolExecutor(min(threads, len(paths))) as pool:
        return dict(zip(paths, pool.map(hash_file, paths)))


def sidecar(path: str | os.PathLike[str]) -> Path:
    """The manifest file of a single-file checkpoint (beside the file a link points to, for a link)."""
    path = Path(path).resolve()
    return path.with_name(path.name + SIDECAR_SUFFIX)


def manifest_of(path: str | os.PathLike[str]) -> Path:
    """Where the manifest of ``path`` (a file or a directory) is."""
    path = Path(path)
    return path / MANIFEST_FILE if path.is_dir() else sidecar(path)


def directory_files(root: Path) -> list[str]:
    """Every file below ``root`` that a manifest covers, as sorted relative POSIX paths."""
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE
    )


def _dump(records: Mapping[str, FileRecord]) -> bytes:
    files = {name: {"size": r.size, "hash": r.hash} for name, r in sorted(records.items())}
    document = {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "files": files}
    return (json.dumps(document, indent=1) + "\n").encode()


def write_file_manifest(path: str | os.PathLike[str], record: FileRecord) -> None:
    """Write the manifest of the single file at ``path`` (its content is ``record``), atomically."""
    path = Path(path)
    write_file(sidecar(path), lambda stream: stream.write(_dump({path.name: record})))


def write_directory_manifest(
    root: str | os.PathLike[str],
    known: Mapping[str, FileRecord] | None = None,
    threads: int = HASH_THREADS,
) -> dict[str, FileRecord]:
    """Hash every file below ``root`` not in ``known`` (relative path → record, e.g. hashed by the ranks that
    wrote them) and write ``root/forge-manifest.json``. Returns the records.

    Call it when every file is written and before ``root`` is renamed into place.
    """
    root = Path(root)
    known = dict(known or {})
    names = directory_files(root)
    hashed = hash_files([root / n for n in names if n not in known], threads)
    records = {n: known[n] if n in known else hashed[root / n] for n in names}
    write_file(root / MANIFEST_FILE, lambda stream: stream.write(_dump(records)))
    return records


def own_files(root: str | os.PathLike[str], rank: int) -> list[str]:
    """The files below ``root`` that ``rank`` wrote, by the shard naming DCP and megatron-core use
    (``__<rank>_<n>.distcp``)."""
    root = Path(root)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(f"__{rank}_*") if p.is_file())


def hash_own_files(
    root: str | os.PathLike[str], rank: int, threads: int = HASH_THREADS
) -> dict[str, FileRecord]:
    """:func:`hash_files` of the files ``rank`` wrote below ``root`` (:func:`own_files`), by relative path."""
    root = Path(root)
    names = own_files(root, rank)
    hashed = hash_files([root / n for n in names], threads)
    return {n: hashed[root / n] for n in names}


def read_manifest(manifest: Path) -> dict[str, FileRecord]:
    """The records of a manifest file.

    Raises:
        ManifestError: the file is not a manifest this version reads.
    """
    try:
        document = json.loads(manifest.read_text())
        if document.get("format") != FORMAT or document.get("algorithm") != ALGORITHM:
            raise ValueError(f"format {document.get('format')!r}, algorithm {document.get('algorithm')!r}")
        if int(document.get("version", 0)) > VERSION:
            raise ValueError(
                f"version {document['version']} is newer than this forge-lightning reads ({VERSION})"
            )
        return {name: FileRecord(int(r["size"]), str(r["hash"])) for name, r in document["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ManifestError(
            f"manifest {manifest} is unreadable ({error}): the checkpoint cannot be verified"
        ) from error


def verify(
    path: str | os.PathLike[str],
    *,
    share: Callable[[list[str]], list[str]] | None = None,
    threads: int = HASH_THREADS,
) -> Verification:
    """Check the files of the checkpoint or export at ``path`` (a file or a directory) against its manifest.

    Args:
        path: the checkpoint file or directory.
        share: the part of the listed files this process hashes (given all of them, sorted); default all.
            Distributed loaders split the work with it and gather the problems.
        threads: files hashed at a time.

    Returns:
        The :class:`Verification`; ``manifest`` is None when there is none (nothing was checked).
    """
    path = Path(path)
    manifest = manifest_of(path)
    result = Verification(path=path, manifest=manifest if manifest.is_file() else None)
    if result.manifest is None:
        return result
    records = read_manifest(manifest)
    root = path if path.is_dir() else path.resolve().parent
    if path.is_dir():
        result.unlisted = [n for n in directory_files(path) if n not in records]
    names = sorted(records)
    present = []
    for name in names if share is None else share(names):
        if (root / name).is_file():
            present.append(name)
        else:
            result.problems.append(f"{name}: missing (listed in the manifest, {records[name].size:,} bytes)")
    hashed = hash_files([root / n for n in present], threads)
    for name in present:
        found, expected = hashed[root / name], records[name]
        result.checked += 1
        result.bytes += found.size
        if found.size != expected.size:
            result.problems.append(f"{name}: {found.size:,} bytes, the manifest says {expected.size:,}")
        elif found.hash != expected.hash:
            result.problems.append(
                f"{name}: content changed (hash {found.hash}, the manifest says {expected.hash})"
            )
    return result


def refuse_mismatch(path: Path, problems: list[str], what: str = "checkpoint") -> None:
    """Raise :class:`ManifestError` naming every problem, if there is one."""
    if problems:
        listed = "\n  ".join(problems)
        raise ManifestError(
            f"{what} {path} does not match its manifest {manifest_of(path).name}:\n  {listed}\n"
            f"The {what} is corrupt (changed on disk, or its save or copy was cut short) and was not loaded. "
            "Load an earlier one, or copy it again from where it was written; `forge-convert verify PATH` checks one"
        )


def warn_unverified(path: Path, what: str = "checkpoint") -> None:
    """Warn that ``path`` has no manifest (written before manifests, or by another tool) and loads unverified."""
    warnings.warn(
        f"{what} {path} has no {manifest_of(path).name}: it was written before forge-lightning wrote manifests, or by "
        "another tool, and is loaded without checking its content",
        stacklevel=3,
    )


def verify_before_load(path: str | os.PathLike[str], what: str = "checkpoint") -> Verification:
    """:func:`verify` in this process, then refuse a mismatch (:func:`refuse_mismatch`) or warn when unverified."""
    path = Path(path)
    result = verify(path)
    if result.manifest is None:
        warn_unverified(path, what)
    refuse_mismatch(path, result.problems, what)
    return result


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    rank, world = _world()
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def write_directory_manifest_collective(root: str | os.PathLike[str], threads: int = HASH_THREADS) -> None:
    """Every rank hashes the shard files it wrote below ``root``; global rank 0 hashes the rest and writes the
    manifest. Collective: call it on every rank once all files (its own, and rank 0's metadata) are written."""
    rank, _ = _world()
    known: dict[str, FileRecord] = {}
    for part in _all_gather(hash_own_files(root, rank, threads)):
        known.update(part)
    error = None
    if rank == 0:
        try:
            write_directory_manifest(root, known, threads)
        except (
            Exception
        ) as err:  # raised below on every rank, so none waits for rank 0 at the next collective
            error = err
    failure = _all_gather(None if error is None else f"{type(error).__name__}: {error}")[0]
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"global rank 0 failed to write the manifest of {root}: {failure}")


def verify_before_load_collective(path: str | os.PathLike[str], what: str = "checkpoint") -> None:
    """:func:`verify_before_load` with the files split over the ranks and the problems gathered, so every rank
    refuses the same checkpoint with the same message. Collective when a process group is initialised."""
    path = Path(path)
    rank, world = _world()
    if world == 1:
        verify_before_load(path, what)
        return
    result = verify(path, share=lambda names: names[rank::world])
    problems = sorted(p for part in _all_gather(result.problems) for p in part)
    if result.manifest is None and rank == 0:
        warn_unverified(path, what)
    refuse_mismatch(path, problems, what)


class FileChecks:
    """The manifest of a directory, read once, that checks each file the first time a reader opens it (for readers
    that open only some files, such as a rank reading its slices of a Hugging Face checkpoint). A directory without a
    manifest (e.g. a model from the Hugging Face Hub) is read unchecked.

    Args:
        root: the directory.
        what: what it is, for messages.
    """

    def __init__(self, root: str | os.PathLike[str], what: str = "checkpoint") -> None:
        self.root, self.what = Path(root), what
        manifest = self.root / MANIFEST_FILE
        self.records = read_manifest(manifest) if manifest.is_file() else None
        self._checked: set[str] = set()

    def check(self, name: str) -> None:
        """Refuse the file ``name`` (relative to the root) if it is not the one the manifest lists.

        Raises:
            ManifestError: it is unlisted, or its size or hash differs.
        """
        if self.records is None or name in self._checked:
            return
        expected = self.records.get(name)
        if expected is None:
            refuse_mismatch(self.root, [f"{name}: not listed in the manifest"], self.what)
            return
        found = hash_file(self.root / name)
        if found != expected:
            refuse_mismatch(
                self.root,
                [
                    f"{name}: {found.size:,} bytes, hash {found.hash}; the manifest says {expected.size:,} "
                    f"bytes, hash {expected.hash}"
                ],
                self.what,
            )
        self._checked.add(name)


def sizes_match(path: str | os.PathLike[str]) -> bool | None:
    """Whether every file the manifest of ``path`` lists is there with its size (a cheap check: no file is read);
    None when there is no manifest."""
    path = Path(path)
    manifest = manifest_of(path)
    if not manifest.is_file():
        return None
    try:
        records = read_manifest(manifest)
    except ManifestError:
        return False
    root = path if path.is_dir() else path.resolve().parent
    for name, record in records.items():
        file = root / name
        if not file.is_file() or file.stat().st_size != record.size:
            return False
    return True

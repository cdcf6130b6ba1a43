"""Where vision-language records come from: JSON files with images beside them, WebDataset tar shards, or an
Energon-prepared dataset. Each entry of ``train_files`` / ``val_files`` picks its kind::

    entry                           kind                a record is named     its image references are
    data.jsonl / data.json          JSON records        data.jsonl:3          paths under the image root
    shards/train-{000..009}.tar     WebDataset shards   train-000.tar:key     members of the sample: 0.jpg, 1.png
    prepared/ (has .nv-meta)        Energon dataset     prepared/a.tar:key    members of the sample, via energon

A shard sample holds a ``json`` member (one record in any format of ``records.py``) and the image files it refers
to by member name (``key.0.jpg`` is ``0.jpg``). Scanning reads every sample once; afterwards an image is read back
from its shard when a sample is loaded (a member index per shard, opened once per process, never across fork).
``webdataset`` and ``megatron-energon`` (the ``vlm`` extra) are imported only when such a source is used.
"""

from __future__ import annotations

import importlib
import json
import os
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from forge_lightning.datamodules.json_records import MalformedRecord, read_json_records
from forge_lightning.datamodules.vlm.records import SUFFIXES, ImageSource, resolve_image

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
ENERGON_META = ".nv-meta"


@dataclass(frozen=True)
class RawRecord:
    """One record as its source holds it, before parsing.

    Args:
        source: its name in messages (``file:line``, ``shard.tar:key``).
        record: the decoded JSON, or a :class:`MalformedRecord` saying why it is not JSON.
        resolve: where an image reference of the record is; raises ``FileNotFoundError`` for a reference the
            source does not hold and ``ValueError`` for one it cannot support.
    """

    source: str
    record: Any
    resolve: Callable[[str], ImageSource]


class RecordSource(Protocol):
    """A set of records (one data file, a shard pattern, a prepared dataset)."""

    name: str
    """What the user wrote, for the scan's summary line."""

    def records(self) -> Iterator[RawRecord]:
        """Every record, in a fixed order."""
        ...


def open_sources(entries: Sequence[str | Path], image_root: str | Path | None = None, split: str = "train"):
    """The :class:`RecordSource` of each entry of ``train_files`` / ``val_files``.

    Args:
        entries: ``.json`` / ``.jsonl`` files, shard paths or brace patterns (``a-{000..009}.tar``), or
            directories prepared by ``energon prepare``.
        image_root: the directory relative image paths of JSON records start from (default: the file's).
        split: the part of an Energon dataset to read (``train``, ``val``, ``test``).

    Raises:
        ValueError: an entry of no known kind, naming what each kind looks like.
    """
    sources: list[RecordSource] = []
    for entry in entries:
        text = str(entry)
        if text.endswith(SHARD_SUFFIXES) or "{" in text:
            sources.append(WebDatasetShards(text))
        elif Path(text).is_dir():
            if not (Path(text) / ENERGON_META).is_dir():
                raise ValueError(
                    f"{text} is a directory without {ENERGON_META}: prepare it with `energon prepare {text} "
                    "--non-interactive --split-ratio 1,0,0 --sample-type CrudeWebdataset`, or list its .tar shards"
                )
            sources.append(EnergonDataset(text, split))
        elif text.endswith(SUFFIXES):
            sources.append(JsonRecords(text, image_root))
        else:
            raise ValueError(
                f"{text}: a VLM data entry must be a .json list or .jsonl file of records, WebDataset shards "
                "(.tar, or a brace pattern such as train-{000..009}.tar) or an energon-prepared directory"
            )
    return sources


def require(module: str, package: str, what: str) -> Any:
    """``module`` imported, or an ``ImportError`` saying that ``what`` needs ``package`` of the ``vlm`` extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{what} needs the {package} package: pip install 'forge-lightning[vlm]' ({error})"
        ) from error


# ----- JSON files ---------------------------------------------------------------------------------------------
class JsonRecords:
    """The records of one ``.json`` / ``.jsonl`` file; relative image paths start at ``image_root`` (default: the
    file's directory).

    Args:
        path: the data file.
        image_root: the directory of relative image paths.
    """

    def __init__(self, path: str | Path, image_root: str | Path | None = None) -> None:
        self.name = str(path)
        self.path = Path(path)
        self.root = Path(image_root) if image_root is not None else self.path.parent

    def records(self) -> Iterator[RawRecord]:
        for source, record in read_json_records(self.path):
            yield RawRecord(source, record, self._resolve)

    def _resolve(self, ref: str) -> ImageSource:
        return resolve_image(ref, self.root)


# ----- shards (shared by WebDataset and Energon) --------------------------------------------------------------
def _sample_record(source: str, sample: dict[str, Any]) -> Any:
    """The decoded ``json`` member of a shard sample, or a :class:`MalformedRecord`."""
    if "json" not in sample:
        members = ", ".join(sorted(k for k in sample if not k.startswith("__"))) or "none"
        return MalformedRecord(f"{source}: the sample has no json member (its members: {members})")
    try:
        return json.loads(sample["json"])
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return MalformedRecord(f"{source}: the json member is not JSON ({error})")


def _member_resolver(sample: dict[str, Any], member: Callable[[str], Any]) -> Callable[[str], ImageSource]:
    """Resolves an image reference to the member of ``sample`` that has its name (webdataset lowercases
    extensions); ``member(name)`` is where that member can be read again."""

    def resolve(ref: str) -> ImageSource:
        name = ref if ref in sample else ref.lower()
        if name.startswith("__") or not isinstance(sample.get(name), bytes):
            members = ", ".join(sorted(k for k in sample if not k.startswith("__")))
            raise FileNotFoundError(f"{ref} is not a member of the sample (its members: {members})")
        return ImageSource(ref, data=sample[name], member=member(name))

    return resolve


_PID = ("process id",)  # a key no shard path can be


def _per_process(cache: dict[Any, Any], key: Any, open_: Callable[[], Any]) -> Any:
    """``cache[key]``, opened by ``open_`` in this process; a forked worker starts from an empty cache and never
    touches its parent's open files."""
    if cache.get(_PID) != os.getpid():
        cache.clear()
        cache[_PID] = os.getpid()
    if key not in cache:
        cache[key] = open_()
    return cache[key]


# ----- WebDataset ---------------------------------------------------------------------------------------------
_TAR_INDEXES: dict[Any, Any] = {}


@dataclass(frozen=True)
class TarMember:
    """A member of a tar shard, by sample key and extension (webdataset's split of the member name).

    Args:
        shard: the tar file.
        key: the sample key (the member name up to the first dot of its base name).
        extension: the rest of the name, lowercased (``0.jpg``).
    """

    shard: str
    key: str
    extension: str

    def read(self) -> bytes:
        """The member's bytes (the shard's member index is built once per process)."""
        tar, index = _per_process(_TAR_INDEXES, self.shard, lambda: _index_tar(self.shard))
        info = index.get((self.key, self.extension))
        if info is None:
            raise FileNotFoundError(
                f"{self.shard}: no member {self.key}.{self.extension} (the shard changed?)"
            )
        return tar.extractfile(info).read()


def _index_tar(shard: str) -> tuple[tarfile.TarFile, dict[tuple[str, str], tarfile.TarInfo]]:
    tariterators = require("webdataset.tariterators", "webdataset", "reading WebDataset shards")
    tar = tarfile.open(shard)  # noqa: SIM115 -- kept open for the process (see _per_process)
    index = {}
    for info in tar.getmembers():
        key, extension = tariterators.base_plus_ext(info.name)
        if info.isreg() and key is not None:
            index[(key, extension.lower())] = info
    return tar, index


class WebDatasetShards:
    """The samples of WebDataset tar shards, read in order with ``webdataset`` (its member grouping: a sample is
    the run of members sharing a key).

    Args:
        pattern: a shard path or a brace pattern (``train-{000..009}.tar``); ``::`` separates several.
    """

    def __init__(self, pattern: str) -> None:
        shardlists = require("webdataset.shardlists", "webdataset", "reading WebDataset shards")
        self.name = pattern
        self.shards = list(shardlists.expand_urls(pattern))
        if missing := [s for s in self.shards if not Path(s).is_file()]:
            raise FileNotFoundError(
                f"{pattern}: {len(missing)} of {len(self.shards)} shard(s) not found, the first {missing[0]}"
            )

    def records(self) -> Iterator[RawRecord]:
        wds = require("webdataset", "webdataset", "reading WebDataset shards")
        for shard in self.shards:
            pipeline = wds.DataPipeline(
                wds.SimpleShardList([shard]), wds.tarfile_to_samples(handler=wds.reraise_exception)
            )
            name = Path(shard).name
            try:
                for sample in pipeline:
                    key = sample["__key__"]
                    source = f"{name}:{key}"
                    resolve = _member_resolver(sample, lambda ext, s=shard, k=key: TarMember(s, k, ext))
                    yield RawRecord(source, _sample_record(source, sample), resolve)
            except (tarfile.TarError, OSError, ValueError) as error:
                raise ValueError(f"{shard}: not a readable tar shard ({error})") from None


# ----- Energon ------------------------------------------------------------------------------------------------
_ENERGON_STORES: dict[Any, Any] = {}


@dataclass(frozen=True)
class EnergonMember:
    """A member of a sample of an Energon-prepared dataset, read through energon's file store (its tar index).

    Args:
        dataset: the prepared directory.
        entry: the member's name in its shard (``key.0.jpg``).
    """

    dataset: str
    entry: str

    def read(self) -> bytes:
        """The member's bytes."""
        store = _per_process(_ENERGON_STORES, self.dataset, lambda: _energon_store(self.dataset))
        data, _ = store[self.entry]
        return data


def _energon_store(dataset: str) -> Any:
    file_store = require("megatron.energon.cache.file_store", "megatron-energon", "reading Energon datasets")
    epath = require("megatron.energon.epathlib", "megatron-energon", "reading Energon datasets")
    return file_store.WebdatasetFileStore(epath.EPath(dataset))


class EnergonDataset:
    """The samples of one split part of an Energon-prepared dataset (``energon prepare`` with sample type
    ``CrudeWebdataset``), read in order with energon's own dataset loading, members undecoded.

    Args:
        path: the prepared directory (with ``.nv-meta``).
        split: the split part (``train``, ``val``, ``test``).
    """

    def __init__(self, path: str | Path, split: str = "train") -> None:
        self.name = str(path)
        self.path = str(path)
        self.split = split

    def records(self) -> Iterator[RawRecord]:
        energon = require("megatron.energon", "megatron-energon", "reading Energon datasets")
        config = require("megatron.energon.dataset_config", "megatron-energon", "reading Energon datasets")
        worker = energon.WorkerConfig(rank=0, world_size=1, num_workers=0)
        try:
            dataset = config.get_dataset_from_config(
                self.path, split_part=self.split, training=False, worker_config=worker, decoder=None
            ).build()
        except Exception as error:  # energon raises assertion, key and value errors for a bad preparation
            raise ValueError(
                f"{self.path}: energon cannot read split part {self.split!r} ({type(error).__name__}: {error}); "
                "prepare it with `energon prepare --sample-type CrudeWebdataset` and a split that has this part"
            ) from None
        worker.worker_activate(0)  # energon's datasets iterate only inside an active worker
        try:
            for sample in dataset:
                key = sample["__key__"]
                source = f"{self.path}/{sample['__sources__'][0].shard_name}:{key}"
                resolve = _member_resolver(sample, lambda ext, k=key: EnergonMember(self.path, f"{k}.{ext}"))
                yield RawRecord(source, _sample_record(source, sample), resolve)
        finally:
            worker.worker_deactivate()

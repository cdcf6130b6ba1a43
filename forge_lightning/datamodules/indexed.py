"""Megatron-compatible indexed datasets: tokenized documents in a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

The pair is the on-disk format of megatron-core's ``IndexedDataset`` (the "MMIDIDX" format), so data built
here trains under Megatron-LM / NeMo unchanged and data built there loads here.

``PREFIX.bin`` holds every token of every sequence back to back, in the index's dtype. ``PREFIX.idx``
(all integers little-endian)::

    offset  size            field
    0       9               magic  b"MMIDIDX\\x00\\x00"
    9       8   uint64      version (1)
    17      1   uint8       dtype code (see _DTYPE_CODES)
    18      8   uint64      S = number of sequences
    26      8   uint64      D = number of document boundaries (number of documents + 1)
    34      4*S int32       sequence lengths, in tokens
    ..      8*S int64       sequence pointers, byte offset of each sequence in PREFIX.bin
    ..      8*D int64       document indices: document k is sequences [idx[k], idx[k+1])
   (..      1*S int8        sequence modes, only in multimodal datasets; ignored here)

A document may span several sequences (Megatron's sentence-split preprocessing); ours always write one
sequence per document, so document indices are ``0..N``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import TracebackType

import numpy as np

from forge_lightning.atomic_io import replace

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
_DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in _DTYPE_CODES.items()}
_WRITABLE_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32))


class IndexedDatasetError(ValueError):
    """A ``.bin`` / ``.idx`` pair that cannot be read: corrupt, truncated or of an unknown format."""


def bin_path(prefix: str | os.PathLike) -> Path:
    """Return the token file of an indexed dataset prefix (``PREFIX.bin``)."""
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    """Return the index file of an indexed dataset prefix (``PREFIX.idx``)."""
    return Path(f"{os.fspath(prefix)}.idx")


def dataset_exists(prefix: str | os.PathLike) -> bool:
    """Return whether both files of an indexed dataset prefix exist."""
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


def dtype_for_vocab_size(vocab_size: int) -> type[np.number]:
    """Return the smallest token dtype that holds every id of a vocabulary.

    Args:
        vocab_size: Number of token ids, added tokens included (ids are ``0 .. vocab_size - 1``).

    Returns:
        ``np.uint16`` when every id fits in 16 bits, else ``np.int32``.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


class IndexedDatasetWriter:
    """Writes tokenized documents to ``PREFIX.bin`` / ``PREFIX.idx``, one sequence per document.

    Tokens stream to temporary files next to the outputs; :meth:`finalize` writes the index and renames
    both into place, so a reader never sees a half-written dataset. Used as a context manager, an
    exception discards the temporary files.

    Example::

        with IndexedDatasetWriter("data/corpus_text_document", dtype=np.uint16) as writer:
            for ids in token_lists:
                writer.add_document(ids)

    Args:
        prefix: Output prefix; the files are ``PREFIX.bin`` and ``PREFIX.idx``.
        dtype: Token dtype, ``np.uint16`` or ``np.int32`` (see :func:`dtype_for_vocab_size`).
    """

    def __init__(self, prefix: str | os.PathLike, *, dtype: type[np.number] = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _WRITABLE_DTYPES:
            raise ValueError(f"dtype must be uint16 or int32, got {self.dtype}")
        self.prefix = os.fspath(prefix)
        self._info = np.iinfo(self.dtype)
        suffix = f".tmp-{os.getpid()}"
        self._tmp_bin = Path(f"{bin_path(prefix)}{suffix}")
        self._tmp_idx = Path(f"{idx_path(prefix)}{suffix}")
        self._tmp_bin.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 -- closed in finalize() / abort()
        self._lengths: list[int] = []
        self._num_tokens = 0

    @property
    def num_documents(self) -> int:
        """Number of documents added so far."""
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        """Number of tokens added so far."""
        return self._num_tokens

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document (a 1-D sequence of token ids) as one sequence.

        Raises:
            ValueError: If a token id does not fit the writer's dtype.
        """
        if self._bin.closed:
            raise RuntimeError(f"writer for {self.prefix} is already finalized")
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {array.shape}")
        if array.size and (array.min() < self._info.min or array.max() > self._info.max):
            raise ValueError(
                f"token ids in [{array.min()}, {array.max()}] do not fit {self.dtype} "
                f"(range {self._info.min}..{self._info.max}); write with a wider dtype"
            )
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(array.size))
        self._num_tokens += int(array.size)

    def finalize(self) -> None:
        """Write the index and move both files into place (replacing any previous dataset)."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        header = _HEADER.pack(
            _MAGIC, _VERSION, _CODE_OF_DTYPE[self.dtype], len(lengths), len(document_indices)
        )
        with open(self._tmp_idx, "wb") as stream:
            for chunk in (header, lengths.tobytes(), pointers.tobytes(), document_indices.tobytes()):
                stream.write(chunk)
            stream.flush()
            os.fsync(stream.fileno())
        replace(self._tmp_bin, bin_path(self.prefix))
        replace(self._tmp_idx, idx_path(self.prefix))

    def abort(self) -> None:
        """Close and delete the temporary files; nothing is written to the prefix."""
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Reads a Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``) through memory maps.

    Item ``k`` is document ``k`` as a read-only numpy array of token ids. The index is validated when the
    dataset is opened; a problem raises :class:`IndexedDatasetError` naming the file. Pickling (for
    DataLoader workers) carries only the prefix; the files are mapped again on the other side.

    Args:
        prefix: Dataset prefix; the files are ``PREFIX.bin`` and ``PREFIX.idx``.

    Attributes:
        dtype: Token dtype of the ``.bin`` file.
        num_tokens: Total number of tokens.
        sequence_lengths: Tokens per sequence (``int32``; one sequence per document when built here).
        document_lengths: Tokens per document (``int64``).
        document_indices: Sequence index where each document starts, plus the sequence count.

    Raises:
        FileNotFoundError: If either file is missing.
        IndexedDatasetError: If the index is malformed or the token file does not match it.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self._open()

    def _open(self) -> None:
        if not dataset_exists(self.prefix):
            raise FileNotFoundError(
                f"data prefix {self.prefix} not found: expected {self.prefix}.bin and {self.prefix}.idx; "
                "create them with `forge-data pretrain --input ... --tokenizer ... "
                f"--output-prefix {self.prefix}`"
            )
        index = idx_path(self.prefix)
        self.dtype, num_sequences, num_boundaries = _read_header(index)
        self._index_map = np.memmap(index, dtype=np.uint8, mode="r")
        _check_index_size(index, self._index_map.size, num_sequences, num_boundaries)
        offset = _HEADER.size
        self.sequence_lengths = _view(self._index_map, np.int32, offset, num_sequences)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = _view(self._index_map, np.int64, offset, num_sequences)
        offset += self.sequence_pointers.nbytes
        self.document_indices = _view(self._index_map, np.int64, offset, num_boundaries)
        _check_index_arrays(index, self)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        self._tokens = _map_tokens(bin_path(self.prefix), self.dtype, self.num_tokens)
        bounds = np.zeros(num_sequences + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, dtype=np.int64, out=bounds[1:])
        self._document_starts = bounds[self.document_indices[:-1]]
        self.document_lengths = bounds[self.document_indices[1:]] - self._document_starts

    def __len__(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Return tokens ``[offset, offset + length)`` of document ``index`` (all of it by default).

        Args:
            index: Document index; negative values count from the end.
            offset: First token to return, within the document.
            length: Number of tokens to return; ``None`` reads to the end of the document.
        """
        num_documents = len(self)
        if not -num_documents <= index < num_documents:
            raise IndexError(f"document {index} out of range for {num_documents} documents in {self.prefix}")
        index %= num_documents
        document_length = int(self.document_lengths[index])
        if length is None:
            length = document_length - offset
        if offset < 0 or length < 0 or offset + length > document_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for document {index} "
                f"of {document_length} tokens in {self.prefix}"
            )
        start = int(self._document_starts[index]) + offset
        return self._tokens[start : start + length]

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.prefix!r}, documents={len(self)}, tokens={self.num_tokens}, "
            f"dtype={self.dtype})"
        )


def _read_header(index: Path) -> tuple[np.dtype, int, int]:
    with open(index, "rb") as stream:
        raw = stream.read(_HEADER.size)
    if len(raw) < _HEADER.size or not raw.startswith(_MAGIC):
        raise IndexedDatasetError(f"{index} is not a Megatron indexed dataset index (bad magic header)")
    _, version, code, num_sequences, num_boundaries = _HEADER.unpack(raw)
    if version != _VERSION:
        raise IndexedDatasetError(
            f"{index} has index version {version}; only version {_VERSION} is supported"
        )
    if code not in _DTYPE_CODES:
        raise IndexedDatasetError(f"{index} has unknown dtype code {code}")
    return np.dtype(_DTYPE_CODES[code]), num_sequences, num_boundaries


def _view(buffer: np.ndarray, dtype: type[np.number], offset: int, count: int) -> np.ndarray:
    return buffer[offset : offset + count * np.dtype(dtype).itemsize].view(dtype)


def _check_index_size(index: Path, actual: int, num_sequences: int, num_boundaries: int) -> None:
    expected = _HEADER.size + num_sequences * (4 + 8) + num_boundaries * 8
    # Multimodal Megatron datasets append one int8 mode per sequence; the modes are not used here.
    if actual not in (expected, expected + num_sequences):
        raise IndexedDatasetError(
            f"{index} is {actual} bytes but its header describes {num_sequences} sequences and "
            f"{num_boundaries} document indices ({expected} bytes): the index is truncated or corrupt"
        )


def _check_index_arrays(index: Path, dataset: IndexedDataset) -> None:
    lengths, boundaries = dataset.sequence_lengths, dataset.document_indices
    if len(boundaries) == 0 or boundaries[0] != 0 or boundaries[-1] != len(lengths):
        raise IndexedDatasetError(f"{index}: document indices do not cover the {len(lengths)} sequences")
    if np.any(np.diff(boundaries) < 0) or np.any(lengths < 0):
        raise IndexedDatasetError(f"{index}: negative sequence lengths or unordered document indices")
    expected_pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=expected_pointers[1:])
    if not np.array_equal(dataset.sequence_pointers, expected_pointers * dataset.dtype.itemsize):
        raise IndexedDatasetError(f"{index}: sequence pointers do not match the sequence lengths")


def _map_tokens(path: Path, dtype: np.dtype, num_tokens: int) -> np.ndarray:
    expected = num_tokens * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise IndexedDatasetError(
            f"{path} is {actual} bytes but its index describes {num_tokens} {dtype} tokens ({expected} bytes): "
            "the shard is truncated or corrupt, or the .bin and .idx come from different builds"
        )
    if num_tokens == 0:
        return np.empty(0, dtype=dtype)  # an empty file cannot be memory-mapped
    return np.memmap(path, dtype=dtype, mode="r")

"""Megatron indexed dataset format: byte compatibility with megatron-core, validation messages."""

import pickle
import warnings

import numpy as np
import pytest
import torch

from forge_lightning.datamodules.indexed import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    dtype_for_vocab_size,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns that Transformer Engine / Apex are absent on CPU
    from megatron.core.datasets import indexed_dataset as megatron


def _documents(dtype, seed=0, count=40):
    rng = np.random.default_rng(seed)
    high = np.iinfo(np.uint16).max if dtype == np.uint16 else np.iinfo(np.int32).max
    lengths = rng.integers(1, 60, size=count)
    lengths[3] = 1
    return [rng.integers(0, high, size=n, endpoint=True).astype(dtype) for n in lengths]


def _write(prefix, documents, dtype):
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for document in documents:
            writer.add_document(document)
    return writer


def _write_with_megatron(prefix, documents, dtype):
    builder = megatron.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        builder.add_document(torch.from_numpy(document.astype(np.int64)), [len(document)])
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_our_dataset_token_for_token(tmp_path, dtype):
    documents = _documents(dtype)
    writer = _write(tmp_path / "ours", documents, dtype)
    assert writer.num_documents == len(documents)
    assert writer.num_tokens == sum(len(d) for d in documents)

    theirs = megatron.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(documents)
    assert theirs.index.dtype == dtype
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(documents) + 1))
    np.testing.assert_array_equal(theirs.sequence_lengths, [len(d) for d in documents])
    for k, document in enumerate(documents):
        np.testing.assert_array_equal(theirs[k], document)
        np.testing.assert_array_equal(theirs.get(k, offset=1, length=len(document) - 1), document[1:])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_are_byte_identical_to_megatron_builder(tmp_path, dtype):
    documents = _documents(dtype, seed=1)
    _write(tmp_path / "ours", documents, dtype)
    _write_with_megatron(tmp_path / "theirs", documents, dtype)
    for suffix in (".bin", ".idx"):
        ours = (tmp_path / f"ours{suffix}").read_bytes()
        assert ours == (tmp_path / f"theirs{suffix}").read_bytes(), suffix


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_we_read_megatron_builder_output(tmp_path, dtype):
    documents = _documents(dtype, seed=2)
    _write_with_megatron(tmp_path / "theirs", documents, dtype)
    ours = IndexedDataset(tmp_path / "theirs")
    assert len(ours) == len(documents)
    assert ours.dtype == np.dtype(dtype)
    assert ours.num_tokens == sum(len(d) for d in documents)
    np.testing.assert_array_equal(ours.sequence_lengths, [len(d) for d in documents])
    np.testing.assert_array_equal(ours.document_lengths, [len(d) for d in documents])
    for k, document in enumerate(documents):
        np.testing.assert_array_equal(ours[k], document)
    np.testing.assert_array_equal(ours[-1], documents[-1])
    np.testing.assert_array_equal(ours.get(5, offset=2, length=3), documents[5][2:5])


def test_document_of_several_sequences_reads_as_one(tmp_path):
    # Megatron's sentence-split preprocessing stores one sequence per sentence; a document spans several.
    sentences = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6]), np.array([7, 8, 9, 10])]
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "split.bin"), dtype=np.uint16)
    for sentence in sentences[:3]:
        builder.add_item(torch.from_numpy(sentence))
    builder.end_document()
    builder.add_item(torch.from_numpy(sentences[3]))
    builder.end_document()
    builder.finalize(str(tmp_path / "split.idx"))

    data = IndexedDataset(tmp_path / "split")
    assert len(data) == 2
    assert len(data.sequence_lengths) == 4
    np.testing.assert_array_equal(data[0], np.arange(1, 7))
    np.testing.assert_array_equal(data[1], [7, 8, 9, 10])
    np.testing.assert_array_equal(data.document_lengths, [6, 4])


def test_missing_prefix_names_both_files_and_the_fix(tmp_path):
    prefix = tmp_path / "absent_text_document"
    with pytest.raises(FileNotFoundError, match=r"absent_text_document not found: expected .*\.bin and"):
        IndexedDataset(prefix)
    _write(tmp_path / "half", _documents(np.uint16), np.uint16)
    (tmp_path / "half.bin").unlink()
    with pytest.raises(FileNotFoundError, match="forge-data pretrain"):
        IndexedDataset(tmp_path / "half")


def test_truncated_shard_is_reported_with_its_file(tmp_path):
    _write(tmp_path / "data", _documents(np.uint16), np.uint16)
    bin_file = tmp_path / "data.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-2])
    with pytest.raises(IndexedDatasetError, match=r"data\.bin is \d+ bytes but its index .* truncated"):
        IndexedDataset(tmp_path / "data")


def test_truncated_index_is_reported(tmp_path):
    _write(tmp_path / "data", _documents(np.int32), np.int32)
    idx_file = tmp_path / "data.idx"
    idx_file.write_bytes(idx_file.read_bytes()[:-8])
    with pytest.raises(IndexedDatasetError, match=r"data\.idx is \d+ bytes but its header .* truncated"):
        IndexedDataset(tmp_path / "data")


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [(0, b"NOTMMIDX", "bad magic"), (9, b"\x02", "index version 2"), (17, b"\x63", "unknown dtype code 99")],
)
def test_corrupt_header_is_reported(tmp_path, offset, value, message):
    _write(tmp_path / "data", _documents(np.uint16), np.uint16)
    idx_file = tmp_path / "data.idx"
    raw = bytearray(idx_file.read_bytes())
    raw[offset : offset + len(value)] = value
    idx_file.write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match=rf"data\.idx.*{message}"):
        IndexedDataset(tmp_path / "data")


def test_corrupt_pointers_are_reported(tmp_path):
    documents = _documents(np.uint16)
    _write(tmp_path / "data", documents, np.uint16)
    idx_file = tmp_path / "data.idx"
    raw = bytearray(idx_file.read_bytes())
    pointer_offset = 34 + 4 * len(documents) + 8  # the second sequence pointer
    raw[pointer_offset] ^= 0xFF
    idx_file.write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="sequence pointers do not match"):
        IndexedDataset(tmp_path / "data")


def test_writer_rejects_ids_outside_its_dtype_and_leaves_nothing_behind(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "data", dtype=np.uint16)
    with pytest.raises(ValueError, match=r"do not fit uint16"), writer:
        writer.add_document([1, 2, 3])
        writer.add_document([65536])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="uint16 or int32"):
        IndexedDatasetWriter(tmp_path / "data", dtype=np.int64)


def test_writer_replaces_an_existing_dataset_atomically(tmp_path):
    _write(tmp_path / "data", _documents(np.uint16, seed=0), np.uint16)
    writer = IndexedDatasetWriter(tmp_path / "data", dtype=np.uint16)
    writer.add_document([7, 8, 9])
    # Until finalize, readers still see the previous dataset.
    assert len(IndexedDataset(tmp_path / "data")) == 40
    writer.finalize()
    data = IndexedDataset(tmp_path / "data")
    assert len(data) == 1
    np.testing.assert_array_equal(data[0], [7, 8, 9])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "data.idx"]


def test_empty_dataset_and_pickling(tmp_path):
    _write(tmp_path / "empty", [], np.uint16)
    empty = IndexedDataset(tmp_path / "empty")
    assert len(empty) == 0
    assert empty.num_tokens == 0

    documents = _documents(np.int32)
    _write(tmp_path / "data", documents, np.int32)
    restored = pickle.loads(pickle.dumps(IndexedDataset(tmp_path / "data")))
    np.testing.assert_array_equal(restored[7], documents[7])
    with pytest.raises(IndexError, match="document 40 out of range"):
        restored[40]


def test_dtype_for_vocab_size():
    assert dtype_for_vocab_size(65536) == np.uint16
    assert dtype_for_vocab_size(65537) == np.int32
    assert dtype_for_vocab_size(151_936) == np.int32

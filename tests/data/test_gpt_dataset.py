"""Fixed-length samples, document splits and blends: exact token placement, determinism, weights."""

import pickle

import numpy as np
import pytest
import torch

from forge_lightning.datamodules.gpt_dataset import BlendedDataset, TokenSequenceDataset, split_documents
from forge_lightning.datamodules.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter

EOD = 0


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """30 documents of 1..40 tokens, each ending with EOD; token values encode (document, position)."""
    rng = np.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("gpt") / "docs"
    with IndexedDatasetWriter(prefix, dtype=np.int32) as writer:
        for doc in range(30):
            length = int(rng.integers(0, 40))
            writer.add_document([1000 * (doc + 1) + position for position in range(length)] + [EOD])
    return IndexedDataset(prefix)


def _stream(indexed, order):
    return np.concatenate([indexed[int(doc)] for doc in order]).astype(np.int64)


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_samples_are_windows_of_the_shuffled_stream(indexed, seq_length):
    data = TokenSequenceDataset(indexed, seq_length, num_epochs=3, seed=5)
    stream = _stream(indexed, data.document_order)
    assert len(data) == (len(stream) - 1) // seq_length
    for epoch in range(3):
        order = data.document_order[epoch * len(indexed) : (epoch + 1) * len(indexed)]
        assert sorted(order) == list(range(len(indexed)))
    for i in range(len(data)):
        sample = data[i]
        assert sample["input_ids"].dtype == torch.long
        assert sample["input_ids"].shape == sample["labels"].shape == (seq_length,)
        window = stream[i * seq_length : i * seq_length + seq_length + 1]
        np.testing.assert_array_equal(sample["input_ids"].numpy(), window[:-1])
        np.testing.assert_array_equal(sample["labels"].numpy(), window[1:])
    # Every stream token but the final tail is an input exactly once.
    inputs = torch.cat([data[i]["input_ids"] for i in range(len(data))]).numpy()
    np.testing.assert_array_equal(inputs, stream[: len(data) * seq_length])


def test_labels_are_inputs_shifted_by_one_across_samples(indexed):
    data = TokenSequenceDataset(indexed, 16, seed=1)
    for i in range(len(data) - 1):
        torch.testing.assert_close(data[i]["labels"][:-1], data[i]["input_ids"][1:])
        assert data[i]["labels"][-1] == data[i + 1]["input_ids"][0]


def test_num_samples_builds_just_enough_epochs(indexed):
    tokens = int(indexed.document_lengths.sum())
    num_samples = 2 * tokens // 10 + 3  # needs a third epoch
    data = TokenSequenceDataset(indexed, 10, num_samples=num_samples, seed=2)
    assert len(data) == num_samples
    assert data.num_epochs == 3
    stream = _stream(indexed, data.document_order)
    last = data[num_samples - 1]
    np.testing.assert_array_equal(last["labels"].numpy(), stream[num_samples * 10 - 9 : num_samples * 10 + 1])
    with pytest.raises(IndexError, match="out of range"):
        data[num_samples]


def test_order_is_deterministic_by_seed_and_epoch(indexed):
    first = TokenSequenceDataset(indexed, 8, num_epochs=2, seed=3)
    again = TokenSequenceDataset(indexed, 8, num_epochs=2, seed=3)
    other = TokenSequenceDataset(indexed, 8, num_epochs=2, seed=4)
    longer = TokenSequenceDataset(indexed, 8, num_epochs=3, seed=3)
    np.testing.assert_array_equal(first.document_order, again.document_order)
    assert not np.array_equal(first.document_order, other.document_order)
    np.testing.assert_array_equal(longer.document_order[: 2 * len(indexed)], first.document_order)
    for i in (0, 5, len(first) - 1):
        torch.testing.assert_close(first[i], again[i])
    unshuffled = TokenSequenceDataset(indexed, 8, num_epochs=2, shuffle=False)
    np.testing.assert_array_equal(unshuffled.document_order, np.tile(np.arange(len(indexed)), 2))


def test_document_subset_uses_only_those_documents(indexed):
    documents = np.array([2, 5, 11, 17])
    data = TokenSequenceDataset(indexed, 4, documents, seed=0)
    assert sorted(data.document_order) == documents.tolist()
    used = {int(t) // 1000 - 1 for i in range(len(data)) for t in data[i]["input_ids"] if t != EOD}
    assert used <= set(documents.tolist())
    with pytest.raises(IndexError, match="must index the 30 documents"):
        TokenSequenceDataset(indexed, 4, np.array([30]))


def test_position_and_document_ids_restart_at_document_boundaries(indexed):
    data = TokenSequenceDataset(indexed, 32, seed=6, reset_position_ids=True)
    stream_docs = np.concatenate(
        [np.full(indexed.document_lengths[d], k) for k, d in enumerate(data.document_order)]
    )
    for i in range(len(data)):
        sample = data[i]
        owner = stream_docs[i * 32 : i * 32 + 32]
        starts = np.flatnonzero(np.diff(owner, prepend=-1))  # first position of each document in the sample
        expected_ids = np.cumsum(np.diff(owner, prepend=owner[0]) != 0)
        expected_positions = np.arange(32) - starts[expected_ids]
        np.testing.assert_array_equal(sample["document_ids"].numpy(), expected_ids)
        np.testing.assert_array_equal(sample["position_ids"].numpy(), expected_positions)
    assert "position_ids" not in TokenSequenceDataset(indexed, 32)[0]


def test_dataset_pickles_for_dataloader_workers(indexed):
    data = TokenSequenceDataset(indexed, 12, seed=9)
    restored = pickle.loads(pickle.dumps(data))
    torch.testing.assert_close(restored[3], data[3])


def test_invalid_arguments(indexed):
    with pytest.raises(ValueError, match="not both"):
        TokenSequenceDataset(indexed, 8, num_epochs=1, num_samples=4)
    with pytest.raises(ValueError, match="seq_length must be positive"):
        TokenSequenceDataset(indexed, 0)
    with pytest.raises(ValueError, match="make no sample"):
        TokenSequenceDataset(indexed, 10_000)


@pytest.mark.parametrize("num_documents", [0, 1, 2, 3, 10, 97, 1000])
@pytest.mark.parametrize("split", ["98,2", "969,30,1", "1,1", "100,0"])
def test_split_is_disjoint_covering_and_contiguous(num_documents, split):
    parts = split_documents(num_documents, split)
    assert len(parts) == len(split.split(","))
    joined = np.concatenate(parts)
    np.testing.assert_array_equal(joined, np.arange(num_documents))  # ranges, in order, each doc once
    weights = np.array(split.split(","), dtype=float)
    if num_documents >= 2 and weights[1] > 0:
        assert len(parts[1]) >= 1 and len(parts[0]) >= 1
    if weights[1] == 0:
        assert len(parts[1]) == 0


def test_split_sizes_follow_weights_and_seed_permutes():
    train, val, test = split_documents(1000, "969,30,1")
    assert (len(train), len(val), len(test)) == (969, 30, 1)
    assert val.tolist() == list(range(969, 999))
    train_s, val_s = split_documents(1000, "98,2", seed=7)
    assert len(val_s) == 20 and not np.array_equal(val_s, np.arange(980, 1000))
    assert sorted(np.concatenate([train_s, val_s]).tolist()) == list(range(1000))
    np.testing.assert_array_equal(split_documents(1000, "98,2", seed=7)[1], val_s)
    with pytest.raises(ValueError, match="comma-separated numbers"):
        split_documents(10, "98;2")
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        split_documents(10, "0,0")


class _Numbers(torch.utils.data.Dataset):
    def __init__(self, name, length):
        self.name, self.length = name, length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if not 0 <= index < self.length:
            raise IndexError(index)
        return (self.name, index)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 1], [5, 1, 0.25, 2.5]])
@pytest.mark.parametrize("num_samples", [1, 7, 100, 997])
def test_blend_meets_weights_within_one_sample(weights, num_samples):
    datasets = [_Numbers(k, num_samples) for k in range(len(weights))]
    blend = BlendedDataset(datasets, weights, num_samples)
    counts = np.bincount(blend.dataset_index, minlength=len(weights))
    shares = np.asarray(weights) / sum(weights)
    assert counts.sum() == num_samples
    assert np.all(np.abs(counts / num_samples - shares) <= 1 / num_samples)
    # Each dataset's samples are taken in order, and the blend returns exactly those.
    for k in range(len(weights)):
        taken = [blend[i] for i in np.flatnonzero(blend.dataset_index == k)]
        assert taken == [(k, j) for j in range(counts[k])]


def test_blend_is_deterministic_and_seed_draws_subsets():
    datasets = [_Numbers("a", 500), _Numbers("b", 500)]
    first = BlendedDataset(datasets, [1, 3], 400, seed=11)
    again = BlendedDataset(datasets, [1, 3], 400, seed=11)
    assert [first[i] for i in range(400)] == [again[i] for i in range(400)]
    np.testing.assert_array_equal(first.dataset_index, BlendedDataset(datasets, [1, 3], 400).dataset_index)
    drawn_a = [first[i][1] for i in np.flatnonzero(first.dataset_index == 0)]
    assert len(set(drawn_a)) == len(drawn_a) == 100 and drawn_a != list(range(100))


def test_blend_errors():
    datasets = [_Numbers("a", 10), _Numbers("b", 10)]
    with pytest.raises(ValueError, match="got 1 weights for 2 datasets"):
        BlendedDataset(datasets, [1.0], 10)
    with pytest.raises(ValueError, match="weights must all be positive"):
        BlendedDataset(datasets, [1.0, 0.0], 10)
    with pytest.raises(ValueError, match=r"dataset 1 has 10 samples but .* needs 15"):
        BlendedDataset(datasets, [1, 3], 20)


def test_a_token_outside_the_vocabulary_names_its_document(indexed):
    """Token values are 1000 * (document + 1) + position: with a vocabulary of 5000, documents 4 and up are out."""
    within = TokenSequenceDataset(indexed, 16, documents=np.arange(4), vocab_size=5000, shuffle=False)
    assert all(int(within[i]["input_ids"].max()) < 5000 for i in range(len(within)))
    beyond = TokenSequenceDataset(indexed, 16, documents=np.arange(3, 8), vocab_size=5000, shuffle=False)
    with pytest.raises(
        IndexedDatasetError, match=r"docs\.bin: document \d holds token id \d+ at position \d+, outside"
    ):
        for i in range(len(beyond)):
            beyond[i]

"""Fixed-length language-modelling samples from indexed datasets, train/validation splits and blends.

How samples are cut (as in Megatron's ``GPTDataset``)::

    epoch 0 (shuffled docs)          epoch 1 (reshuffled)
    [d3 ...EOD][d0 ..EOD][d1 ...EOD] [d1 ...EOD][d3 ...EOD][d0 ..EOD]     one token stream
    |-- sample 0: S+1 tokens --|
                               |-- sample 1: S+1 tokens --|
                                                          |-- sample 2 ...

Sample ``i`` reads stream tokens ``[i*S, i*S + S]``: ``input_ids`` are the first ``S``, ``labels`` the last
``S``, so consecutive samples share one token. Only the per-epoch document order and its cumulative
token offsets are built up front; a sample finds its documents by binary search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from forge_lightning.datamodules.indexed import IndexedDataset, IndexedDatasetError, bin_path


class TokenSequenceDataset(Dataset):
    """Fixed-length next-token-prediction samples over the documents of an :class:`IndexedDataset`.

    Each epoch visits every selected document once, in an order shuffled from ``(seed, epoch)``; the
    epochs are concatenated into one token stream cut into overlapping windows of ``seq_length + 1``
    tokens (see the module docstring). Documents are expected to end with an end-of-document token, as
    ``forge-data pretrain`` writes them.

    Args:
        indexed: The tokenized documents.
        seq_length: Tokens per sample.
        documents: Indices of the documents to use (e.g. one split of :func:`split_documents`); all of
            them by default.
        seed: Seed of the per-epoch document shuffles.
        num_epochs: Passes over the documents; the dataset holds every full sample they yield.
        num_samples: Number of samples wanted instead; enough epochs are built to provide them. Give at
            most one of ``num_epochs`` and ``num_samples``; neither means one epoch.
        shuffle: Shuffle the documents of each epoch (off: every epoch keeps the ``documents`` order).
        reset_position_ids: Also return ``position_ids`` restarting at 0 at each document start inside a
            sample and ``document_ids`` numbering those documents 0, 1, ... (for packed attention).
        vocab_size: When given, every token read is checked against it: an id outside ``0 .. vocab_size - 1``
            (data tokenized with another tokenizer) raises :class:`IndexedDatasetError` naming the document.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_length: int,
        documents: np.ndarray | None = None,
        *,
        seed: int = 1234,
        num_epochs: int | None = None,
        num_samples: int | None = None,
        shuffle: bool = True,
        reset_position_ids: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if num_epochs is not None and num_samples is not None:
            raise ValueError(f"give num_epochs ({num_epochs}) or num_samples ({num_samples}), not both")
        self.indexed = indexed
        self.seq_length = seq_length
        self.reset_position_ids = reset_position_ids
        self.vocab_size = vocab_size
        self.documents = np.arange(len(indexed)) if documents is None else np.asarray(documents, np.int64)
        if self.documents.size and not (self.documents.min() >= 0 and self.documents.max() < len(indexed)):
            raise IndexError(f"documents must index the {len(indexed)} documents of {indexed.prefix}")
        self.tokens_per_epoch = int(indexed.document_lengths[self.documents].sum())
        if self.tokens_per_epoch < 2:
            raise ValueError(
                f"the {len(self.documents)} selected documents of {indexed.prefix} hold "
                f"{self.tokens_per_epoch} tokens; at least 2 are needed to make a sample"
            )
        self.num_epochs, self.num_samples = _size_stream(
            self.tokens_per_epoch, seq_length, num_epochs=num_epochs, num_samples=num_samples
        )
        self.document_order = _epoch_orders(self.documents, self.num_epochs, seed=seed, shuffle=shuffle)
        lengths = indexed.document_lengths[self.document_order]
        # _starts[k]: stream offset of the k-th document in document_order; the last entry is the total.
        self._starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, dtype=np.int64, out=self._starts[1:])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        pieces = self._read_window(index * self.seq_length, self.seq_length + 1)
        tokens = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        sample = {"input_ids": tokens[:-1], "labels": tokens[1:].clone()}
        if self.reset_position_ids:
            sample.update(_document_positions([len(piece) for piece in pieces], self.seq_length))
        return sample

    def _read_window(self, start: int, length: int) -> list[np.ndarray]:
        """Return the stream tokens ``[start, start + length)`` as one piece per document touched."""
        end = start + length
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        last = int(np.searchsorted(self._starts, end - 1, side="right")) - 1
        pieces = []
        for position in range(first, last + 1):
            doc_start, doc_end = int(self._starts[position]), int(self._starts[position + 1])
            lo, hi = max(start, doc_start), min(end, doc_end)
            if hi > lo:
                document = int(self.document_order[position])
                piece = self.indexed.get(document, lo - doc_start, hi - lo)
                if (
                    self.vocab_size is not None
                    and piece.size
                    and not (int(piece.min()) >= 0 and int(piece.max()) < self.vocab_size)
                ):
                    self._refuse_token(document, piece, lo - doc_start)
                pieces.append(piece)
        return pieces

    def _refuse_token(self, document: int, piece: np.ndarray, offset: int) -> None:
        at = int(np.argmax((piece >= self.vocab_size) | (piece < 0)))
        raise IndexedDatasetError(
            f"{bin_path(self.indexed.prefix)}: document {document} holds token id {int(piece[at])} at position "
            f"{offset + at}, outside the tokenizer's vocabulary of {self.vocab_size}: the data was tokenized with "
            "another tokenizer. Re-tokenize it with this run's (forge-data pretrain --tokenizer ...) or give "
            "data.tokenizer the one it was made with"
        )


def _size_stream(
    tokens_per_epoch: int, seq_length: int, *, num_epochs: int | None, num_samples: int | None
) -> tuple[int, int]:
    """Return ``(num_epochs, num_samples)`` from whichever of the two is given (one epoch by default)."""
    if num_samples is not None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        # The stream needs num_samples * seq_length tokens plus the last sample's final label.
        return math.ceil((num_samples * seq_length + 1) / tokens_per_epoch), num_samples
    num_epochs = 1 if num_epochs is None else num_epochs
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be positive, got {num_epochs}")
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    if num_samples < 1:
        raise ValueError(
            f"{num_epochs * tokens_per_epoch} tokens make no sample of seq_length {seq_length} + 1; "
            "use more epochs, more documents or a shorter seq_length"
        )
    return num_epochs, num_samples


def _epoch_orders(documents: np.ndarray, num_epochs: int, *, seed: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.tile(documents, num_epochs)
    # Each epoch draws from its own (seed, epoch) stream, so epoch e is the same whatever num_epochs is.
    orders = [np.random.default_rng([seed, epoch]).permutation(documents) for epoch in range(num_epochs)]
    return np.concatenate(orders)


def _document_positions(piece_lengths: list[int], seq_length: int) -> dict[str, torch.Tensor]:
    lengths = np.asarray(piece_lengths)
    document_ids = np.repeat(np.arange(len(lengths)), lengths)[:seq_length]
    piece_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    position_ids = np.arange(seq_length) - piece_starts[document_ids]
    return {"position_ids": torch.from_numpy(position_ids), "document_ids": torch.from_numpy(document_ids)}


def split_documents(
    num_documents: int, split: str | Sequence[float] = "98,2", *, seed: int | None = None
) -> tuple[np.ndarray, ...]:
    """Split document indices into contiguous ranges by weight (Megatron's ``--split``).

    Weights such as ``"969,30,1"`` are normalised; one index array is returned per weight, in order
    (train, validation[, test]). Every split with a positive weight gets at least one document when
    there are enough documents (a larger split gives one up; the first split keeps at least one).

    Args:
        num_documents: Number of documents to split.
        split: Weights as ``"98,2"`` (``,`` or ``/`` separated) or a sequence of numbers.
        seed: ``None`` cuts ranges of the documents in order, exactly like Megatron; an integer cuts them
            from a permutation drawn from this seed instead (each split is returned sorted), so a corpus
            stored in a meaningful order (by source file, by date) gets representative splits.

    Returns:
        One sorted ``int64`` array of document indices per weight, together covering each document once.
    """
    weights = _parse_split(split)
    if num_documents < 0:
        raise ValueError(f"num_documents must be non-negative, got {num_documents}")
    bounds = np.round(np.cumsum(weights) * num_documents).astype(np.int64)
    bounds[-1] = num_documents  # the float sum of the weights may fall just short of 1
    sizes = np.diff(np.concatenate([[0], bounds]))
    for k in np.flatnonzero((weights > 0) & (sizes == 0)):
        donor = int(np.argmax(sizes))
        if sizes[donor] > 1:
            sizes[donor] -= 1
            sizes[k] += 1
    order = (
        np.arange(num_documents) if seed is None else np.random.default_rng(seed).permutation(num_documents)
    )
    ends = np.cumsum(sizes)
    return tuple(np.sort(order[end - size : end]).astype(np.int64) for size, end in zip(sizes, ends))


def _parse_split(split: str | Sequence[float]) -> np.ndarray:
    try:
        parts = split.replace("/", ",").split(",") if isinstance(split, str) else list(split)
        weights = np.asarray([float(part) for part in parts], dtype=np.float64)
    except ValueError:
        raise ValueError(
            f"split must be comma-separated numbers like '98,2' or '969,30,1', got {split!r}"
        ) from None
    if weights.size == 0 or np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError(f"split weights must be non-negative with a positive sum, got {split!r}")
    return weights / weights.sum()


class BlendedDataset(Dataset):
    """Mixes datasets by weight: sample ``i`` comes from the dataset that most lags its share.

    The dataset of each sample is chosen greedily, as in Megatron's ``BlendedDataset``: the one whose
    count of samples so far falls furthest below ``weight * (i + 1)``. The result is deterministic; every
    dataset is over-represented by less than one sample at any prefix and, in practice, under-represented
    by at most about one.

    Args:
        datasets: The datasets to mix.
        weights: One positive weight per dataset (normalised).
        num_samples: Length of the blend.
        seed: ``None`` takes each dataset's samples in order from its start; an integer takes them in the
            order of a permutation drawn from ``(seed, dataset position)``, so a dataset larger than its
            share contributes a random subset rather than its first samples.

    Raises:
        ValueError: For mismatched lengths, non-positive weights, or a dataset too short for its share.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        weights: Sequence[float],
        num_samples: int,
        *,
        seed: int | None = None,
    ) -> None:
        if len(datasets) == 0:
            raise ValueError("BlendedDataset needs at least one dataset")
        if len(weights) != len(datasets):
            raise ValueError(f"got {len(weights)} weights for {len(datasets)} datasets; give one weight each")
        if any(not weight > 0 for weight in weights):
            raise ValueError(f"weights must all be positive, got {list(weights)}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.datasets = list(datasets)
        total = float(sum(weights))
        self.weights = [float(weight) / total for weight in weights]
        self.num_samples = num_samples
        self.dataset_index, self.dataset_sample_index = _greedy_blend(self.weights, num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for k, (dataset, count) in enumerate(zip(self.datasets, counts)):
            if count > len(dataset):
                raise ValueError(
                    f"dataset {k} has {len(dataset)} samples but its weight {self.weights[k]:.4f} of "
                    f"{num_samples} needs {count}; build it with num_samples >= {count}"
                )
            if seed is not None and count > 0:
                chosen = self.dataset_index == k
                drawn = np.random.default_rng([seed, k]).choice(len(dataset), size=count, replace=False)
                self.dataset_sample_index[chosen] = drawn[self.dataset_sample_index[chosen]]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]


def _greedy_blend(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    counts = [0] * len(weights)
    dataset_index = np.empty(num_samples, dtype=np.int32)
    sample_index = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        # Lag is measured against the share due once this sample is taken; ties go to the lower index.
        due = i + 1
        chosen, most_lag = 0, weights[0] * due - counts[0]
        for k in range(1, len(weights)):
            lag = weights[k] * due - counts[k]
            if lag > most_lag:
                chosen, most_lag = k, lag
        dataset_index[i] = chosen
        sample_index[i] = counts[chosen]
        counts[chosen] += 1
    return dataset_index, sample_index

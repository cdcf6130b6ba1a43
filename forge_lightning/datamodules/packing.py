"""Sequence packing: several samples per fixed-length sequence, with document boundaries for attention.

Online best-fit bin packing (each sample goes to the open sequence with the least room that still fits it) keeps
padding small without sorting the whole data set. A packed sequence carries::

    input_ids     [a0 a1 a2 b0 b1 c0 c1 c2 c3 p  p ]    p: padding (its own document, never trained)
    labels        [.. .. .. .. .. .. .. .. .. -100 -100]
    position_ids  [0  1  2  0  1  0  1  2  3  0  1 ]    positions restart per document
    document_ids  [0  0  0  1  1  2  2  2  2  3  3 ]    attention stays within a document

The model turns ``document_ids`` into a block-diagonal causal mask (or a varlen / block-sparse kernel), so the
per-token loss of a packed sample equals its loss alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from forge_lightning.modules.layers.attention import document_positions


def best_fit_pack(
    lengths: Sequence[int],
    capacity: int,
    *,
    buffer_size: int = 64,
    extra_sizes: Sequence[int] | None = None,
    extra_capacity: int | None = None,
) -> list[list[int]]:
    """Group sample indices into bins of at most ``capacity`` tokens, online, with best-fit placement.

    Samples are taken in order. Each goes to the open bin with the least room left that still fits it, or opens a
    new bin. When more than ``buffer_size`` bins are open, the fullest is closed (emitted), so memory and time per
    sample stay bounded and the result does not depend on the data set size.

    Args:
        lengths: tokens of each sample.
        capacity: tokens per bin (the packed sequence length).
        buffer_size: most bins kept open at once.
        extra_sizes: a second size of each sample that a bin also bounds (e.g. its vision-encoder patches).
        extra_capacity: the most ``extra_sizes`` per bin (needed with ``extra_sizes``).

    Returns:
        Lists of sample indices, one per bin, in the order the bins were closed.
    """
    if capacity < 1 or buffer_size < 1:
        raise ValueError(f"capacity ({capacity}) and buffer_size ({buffer_size}) must be positive")
    if (extra_sizes is None) != (extra_capacity is None):
        raise ValueError("extra_sizes and extra_capacity go together: give both or neither")
    extras = [0] * len(lengths) if extra_sizes is None else extra_sizes
    extra_capacity = 0 if extra_capacity is None else extra_capacity
    bins: list[list[int]] = []
    rooms: list[int] = []
    extra_rooms: list[int] = []
    closed: list[list[int]] = []
    for index, (length, extra) in enumerate(zip(lengths, extras, strict=True)):
        if not 0 < length <= capacity:
            raise ValueError(f"sample {index} has {length} tokens; packing needs 1..capacity ({capacity})")
        if extra > extra_capacity:
            raise ValueError(
                f"sample {index} has extra size {extra}, more than extra_capacity ({extra_capacity})"
            )
        fits = [k for k, room in enumerate(rooms) if room >= length and extra_rooms[k] >= extra]
        if fits:
            best = min(fits, key=rooms.__getitem__)
            bins[best].append(index)
            rooms[best] -= length
            extra_rooms[best] -= extra
        else:
            bins.append([index])
            rooms.append(capacity - length)
            extra_rooms.append(extra_capacity - extra)
        if len(bins) > buffer_size:
            fullest = min(range(len(rooms)), key=rooms.__getitem__)
            closed.append(bins.pop(fullest))
            rooms.pop(fullest)
            extra_rooms.pop(fullest)
    return closed + bins


def shuffled_best_fit_pack(
    lengths: Sequence[int], capacity: int, *, seed: int, buffer_size: int = 64, **extra: Any
) -> list[list[int]]:
    """:func:`best_fit_pack` of the samples taken in a seeded random order (so bins mix the data set's sources);
    ``extra``: its ``extra_sizes`` / ``extra_capacity``. Returns bins of indices into ``lengths``."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    if extra.get("extra_sizes") is not None:
        extra = {**extra, "extra_sizes": [extra["extra_sizes"][i] for i in order]}
    bins = best_fit_pack([lengths[i] for i in order], capacity, buffer_size=buffer_size, **extra)
    return [[int(order[i]) for i in b] for b in bins]


class PackedDataset(Dataset):
    """Packs the variable-length samples of ``dataset`` into sequences of exactly ``seq_length`` tokens.

    Args:
        dataset: map-style dataset of ``{"input_ids", "labels"}`` samples of at most ``seq_length`` tokens.
        bins: sample indices per packed sequence (from :func:`best_fit_pack`).
        seq_length: tokens per packed sequence.
        pad_id: token id of the padding that fills a sequence.
        ignore_index: label of padding tokens.
    """

    def __init__(
        self,
        dataset: Dataset,
        bins: list[list[int]],
        seq_length: int,
        *,
        pad_id: int = 0,
        ignore_index: int = -100,
    ) -> None:
        self.dataset = dataset
        self.bins = bins
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.ignore_index = ignore_index

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.pack([self.dataset[i] for i in self.bins[index]], index)

    def pack(self, samples: list[dict[str, torch.Tensor]], index: int) -> dict[str, torch.Tensor]:
        """The packed sequence of the ``samples`` of bin ``index``: their ``input_ids`` and ``labels``, then
        padding, with ``position_ids`` and ``document_ids``."""
        lengths = [len(s["input_ids"]) for s in samples]
        padding = self.seq_length - sum(lengths)
        if padding < 0:
            raise ValueError(
                f"bin {index} holds {sum(lengths)} tokens, more than seq_length ({self.seq_length})"
            )
        input_ids = [s["input_ids"] for s in samples] + [torch.full((padding,), self.pad_id)]
        labels = [s["labels"] for s in samples] + [torch.full((padding,), self.ignore_index)]
        document_ids = torch.from_numpy(np.repeat(np.arange(len(lengths) + 1), [*lengths, padding]))
        return {
            "input_ids": torch.cat(input_ids).long(),
            "labels": torch.cat(labels).long(),
            "position_ids": document_positions(document_ids),
            "document_ids": document_ids,
        }


def pad_collate(
    samples: list[dict[str, torch.Tensor]], *, pad_id: int = 0, ignore_index: int = -100
) -> dict[str, Any]:
    """Stack samples, right-padding ``input_ids`` with ``pad_id`` and ``labels`` with ``ignore_index``.

    Right padding needs no attention mask: causal attention never lets a real token see the padding after it.
    Other keys must already share one length.
    """
    longest = max(len(s["input_ids"]) for s in samples)
    pad_value = {"input_ids": pad_id, "labels": ignore_index}
    batch = {}
    for key in samples[0]:
        if key in pad_value:
            rows = [
                torch.nn.functional.pad(s[key], (0, longest - len(s[key])), value=pad_value[key])
                for s in samples
            ]
        else:
            rows = [s[key] for s in samples]
        batch[key] = torch.stack(rows)
    return batch

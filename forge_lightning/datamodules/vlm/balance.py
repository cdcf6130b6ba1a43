"""Data-parallel load balancing: each global micro-batch's samples (or packed rows) are dealt to the ranks by
estimated compute, so that no rank waits for the slowest one at the gradient all-reduce (or, under FSDP, at every
layer's collectives).

The global micro-batch is the same set of samples as without balancing (the :class:`StepLoader`'s order), only
its split over the ranks changes; the loss is normalised by the whole global batch's trained tokens
(``step_tokens`` summed over the ranks), so the step's loss and gradient are unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from forge_lightning.datamodules.loader import StepLoader
from forge_lightning.datamodules.vlm.dataset import VLMDataset
from forge_lightning.datamodules.vlm.packing import VLMPackedDataset
from forge_lightning.datamodules.vlm.scan import VLMSample
from forge_lightning.datamodules.vlm.vision_inputs import VideoInputs


@dataclass(kw_only=True)
class CostModel:
    """Forward FLOPs of a row, estimated from its documents' tokens and its images' patches (the defaults are
    Qwen2.5-VL-7B's sizes; only ratios matter).

    Per layer, the linear layers cost ``24 * hidden ** 2`` per token (projections and MLP of ~12 ``hidden ** 2``
    weights) and attention ``4 * hidden`` per (query, key) pair: causal within each LLM document
    (``n ** 2 / 2`` pairs), bidirectional within each image in the encoder (``p ** 2``; Qwen2.5-VL's windowed layers
    cost less, so images are somewhat overweighted; a video counts as one image per temporal patch).

    Args:
        llm_hidden_size: the LLM's hidden size.
        llm_num_layers: its layers.
        vision_hidden_size: the vision encoder's hidden size.
        vision_num_layers: its layers.
    """

    llm_hidden_size: int = 3584
    llm_num_layers: int = 28
    vision_hidden_size: int = 1280
    vision_num_layers: int = 32

    def cost(self, documents: Sequence[int], images: Sequence[int]) -> float:
        """Estimated FLOPs of a row of ``documents`` (tokens of each) with ``images`` (patches of each)."""
        d, dv = self.llm_hidden_size, self.vision_hidden_size
        llm = 24 * d * d * sum(documents) + 2 * d * sum(n * n for n in documents)
        vision = 24 * dv * dv * sum(images) + 4 * dv * sum(p * p for p in images)
        return float(self.llm_num_layers * llm + self.vision_num_layers * vision)


def _image_patches(dataset: VLMDataset, samples: Sequence[VLMSample]) -> list[int]:
    """Patches of each image, and of each temporal patch of each video (the encoder attends within a frame)."""
    vision = dataset.vision
    patches = [vision.num_patches(size) for s in samples for size in s.sizes]
    for video in (v for s in samples for v in s.videos):
        t, h, w = cast(VideoInputs, vision).video_grid(video.info)
        patches += [h * w] * t
    return patches


def item_costs(dataset: VLMDataset | VLMPackedDataset, model: CostModel) -> list[float]:
    """The cost of every item of ``dataset``: a sample, or a packed row (its padding counted as a document)."""
    if isinstance(dataset, VLMPackedDataset):
        rows = [dataset.documents(i) for i in range(len(dataset))]
        return [model.cost(docs, _image_patches(dataset.dataset, samples)) for docs, samples in rows]
    return [model.cost([s.length], _image_patches(dataset, [s])) for s in dataset.samples]


def balanced_partition(costs: Sequence[float], num_parts: int, part_size: int) -> list[list[int]]:
    """Split ``num_parts * part_size`` items into ``num_parts`` groups of ``part_size`` with nearly equal total
    cost: the costliest first, each to the cheapest group that still has room (LPT with a size bound), then swaps
    of one item between the costliest and the cheapest group while a swap narrows their gap.

    Returns:
        Indices into ``costs`` per group, each in ascending order.
    """
    if len(costs) != num_parts * part_size:
        raise ValueError(f"{len(costs)} costs cannot fill {num_parts} groups of {part_size}")
    groups: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0.0, g) for g in range(num_parts)]  # (load, group) of the groups with room
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(index)
        if len(groups[g]) < part_size:
            heapq.heappush(heap, (load + costs[index], g))
    for _ in range(len(costs)):  # each swap lowers the sum of squared loads, so this ends; bounded for speed
        if not _swap_once(costs, groups):
            break
    return [sorted(g) for g in groups]


def _swap_once(costs: Sequence[float], groups: list[list[int]]) -> bool:
    """Swap the item pair of the costliest and cheapest group that best halves their gap; ``False``: none does."""
    loads = [sum(costs[i] for i in g) for g in groups]
    hi, lo = loads.index(max(loads)), loads.index(min(loads))
    gap = loads[hi] - loads[lo]
    pairs = [(a, b) for a in range(len(groups[hi])) for b in range(len(groups[lo]))]
    moves = [
        (abs(gap / 2 - d), a, b)
        for a, b in pairs
        if 0 < (d := costs[groups[hi][a]] - costs[groups[lo][b]]) < gap
    ]
    if not moves:
        return False
    _, a, b = min(moves)
    groups[hi][a], groups[lo][b] = groups[lo][b], groups[hi][a]
    return True


class BalancedStepLoader(StepLoader):
    """A :class:`StepLoader` whose global micro-batches are split over the ranks by :func:`balanced_partition` of
    the items' ``costs`` instead of in contiguous blocks (every rank computes the same split).

    Args:
        dataset: the items.
        costs: the cost of each item (see :func:`item_costs`).
        options: the :class:`StepLoader`'s.
    """

    def __init__(self, dataset: Any, *, costs: Sequence[float], **options: Any) -> None:
        if len(costs) != len(dataset):
            raise ValueError(f"{len(costs)} costs for {len(dataset)} items")
        self.costs = np.asarray(costs, dtype=np.float64)
        super().__init__(dataset, **options)

    def _batch_indices(self, epoch: int, start: int) -> list[list[int]]:
        order = self._epoch_order(epoch)
        width = self.batch_size * self.num_replicas
        batches = []
        for j in range(start, len(self)):
            members = order[j * width : (j + 1) * width]
            parts = balanced_partition(self.costs[members].tolist(), self.num_replicas, self.batch_size)
            batches.append([int(members[k]) for k in parts[self.rank]])
        return batches

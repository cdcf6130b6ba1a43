"""Training batches of one group each (a video bucket, a cached feature shape): the :class:`StepLoader`'s rules
(``batch_size`` per rank, whole optimizer steps, exact resumption) with batches that never mix shapes.

Each epoch, the samples of every group are shuffled (seeded by ``[seed, epoch, group]``) and cut into global
micro-batches of ``batch_size x num_replicas`` (the remainder of a group is left out that epoch); the global
micro-batches of all groups are then shuffled together. Rank ``r`` takes the ``r``-th block of ``batch_size`` of
each, so one process with batch ``W x B`` and ``W`` processes with batch ``B`` see the same samples.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset
from typing_extensions import override

from forge_lightning.datamodules.loader import StepLoader


def group_batches(
    groups: Sequence[Hashable], width: int, *, seed: int, epoch: int, shuffle: bool
) -> list[list[int]]:
    """Global micro-batches of ``width`` sample indices, each of one group.

    Args:
        groups: the group of each sample.
        width: samples per global micro-batch.
        seed: seed of the shuffle.
        epoch: the epoch (a new order each).
        shuffle: ``False``: groups in order of first appearance, samples in dataset order.
    """
    members: dict[Hashable, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    batches = []
    for number, indices in enumerate(members.values()):
        order = np.asarray(indices)
        if shuffle:
            order = np.random.default_rng([seed, epoch, number]).permutation(order)
        batches += [order[k : k + width].tolist() for k in range(0, len(order) - width + 1, width)]
    if shuffle:
        batches = [batches[k] for k in np.random.default_rng([seed, epoch]).permutation(len(batches))]
    return batches


class GroupedStepLoader(StepLoader):
    """A :class:`StepLoader` whose batches each hold samples of one group.

    Args:
        dataset: a map-style dataset with ``group(index)`` (e.g. a video bucket).
        **options: as :class:`StepLoader`.
    """

    def __init__(self, dataset: Dataset, **options: Any) -> None:
        self._groups = [dataset.group(i) for i in range(len(dataset))]  # type: ignore[attr-defined, arg-type]
        self._width = options["batch_size"] * options.get("num_replicas", 1)
        self._cache: tuple[int, list[list[int]]] | None = None
        super().__init__(dataset, **options)

    def _global_batches(self, epoch: int) -> list[list[int]]:
        if self._cache is None or self._cache[0] != epoch:
            batches = group_batches(
                self._groups, self._width, seed=self.seed, epoch=epoch, shuffle=self.shuffle
            )
            self._cache = (epoch, batches)
        return self._cache[1]

    @override
    def __len__(self) -> int:
        # every epoch cuts the same number of global micro-batches from each group
        return len(self._global_batches(0)) // self.accumulate * self.accumulate

    @override
    def _batch_indices(self, epoch: int, start: int) -> list[list[int]]:
        offset = self.rank * self.batch_size
        batches = self._global_batches(epoch)
        return [batches[j][offset : offset + self.batch_size] for j in range(start, len(self))]

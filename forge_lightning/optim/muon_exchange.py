"""Tensor-wise ownership for Muon: which rank orthogonalises each matrix, how its full update reaches that rank and
how the result goes back.

Muon's Newton-Schulz iteration needs each matrix whole. Every matrix is given to one owner rank (balancing the
iteration's FLOPs); :meth:`MatrixExchange.gather` brings the owner the full matrix from whatever each rank holds
(the full tensor under DDP / ZeRO-1, a shard under FSDP2, a TP slice under Megatron), and
:meth:`MatrixExchange.publish` hands every rank its own part of the owner's result.

``LocalExchange`` is the one-process case. The distributed exchanges live beside it and share its interface.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on a matrix (or a stack of matrices) of ``shape``.

    Per iteration on an ``m x n`` matrix with ``m <= n``: the Gram matrix (``2 m^2 n``), its square (``2 m^3``)
    and the product with the matrix (``2 m^2 n``).
    """
    *batch, rows, cols = shape
    m, n = min(rows, cols), max(rows, cols)
    count = 1
    for b in batch:
        count *= b
    return float(count * steps * (4 * m * m * n + 2 * m**3))


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """The owner rank of each item: the costliest item first, each to the least loaded rank (ties: the lower
    rank, then the lower item index), so every rank computes the same assignment."""
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be positive")
    owners = [0] * len(costs)
    loads = [(0.0, rank) for rank in range(world_size)]
    heapq.heapify(loads)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return owners


class MatrixExchange(Protocol):
    """Moves matrices between what each rank holds and their owners.

    Built once per optimizer over a fixed list of parameters (index ``i`` is parameter ``i`` everywhere); every
    rank calls :meth:`gather` and :meth:`publish` with the same indices, in the same order.
    """

    owners: list[int]
    """Owner rank (in the exchange's group) of each parameter."""

    rank: int
    """This process's rank in the exchange's group."""

    replicated: bool
    """Every rank holds every matrix whole (DDP, ZeRO-1): only owners keep Muon state and pass a local tensor to
    :meth:`gather` (other ranks pass ``None``)."""

    def is_owner(self, index: int) -> bool:
        """Whether this rank orthogonalises parameter ``index``."""
        ...

    def gather(self, local: Sequence[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """The full matrices of the parameters this rank owns, from every rank's ``local[i]`` (this rank's part of
        matrix ``i``, in the parameter's local layout: a plain tensor, or a DTensor's local shard; ``None`` where
        the exchange is replicated and this rank does not own ``i``)."""
        ...

    def publish(self, results: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every parameter's result, as this rank's part (the shape of ``local[i]`` in :meth:`gather`), from the
        owners' full ``results`` (this rank passes those of the parameters it owns)."""
        ...


class LocalExchange:
    """One process: it owns every matrix, which it already holds whole."""

    rank = 0
    replicated = True

    def __init__(self, count: int) -> None:
        self.owners = [0] * count

    def is_owner(self, index: int) -> bool:
        """Always: there is no other rank."""
        return True

    def gather(self, local: Sequence[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """The tensors themselves."""
        return {i: t for i, t in enumerate(local) if t is not None}

    def publish(self, results: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """The results themselves, in index order."""
        return [results[i] for i in range(len(self.owners))]

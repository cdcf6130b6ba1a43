"""Tensor-wise ownership for Muon: which rank orthogonalises each matrix, how its full update reaches that rank and
how the result goes back.

Muon's Newton-Schulz iteration needs each matrix whole. Every matrix is given to one owner rank (balancing the
iteration's FLOPs); :meth:`MatrixExchange.gather` brings the owner the full matrix from whatever each rank holds
(the full tensor under DDP / ZeRO-1, a shard under FSDP2, a TP slice under Megatron), and
:meth:`MatrixExchange.publish` hands every rank its own part of the owner's result.

``LocalExchange`` is the one-process case; ``ReplicatedExchange`` the case where every rank holds every parameter
whole (DDP, ZeRO-1): gathering costs nothing, and publishing broadcasts each owner's results, coalesced into one
flat buffer per owner and dtype. The FSDP2 exchange (``muon_sharded``) and Megatron's share the same interface.

Results passed to :meth:`MatrixExchange.publish` have their parameter's dtype, so receivers can size their buffers
without asking the owner.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


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
        owners' full ``results`` (this rank passes those of the parameters it owns, each in its parameter's dtype)."""
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


class ReplicatedExchange:
    """Every rank holds every tensor whole (DDP, ZeRO-1): owners by :func:`assign_owners` over the group.

    :meth:`gather` needs no communication (an owner already holds the full tensor); :meth:`publish` broadcasts
    each owner's results as one flat buffer per owner and dtype, so a step costs one collective per rank that
    owns something instead of one per parameter.

    Args:
        params: the parameters, in the order every rank indexes them.
        costs: each parameter's cost (e.g. :func:`newton_schulz_flops`), balanced over the ranks.
        group: the process group the tensors are replicated over (``None``: the default group).
    """

    replicated = True

    def __init__(
        self, params: Sequence[torch.Tensor], costs: Sequence[float], group: ProcessGroup | None = None
    ) -> None:
        if len(params) != len(costs):
            raise ValueError(
                f"ReplicatedExchange got {len(params)} params but {len(costs)} costs: give one cost each"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ReplicatedExchange needs an initialised process group: call torch.distributed.init_process_group "
                "first, or use LocalExchange in one process"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.owners = assign_owners(costs, dist.get_world_size(group))
        self._shapes = [p.shape for p in params]
        self._dtypes = [p.dtype for p in params]
        self._device = params[0].device if params else torch.device("cpu")

    def is_owner(self, index: int) -> bool:
        """Whether ``index``'s owner is this rank."""
        return self.owners[index] == self.rank

    def gather(self, local: Sequence[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """This rank's owned tensors, as given (non-owners pass ``None``)."""
        if len(local) != len(self.owners):
            raise ValueError(f"gather got {len(local)} tensors for {len(self.owners)} params")
        full = {}
        for i, tensor in enumerate(local):
            if self.is_owner(i):
                if tensor is None:
                    raise ValueError(f"rank {self.rank} owns param {i} but passed None to gather")
                full[i] = tensor
        return full

    def publish(self, results: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every result on every rank: each owner broadcasts its results (one flat buffer per dtype)."""
        owned = {i for i in range(len(self.owners)) if self.is_owner(i)}
        if set(results) != owned:
            raise ValueError(
                f"rank {self.rank} must publish exactly the params it owns {sorted(owned)}, got {sorted(results)}"
            )
        for i, result in results.items():
            if result.shape != self._shapes[i] or result.dtype != self._dtypes[i]:
                raise ValueError(
                    f"the result of param {i} is {tuple(result.shape)} {result.dtype}; it must have its "
                    f"param's shape {tuple(self._shapes[i])} and dtype {self._dtypes[i]}"
                )
        buckets: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, owner in enumerate(self.owners):
            buckets.setdefault((owner, self._dtypes[i]), []).append(i)
        out: list[torch.Tensor | None] = [results.get(i) for i in range(len(self.owners))]
        pending = []
        for (owner, dtype), indices in buckets.items():
            if owner == self.rank:
                flat = torch.cat([results[i].reshape(-1) for i in indices])
            else:
                numel = sum(self._shapes[i].numel() for i in indices)
                flat = torch.empty(numel, dtype=dtype, device=self._device)
            pending.append(
                (dist.broadcast(flat, group=self.group, group_src=owner, async_op=True), flat, owner, indices)
            )
        for work, flat, owner, indices in pending:
            work.wait()
            if owner != self.rank:
                for i, part in zip(
                    indices, flat.split([self._shapes[i].numel() for i in indices]), strict=True
                ):
                    out[i] = part.view(self._shapes[i])
        return out  # type: ignore[return-value]

"""Muon under megatron-core tensor parallelism: each matrix is gathered whole from its TP shards onto one owner rank,
orthogonalised there and scattered back; megatron's fused matrices are split into the matrices they stand for.

::

    TP rank 0: W[0]   ──┐                                     ┌──> TP rank 0: O[0]
    TP rank 1: W[1]   ──┼─ all_to_all ─> owner: W = [W[0]; W[1]]  ─ Newton-Schulz ─ O ─ all_to_all ─┼──> TP rank 1: O[1]

Every data-parallel replica does the same on its own copy (the state stays per rank, shaped like each parameter,
so megatron's dist-checkpointing saves it like Adam's). Parameters that are whole on every TP rank (norms aside:
a router, a replicated down projection) get an owner too, which computes for the group and sends the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from forge_lightning.optim.muon_exchange import assign_owners


def partition_dim(param: Tensor, group_size: int) -> int | None:
    """The dimension megatron split ``param`` along over a TP group of ``group_size`` ranks (``None``: whole on every
    rank), from megatron's ``tensor_model_parallel`` / ``partition_dim`` marks.

    A ``partition_stride`` above 1 (a gated fc1: each rank holds its gate rows, then its up rows) needs no care here:
    the shards are concatenated in rank order either way, and Newton-Schulz commutes with permuting rows or columns
    (``NS(P A) = P NS(A)``); only a split into parts must know the order (:class:`GatedSplit`).
    """
    if group_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    return param.partition_dim % param.ndim


class FusedQKVSplit:
    """megatron's fused ``linear_qkv`` weight ``[G * (h + 2) * D, H]`` (per query group: its ``h`` query heads, its
    key, its value, each head ``D`` rows) as the query, key and value matrices ``[G * h * D, H]``, ``[G * D, H]``,
    ``[G * D, H]`` (heads in order: Hugging Face's ``q_proj`` / ``k_proj`` / ``v_proj``).

    The group count is read off the rows, so a TP shard (whole groups) splits as its full matrix does; leading
    dimensions (a stack of matrices) are kept.

    Args:
        heads_per_group: query heads per key/value group (``num_attention_heads / num_query_groups``).
        head_dim: rows per head (megatron's ``kv_channels``).
    """

    def __init__(self, heads_per_group: int, head_dim: int) -> None:
        if heads_per_group < 1 or head_dim < 1:
            raise ValueError(
                f"heads_per_group ({heads_per_group}) and head_dim ({head_dim}) must be positive"
            )
        self.sizes = (heads_per_group * head_dim, head_dim, head_dim)

    def parts(self, full: Tensor) -> list[Tensor]:
        """``[q, k, v]`` of a fused ``[..., G * (h + 2) * D, H]`` matrix."""
        per_group = sum(self.sizes)
        rows = full.shape[-2]
        if rows % per_group:
            raise ValueError(
                f"a fused QKV matrix of {rows} rows is not whole query groups of {per_group} rows"
            )
        grouped = full.unflatten(-2, (rows // per_group, per_group))  # [..., G, (h + 2) * D, H]
        return [t.flatten(-3, -2) for t in grouped.split(self.sizes, dim=-2)]

    def join(self, parts: Sequence[Tensor]) -> Tensor:
        """The fused matrix of ``[q, k, v]`` (inverse of :meth:`parts`)."""
        q, k, v = parts
        groups = k.shape[-2] // self.sizes[1]
        grouped = [t.unflatten(-2, (groups, n)) for t, n in zip((q, k, v), self.sizes, strict=True)]
        return torch.cat(grouped, dim=-2).flatten(-3, -2)  # [..., G * (h + 2) * D, H]


class GatedSplit:
    """A gated MLP's ``linear_fc1`` weight gathered over ``blocks`` TP ranks, ``[g_0; u_0; g_1; u_1; ...]`` (each
    rank holds its rows of the gate, then its rows of the up projection), as the whole gate and the whole up
    matrices ``[I, H]`` each (Hugging Face's ``gate_proj`` / ``up_proj``). ``blocks`` = 1: the two halves.

    Args:
        blocks: the TP ranks fc1 was split over (the expert TP size for routed experts).
    """

    def __init__(self, blocks: int) -> None:
        if blocks < 1:
            raise ValueError(f"blocks ({blocks}) must be positive")
        self.blocks = blocks

    def parts(self, full: Tensor) -> list[Tensor]:
        """``[gate, up]`` of a gathered ``[..., 2 * I, H]`` fc1 matrix."""
        rows = full.shape[-2]
        if rows % (2 * self.blocks):
            raise ValueError(
                f"a gated fc1 matrix of {rows} rows does not split into {self.blocks} [gate; up] blocks"
            )
        blocks = full.unflatten(-2, (self.blocks, 2, rows // (2 * self.blocks)))  # [..., T, 2, I / T, H]
        return [blocks.select(-3, half).flatten(-3, -2) for half in (0, 1)]

    def join(self, parts: Sequence[Tensor]) -> Tensor:
        """The gathered fc1 matrix of ``[gate, up]`` (inverse of :meth:`parts`)."""
        gate, up = (t.unflatten(-2, (self.blocks, t.shape[-2] // self.blocks)) for t in parts)
        return torch.stack([gate, up], dim=-3).flatten(-4, -2)  # [..., 2 * I, H]


class TensorParallelExchange:
    """The :class:`~forge_lightning.optim.muon_exchange.MatrixExchange` of megatron's tensor parallelism.

    A TP-sharded parameter's owner receives every rank's shard and concatenates them along the parameter's
    ``partition_dim`` (the TP rank order is the shard order); its result goes back cut the same way. A parameter
    whole on every rank is computed by its owner only and sent whole. Owners balance the costs over the group.
    Each direction is one ``all_to_all``: every rank's tensors for one destination travel packed in one buffer, in
    the parameters' dtype (megatron's optimizer steps fp32 main parameters).

    Args:
        params: the parameters (this rank's shards), index ``i`` everywhere; one dtype.
        costs: each parameter's Newton-Schulz cost (the same on every rank of the group).
        group: the TP group (the expert TP group for routed experts); ``None``: the default group.
    """

    replicated = False

    def __init__(
        self, params: Sequence[Tensor], costs: Sequence[float], group: dist.ProcessGroup | None = None
    ) -> None:
        if len(params) != len(costs):
            raise ValueError(f"{len(params)} parameters but {len(costs)} costs: give one cost per parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"the parameters of one tensor-parallel exchange must share a dtype, got {sorted(map(str, dtypes))}"
            )
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.owners = assign_owners(costs, self.size)
        self._dims = [partition_dim(p, self.size) for p in params]
        self._shapes = [tuple(p.shape) for p in params]
        self._dtype = dtypes.pop() if dtypes else torch.float32
        self._device = params[0].device if params else torch.device("cpu")

    def is_owner(self, index: int) -> bool:
        """Whether this rank orthogonalises parameter ``index``."""
        return self.owners[index] == self.rank

    def gather(self, local: Sequence[Tensor | None]) -> dict[int, Tensor]:
        """The full matrices of the parameters this rank owns, from every TP rank's shard ``local[i]``."""
        self._check(local)
        sharded = [i for i, d in enumerate(self._dims) if d is not None]
        mine = [i for i in sharded if self.is_owner(i)]
        sends = [[local[i] for i in sharded if self.owners[i] == dest] for dest in range(self.size)]
        recv = [[] if src == self.rank else mine for src in range(self.size)]
        received = self._all_to_all(sends, recv)
        full = {i: local[i] for i, d in enumerate(self._dims) if d is None and self.is_owner(i)}
        for k, i in enumerate(mine):
            shards = [local[i] if src == self.rank else received[src][k] for src in range(self.size)]
            full[i] = torch.cat(shards, dim=self._dims[i])
        return full

    def publish(self, results: Mapping[int, Tensor]) -> list[Tensor]:
        """Every parameter's result as this rank's part (its local shape, in the parameters' dtype), from the
        owners' full ``results``."""
        count = len(self.owners)
        owned = [i for i in range(count) if self.is_owner(i)]
        missing = [i for i in owned if i not in results]
        if missing:
            raise ValueError(f"publish lacks the results of parameters {missing}, which this rank owns")
        pieces = {i: self._cut(i, results[i].to(self._dtype)) for i in owned}
        sends = [[pieces[i][dest] for i in owned] for dest in range(self.size)]
        recv = [
            [] if src == self.rank else [i for i in range(count) if self.owners[i] == src]
            for src in range(self.size)
        ]
        received = self._all_to_all(sends, recv)
        out: list[Tensor] = [None] * count  # type: ignore[list-item]  # every index is filled below
        for i in owned:
            out[i] = pieces[i][self.rank]
        for src, indices in enumerate(recv):
            for k, i in enumerate(indices):
                out[i] = received[src][k]
        return out

    def _check(self, local: Sequence[Tensor | None]) -> None:
        if len(local) != len(self._shapes):
            raise ValueError(
                f"gather got {len(local)} tensors for an exchange of {len(self._shapes)} parameters"
            )
        for i, t in enumerate(local):
            if t is None or tuple(t.shape) != self._shapes[i]:
                got = None if t is None else tuple(t.shape)
                raise ValueError(
                    f"gather: tensor {i} has shape {got}; its parameter's local shape is {self._shapes[i]}"
                )

    def _cut(self, index: int, full: Tensor) -> list[Tensor]:
        """``full`` as the part of each rank of the group (the whole tensor for a parameter whole on every rank)."""
        dim = self._dims[index]
        if dim is None:
            return [full] * self.size
        return list(full.chunk(self.size, dim=dim))

    def _all_to_all(self, sends: list[list[Tensor]], recv: list[list[int]]) -> list[list[Tensor]]:
        """Send ``sends[dest]`` to every other rank; receive from each rank ``src`` the local-shaped tensors of the
        parameters ``recv[src]``, in order (nothing travels to or from this rank itself)."""
        if self.size == 1:
            return [[]]
        sends = [[] if dest == self.rank else ts for dest, ts in enumerate(sends)]
        flat_in = [t.reshape(-1).to(self._dtype) for ts in sends for t in ts]
        in_sizes = [sum(t.numel() for t in ts) for ts in sends]
        out_sizes = [sum(_numel(self._shapes[i]) for i in indices) for indices in recv]
        device = flat_in[0].device if flat_in else self._device
        out = torch.empty(sum(out_sizes), dtype=self._dtype, device=device)
        packed = torch.cat(flat_in) if flat_in else torch.empty(0, dtype=self._dtype, device=device)
        dist.all_to_all_single(out, packed, out_sizes, in_sizes, group=self.group)
        received = []
        for indices, chunk in zip(recv, out.split(out_sizes), strict=True):
            sizes = [_numel(self._shapes[i]) for i in indices]
            received.append(
                [t.view(self._shapes[i]) for i, t in zip(indices, chunk.split(sizes), strict=True)]
            )
        return received


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

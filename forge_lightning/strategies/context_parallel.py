"""Context parallelism for attention: each rank holds a slice of the sequence (Ulysses all-to-all).

With the sequence split over ``P`` ranks, attention needs every key for every query. Ulysses (Jacobs et al., 2023,
"DeepSpeed Ulysses") trades the split: an all-to-all turns ``[B, heads, S/P, D]`` slices of the sequence into
``[B, heads/P, S, D]`` slices of the heads, each rank attends over the whole sequence for its heads with the
ordinary kernel (causal, packed-document masks and grouped key/value heads unchanged), and a second all-to-all
turns the output back::

    q, k, v  [B, H, S/P, D] ──all-to-all──▶ [B, H/P, S, D] ── attention() ──▶ [B, H/P, S, D] ──all-to-all──▶ [B, H, S/P, D]

Each rank sends ``(P-1)/P`` of its q, k, v and output slices per layer (the same bytes whatever ``P``), so the
communication is constant per device as the context grows. Heads (query and key/value) must be divisible by
``P``. Rank ``r`` holds positions ``[r·S/P, (r+1)·S/P)``, or the chunks ``chunk_order`` names (a causal
load-balanced split).

Model code stays plain (no distributed imports under ``modules/``): a strategy that shards the sequence swaps the
attention blocks' kernel call for :func:`ulysses_attention` with its process group in a :class:`ContextParallel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """All-to-all that scatters ``scatter_dim`` and gathers ``gather_dim``; its gradient is the reverse."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def _all_to_all(x: Tensor, group: Any, scatter_dim: int, gather_dim: int) -> Tensor:
    world = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(world, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


@dataclass(frozen=True)
class ContextParallel:
    """The sequence split of one forward pass: the process group and, optionally, the order of the chunks.

    Args:
        group: ranks that share the sequence.
        chunk_order: the sequence split into ``len(chunk_order)`` equal chunks, listed in the order the ranks hold
            them (each rank the same number of consecutive entries). ``None``: rank ``r`` holds chunk ``r``.
            Example: ``(0, 3, 1, 2)`` is the causal load-balanced split of 2 ranks (rank 0 holds chunks 0 and 3).
    """

    group: Any
    chunk_order: Sequence[int] | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)


def to_head_parallel(x_BHSD: Tensor, cp: ContextParallel) -> Tensor:
    """``[B, H, S/P, D]`` (this rank's positions, all heads) -> ``[B, H/P, S, D]`` (all positions, its heads)."""
    if x_BHSD.shape[1] % cp.size:
        raise ValueError(
            f"Ulysses context parallelism needs the head count ({x_BHSD.shape[1]}) divisible by the context-parallel "
            f"size ({cp.size}); use a context-parallel size that divides the key/value heads"
        )
    full = _AllToAll.apply(x_BHSD, cp.group, 1, 2)
    return _reorder(full, cp.chunk_order, inverse=False)


def to_sequence_parallel(x_BHSD: Tensor, cp: ContextParallel) -> Tensor:
    """The inverse of :func:`to_head_parallel`: ``[B, H/P, S, D]`` -> ``[B, H, S/P, D]``."""
    return _AllToAll.apply(_reorder(x_BHSD, cp.chunk_order, inverse=True), cp.group, 2, 1)


def _reorder(x_BHSD: Tensor, order: Sequence[int] | None, *, inverse: bool) -> Tensor:
    """Put gathered chunks (rank order) into sequence order, or back (``inverse``)."""
    if order is None or list(order) == sorted(order):
        return x_BHSD
    chunks = x_BHSD.chunk(len(order), dim=2)
    if inverse:  # sequence order -> rank order
        return torch.cat([chunks[c] for c in order], dim=2)
    position = {c: rank for rank, c in enumerate(order)}
    return torch.cat([chunks[position[c]] for c in range(len(order))], dim=2)


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, cp: ContextParallel, **attention_kwargs: Any
) -> Tensor:
    """Attention over a sequence split across ``cp``'s ranks; ``[B, heads, S/P, D]`` in and out.

    Args:
        q: this rank's queries ``[B, H, S/P, D]``.
        k: this rank's keys ``[B, K, S/P, D]`` (``K`` divides ``H``; both divisible by the group size).
        v: this rank's values ``[B, K, S/P, D]``.
        cp: the group and chunk order.
        **attention_kwargs: passed to :func:`forge_lightning.modules.layers.attention.attention` on the full
            sequence (``causal``, ``documents`` built from the full sequence's ``document_ids``...).
    """
    from forge_lightning.modules.layers.attention import attention

    heads = [to_head_parallel(t, cp) for t in (q, k, v)]
    return to_sequence_parallel(attention(*heads, **attention_kwargs), cp)

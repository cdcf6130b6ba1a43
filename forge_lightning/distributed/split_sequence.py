"""A model's token sequence split over context-parallel ranks: the distributed twin of
:class:`~forge_lightning.modules.layers.sequence.WholeSequence`, set on a model by a strategy (through the module's
``enable_context_parallel``), so that model code stays free of process groups.

The sequence (length ``S``) is padded to a multiple of the chunks of ``cp.chunk_order`` (by default one per rank)
and each rank keeps its chunks; padded positions form a segment of their own, which no real token attends to. Self-
attention runs over the ranks as ``cp.comm_type`` says, always non-causal:

* ``a2a`` (Ulysses): after the all-to-all each rank holds the whole sequence for its heads, so the mask is the plain
  document mask of the whole padded sequence (any attention backend).
* ``p2p`` (ring) and ``a2a+p2p`` (hybrid): the ring's blocks take no mask; segments are folded into the queries and
  keys instead, as extra channels: the query gets the one-hot of its segment, the key ``-BIG`` in every other
  segment's channel, so a pair in different segments scores ``q . k - BIG`` (weight exactly 0 after the softmax)
  and a pair in one segment scores ``q . k`` exactly (``1 x 0`` and ``0 x -BIG`` add nothing). The channels are
  rounded up to a multiple of 8 (FlashAttention's head sizes).

The output is gathered back with an all-gather whose gradient is the matching reduce-scatter: each rank's loss on
the gathered output counts, so the gradients of the ``P`` ranks of a group sum to ``P`` times one process's, which
the strategy's mean over the data-parallel x context-parallel ranks brings back to the data-parallel mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from forge_lightning.distributed.context_parallel import (
    ContextParallel,
    hybrid_attention,
    ring_attention,
    ulysses_attention,
)
from forge_lightning.modules.layers.attention import DocumentMask
from forge_lightning.modules.layers.sequence import WholeSequence

SEGMENT_BIAS = 3.0e4
"""``BIG`` of the ring's segment channels (see the module docstring): finite in fp16, and ``BIG / sqrt(head_dim)``
(the scaled score) is over 1,800 up to head size 256, far past where ``exp`` underflows to 0 in every dtype, as long
as the scaled ``|q . k|`` stays well below that (the Wan DiT's queries and keys are RMS-normalised)."""


class _GatherSequence(torch.autograd.Function):
    """All-gather of every rank's part along ``dim`` (in rank order); its gradient is the reduce-scatter (each
    part's gradient summed over the ranks), done as an all-to-all of the chunks and a sum (gloo has no
    reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        inputs = [t.contiguous() for t in grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)]
        outputs = [torch.empty_like(inputs[0]) for _ in inputs]
        dist.all_to_all(outputs, inputs, group=ctx.group)
        return torch.stack(outputs).sum(0), None, None


@dataclass(frozen=True)
class SegmentChannels:
    """The ring's mask of one forward, as extra query / key channels of this rank's positions ``[B, 1, s, E]``."""

    query: Tensor
    key: Tensor


class SplitSequence(WholeSequence):
    """The token sequence split over the ranks of ``cp`` (see the module docstring).

    Args:
        cp: the context-parallel group, chunk order and algorithm (``a2a``, ``p2p`` or ``a2a+p2p``).
    """

    def __init__(self, cp: ContextParallel) -> None:
        self.cp = cp
        self.rank = dist.get_rank(cp.group)
        self.chunks = len(cp.chunk_order) if cp.chunk_order is not None else cp.size

    def padded(self, length: int) -> int:
        """The sequence length after padding to a multiple of the chunks."""
        return math.ceil(length / self.chunks) * self.chunks

    def split(self, x: Tensor, dim: int, fill: float | bool = 0.0) -> Tensor:
        length = x.shape[dim]
        pad = self.padded(length) - length
        if pad:
            shape = list(x.shape)
            shape[dim] = pad
            x = torch.cat([x, x.new_full(shape, fill)], dim=dim)
        chunks = x.chunk(self.chunks, dim=dim)
        return torch.cat([chunks[c] for c in self.cp.chunks_of(self.rank)], dim=dim)

    def gather(self, x: Tensor, dim: int, length: int) -> Tensor:
        full = _GatherSequence.apply(x, self.cp.group, dim)  # chunks in rank order
        order = self.cp.chunk_order
        if order is not None and list(order) != sorted(order):
            chunks, position = full.chunk(self.chunks, dim=dim), {c: i for i, c in enumerate(order)}
            full = torch.cat([chunks[position[c]] for c in range(self.chunks)], dim=dim)
        return full.narrow(dim, 0, length)

    def mask(self, x_BSD: Tensor, segments_BS: Tensor | None, backend: str) -> Any:
        B, S = x_BSD.shape[:2]
        pad = self.padded(S) - S
        if segments_BS is None and pad == 0:
            return None
        if segments_BS is None:
            segments_BS = torch.zeros(B, S, dtype=torch.long, device=x_BSD.device)
        if pad:  # the padding: one more segment
            segments_BS = F.pad(segments_BS, (0, pad), value=int(segments_BS.max()) + 1)
        if self.cp.comm_type == "a2a":
            return DocumentMask.build(segments_BS, backend, causal=False, varying_shapes=True)
        count = int(segments_BS.max()) + 1
        onehot_BSE = F.one_hot(segments_BS, math.ceil(count / 8) * 8).to(x_BSD.dtype)
        local_B1sE = self.split(onehot_BSE, 1)[:, None]
        return SegmentChannels(local_B1sE, (local_B1sE - 1) * SEGMENT_BIAS)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Any) -> Tensor:
        if self.cp.comm_type == "a2a":
            return ulysses_attention(q, k, v, self.cp, causal=False, documents=mask)
        scale = q.shape[-1] ** -0.5
        if mask is not None:
            B, H, s, _ = q.shape
            E = mask.query.shape[-1]
            q = torch.cat([q, mask.query.to(q.dtype).expand(B, H, s, E)], dim=-1)
            k = torch.cat([k, mask.key.to(k.dtype).expand(B, k.shape[1], s, E)], dim=-1)
        attend = ring_attention if self.cp.comm_type == "p2p" else hybrid_attention
        return attend(q, k, v, self.cp, causal=False, scale=scale)

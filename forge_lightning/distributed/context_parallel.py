"""Context parallelism for attention: each rank holds a slice of the sequence (Ulysses, ring, or both).

With the sequence split over ``P`` ranks, attention needs every key for every query. Three ways to get there, named
as megatron-core's ``cp_comm_type``:

``a2a`` — Ulysses (Jacobs et al., 2023, "DeepSpeed Ulysses", :func:`ulysses_attention`). An all-to-all turns
``[B, heads, S/P, D]`` slices of the sequence into ``[B, heads/P, S, D]`` slices of the heads, each rank attends
over the whole sequence for its heads with the ordinary kernel (causal, packed-document masks and grouped key/value
heads unchanged), and a second all-to-all turns the output back::

    q, k, v  [B, H, S/P, D] ──all-to-all──▶ [B, H/P, S, D] ── attention() ──▶ [B, H/P, S, D] ──all-to-all──▶ [B, H, S/P, D]

Each rank sends ``(P-1)/P`` of its q, k, v and output slices per layer (the same bytes whatever ``P``), so the
communication is constant per device as the context grows. Heads (query and key/value) must be divisible by ``P``.

``p2p`` — ring attention (Liu et al., 2023, "Ring Attention with Blockwise Transformers", :func:`ring_attention`).
Queries stay put; key/value blocks travel around the ring (point-to-point send / receive, overlapped with the
block's compute). At step ``i`` a rank attends its queries to the block of rank ``r - i`` and merges the partial
output by its log-sum-exp (online softmax, in fp32); backward runs the ring again and passes each block's key/value
gradient along with it until it is home. No head constraint; ``P - 1`` key/value blocks pass through every rank::

    step 0: q_r · kv_r (causal)   step 1: q_r · kv_{r-1}   ...   step P-1: q_r · kv_{r+1}     out_r = merge(lse)

``a2a+p2p`` — both (:func:`hybrid_attention`): Ulysses inside groups of ``A`` ranks (fast links), ring across the
``P / A`` groups (megatron's ``hierarchical_context_parallel_sizes`` ``[A, P / A]``).

Rank ``r`` holds positions ``[r·S/P, (r+1)·S/P)``, or the chunks ``chunk_order`` names. With causal attention the
contiguous split leaves the ring unbalanced (rank 0 attends to one block, rank ``P - 1`` to ``P``); the
load-balanced split (rank ``r`` holds chunks ``r`` and ``2P - 1 - r`` of ``2P``) gives every rank the same work:
after its own block, half of each other block's pairs are visible, as one unmasked kernel call.

Model code stays plain (no distributed imports under ``modules/``): a strategy that shards the sequence swaps the
attention blocks' kernel call for one of these with its process groups in a :class:`ContextParallel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from forge_lightning.accelerators.capabilities import capabilities
from forge_lightning.contracts.megatron import CP_COMM_TYPES


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
    """The sequence split of one forward pass: the process groups, the order of the chunks, the algorithm.

    Args:
        group: ranks that share the sequence (all ``P`` of them).
        chunk_order: the sequence split into ``len(chunk_order)`` equal chunks, listed in the order the ranks hold
            them (each rank the same number of consecutive entries). ``None``: rank ``r`` holds chunk ``r``.
            Example: ``(0, 3, 1, 2)`` is the causal load-balanced split of 2 ranks (rank 0 holds chunks 0 and 3).
        comm_type: ``a2a`` (Ulysses), ``p2p`` (ring) or ``a2a+p2p`` (Ulysses inside ``a2a_group``, ring over
            ``p2p_group``); see :data:`CP_COMM_TYPES`.
        a2a_group: ``a2a+p2p`` only: this rank's Ulysses group of ``A`` ranks.
        p2p_group: ``a2a+p2p`` only: this rank's ring of ``P / A`` ranks. Rank ``r`` of ``group`` must be rank
            ``r % A`` of its ``a2a_group`` and rank ``r // A`` of its ``p2p_group`` (megatron-core's
            ``hierarchical_context_parallel_sizes`` layout).
    """

    group: Any
    chunk_order: Sequence[int] | None = None
    comm_type: str = "a2a"
    a2a_group: Any = None
    p2p_group: Any = None

    def __post_init__(self) -> None:
        if self.comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type ({self.comm_type!r}) must be one of {', '.join(CP_COMM_TYPES)}")
        if self.chunk_order is not None and sorted(self.chunk_order) != list(range(len(self.chunk_order))):
            raise ValueError(f"chunk_order ({tuple(self.chunk_order)}) must list each chunk 0..n-1 once")
        if self.comm_type != "a2a+p2p":
            return
        if self.a2a_group is None or self.p2p_group is None:
            raise ValueError("cp_comm_type 'a2a+p2p' needs both an a2a_group and a p2p_group")
        a2a = dist.get_world_size(self.a2a_group)
        rank, inner, outer = (dist.get_rank(g) for g in (self.group, self.a2a_group, self.p2p_group))
        if a2a * dist.get_world_size(self.p2p_group) != self.size or rank != outer * a2a + inner:
            raise ValueError(
                f"a2a+p2p groups do not tile the context-parallel group: rank {rank} of {self.size} is rank "
                f"{inner} of {a2a} (a2a) and {outer} of {dist.get_world_size(self.p2p_group)} (p2p); expected "
                "megatron's hierarchical layout (rank = p2p rank x a2a size + a2a rank)"
            )

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def chunks_of(self, rank: int) -> list[int]:
        """The chunks ``rank`` (of ``group``) holds, in its local order."""
        order = list(range(self.size)) if self.chunk_order is None else list(self.chunk_order)
        if len(order) % self.size:
            raise ValueError(f"chunk_order has {len(order)} chunks, not a multiple of the {self.size} ranks")
        per = len(order) // self.size
        return order[rank * per : (rank + 1) * per]


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


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, cp: ContextParallel, *, causal: bool = True, scale: float | None = None
) -> Tensor:
    """Ring attention over a sequence split across ``cp.group``; ``[B, heads, S/P, D]`` in and out.

    Key/value blocks travel around the ring (see the module docstring); every rank's queries meet every block once,
    with the causal sub-mask of the chunk pair (whole, diagonal-causal or skipped). Blocks run on FlashAttention's
    op on CUDA (fp16 / bf16, head size a multiple of 8 up to 256, see :class:`_FlashBlock`),
    on plain fp32 matmuls otherwise (CPU, fp32, other head sizes). No dropout, no packed-document masks.

    Args:
        q: this rank's queries ``[B, H, S/P, D]`` (its chunks of ``cp.chunk_order``, in that order).
        k: this rank's keys ``[B, K, S/P, D]``; ``K`` divides ``H`` (grouped-query attention, no copies).
        v: this rank's values ``[B, K, S/P, Dv]`` (``Dv`` may differ from ``D``, e.g. multi-latent attention).
        cp: the ring (``cp.group``) and the chunk order; ``cp.comm_type`` is not read.
        causal: causal attention over the global positions.
        scale: score scale (default ``1 / sqrt(D)``).
    """
    world, rank = cp.size, dist.get_rank(cp.group)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"key/value heads ({k.shape[1]}) must divide the query heads ({q.shape[1]})")
    held = [cp.chunks_of(r) for r in range(world)]
    per = len(held[rank])
    if q.shape[2] % per:
        raise ValueError(f"the local sequence ({q.shape[2]}) must split into this rank's {per} chunks")
    # Each rank works on its chunks in sequence order, so its own block is plain causal attention.
    perm = sorted(range(per), key=held[rank].__getitem__)
    q, k, v = (_permute_chunks(t, perm) for t in (q, k, v))
    plans = _ring_plans([sorted(c) for c in held], rank, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = _RingAttention.apply(q, k, v, cp.group, plans, scale, per)
    return _permute_chunks(out, sorted(range(per), key=perm.__getitem__))


def hybrid_attention(
    q: Tensor, k: Tensor, v: Tensor, cp: ContextParallel, *, causal: bool = True, scale: float | None = None
) -> Tensor:
    """``a2a+p2p``: Ulysses inside ``cp.a2a_group``, ring attention across ``cp.p2p_group``; ``[B, heads, S/P, D]``.

    The all-to-all gives each rank ``1/A`` of the heads over its Ulysses group's chunks; those groups then run
    :func:`ring_attention` with each other, and a second all-to-all returns the output to the sequence split.
    Query heads must be divisible by ``A``; key/value heads that are not are repeated to the query heads first.

    Args:
        q: this rank's queries ``[B, H, S/P, D]``.
        k: this rank's keys ``[B, K, S/P, D]``.
        v: this rank's values ``[B, K, S/P, Dv]``.
        cp: the full context-parallel group, its chunk order and the ``a2a`` / ``p2p`` sub-groups.
        causal: causal attention over the global positions.
        scale: score scale (default ``1 / sqrt(D)``).
    """
    a2a = dist.get_world_size(cp.a2a_group)
    if q.shape[1] % a2a:
        raise ValueError(
            f"a2a+p2p context parallelism needs the query heads ({q.shape[1]}) divisible by the a2a size ({a2a})"
        )
    if k.shape[1] % a2a:  # grouped key/value heads that do not split: one per query head
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    # [B, heads, s, D] -> [B, heads/A, A*s, D]: the group's chunks in a2a-rank order.
    q, k, v = (_AllToAll.apply(t, cp.a2a_group, 1, 2) for t in (q, k, v))
    rings = dist.get_world_size(cp.p2p_group)
    ring_order = [c for j in range(rings) for i in range(a2a) for c in cp.chunks_of(j * a2a + i)]
    ring = ContextParallel(cp.p2p_group, ring_order, comm_type="p2p")
    out = ring_attention(q, k, v, ring, causal=causal, scale=scale)
    return _AllToAll.apply(out, cp.a2a_group, 2, 1)


def _permute_chunks(x_BHSD: Tensor, perm: Sequence[int]) -> Tensor:
    """The sequence dim's ``len(perm)`` chunks taken in the order ``perm``."""
    if list(perm) == sorted(perm):
        return x_BHSD
    chunks = x_BHSD.chunk(len(perm), dim=2)
    return torch.cat([chunks[i] for i in perm], dim=2)


Plan = list[tuple[int, int, int, bool]]
"""One ring step's kernel calls, in chunks: ``(first query chunk, end query chunk, key/value chunks, causal)``; each
call attends local query chunks ``[first, end)`` to the step's first ``n`` key/value chunks."""


def _ring_plans(held: list[list[int]], rank: int, causal: bool) -> list[Plan]:
    """The kernel calls of each ring step of ``rank``; ``held[r]``: the chunks rank ``r`` holds, sorted.

    Step ``i`` sees the block of rank ``r - i``. The own block (step 0) is causal over the local chunks (sorted, so
    local order is sequence order). Another rank's chunks are disjoint from ours: query chunk ``c`` sees all of its
    chunks below ``c`` and none above, a prefix of the sorted block growing with ``c``; query chunks that see the
    same prefix form one unmasked call (with the load-balanced split one call per step).
    """
    per, world = len(held[rank]), len(held)
    plans: list[Plan] = [[(0, per, per, causal)]]
    for step in range(1, world):
        theirs = held[(rank - step) % world]
        if not causal:
            plans.append([(0, per, per, False)])
            continue
        visible = [sum(c < mine for c in theirs) for mine in held[rank]]  # non-decreasing
        plan = []
        for n in sorted(set(visible) - {0}):
            rows = [i for i, m in enumerate(visible) if m == n]
            plan.append((rows[0], rows[-1] + 1, n, False))
        plans.append(plan)
    return plans


class _RingExchange:
    """One ring step's transfer: ``tensors`` (flattened into one buffer) to the next rank, the previous rank's in."""

    def __init__(self, tensors: Sequence[Tensor], group: Any, tag: int) -> None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.shapes = [t.shape for t in tensors]
        self.sent = torch.cat([t.reshape(-1) for t in tensors])  # kept alive until the send completes
        self.received = torch.empty_like(self.sent)
        to, of = (dist.get_global_rank(group, (rank + d) % world) for d in (1, -1))
        self.works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, self.sent, to, group, tag),
                dist.P2POp(dist.irecv, self.received, of, group, tag),
            ]
        )

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        sizes = [s.numel() for s in self.shapes]
        return [t.view(s) for t, s in zip(self.received.split(sizes), self.shapes)]


class _RingAttention(torch.autograd.Function):
    """Forward and backward rings over ``group`` with the block kernel of the inputs (see :func:`ring_attention`).

    Forward: the key/value block of step ``i + 1`` is in flight while step ``i`` computes; partial outputs merge
    into an fp32 accumulator by their log-sum-exp. Backward: the same ring of key/value blocks, each block's fp32
    gradient accumulator following it one step behind (it is sent on while the next step computes) and arriving home
    after ``P`` hops; every block recomputes its probabilities from the saved final log-sum-exp.
    """

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: Any, plans: list[Plan], scale: float, per: int
    ) -> Tensor:
        kernel = _FlashBlock if _FlashBlock.usable(q, k, v) else _MathBlock
        B, H, S, _ = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(B, H, S, v.shape[-1], dtype=acc)
        lse = q.new_full((B, H, S), float("-inf"), dtype=acc)
        chunk, kv = S // per, [k.contiguous(), v.contiguous()]
        for step, plan in enumerate(plans):
            pending = _RingExchange(kv, group, tag=0) if step < len(plans) - 1 else None
            for first, end, n, causal in plan:
                rows = slice(first * chunk, end * chunk)
                block_out, block_lse = kernel.forward(
                    q[:, :, rows], kv[0][:, :, : n * chunk], kv[1][:, :, : n * chunk], causal, scale
                )
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plans, ctx.scale, ctx.per, ctx.kernel = group, plans, scale, per, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        kernel, plans, chunk = ctx.kernel, ctx.plans, q.shape[2] // ctx.per
        acc = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        delta = kernel.prepare(dout, out)
        dq = torch.zeros_like(q, dtype=acc)
        kv, grads = [k.contiguous(), v.contiguous()], None
        for step, plan in enumerate(plans):
            pending = _RingExchange(kv, ctx.group, tag=0) if step < len(plans) - 1 else None
            dk, dv = torch.zeros_like(kv[0], dtype=acc), torch.zeros_like(kv[1], dtype=acc)
            for first, end, n, causal in plan:
                rows, cols = slice(first * chunk, end * chunk), slice(0, n * chunk)
                block = kernel.backward(
                    dout[:, :, rows],
                    q[:, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    out[:, :, rows],
                    lse[:, :, rows],
                    None if delta is None else delta[:, :, rows],
                    causal,
                    ctx.scale,
                )
                dq[:, :, rows] += block[0]
                dk[:, :, cols] += block[1]
                dv[:, :, cols] += block[2]
            if grads is not None:  # this block's gradient so far, from the previous rank
                held_dk, held_dv = grads.wait()
                dk, dv = dk + held_dk, dv + held_dv
            grads = _RingExchange([dk, dv], ctx.group, tag=1) if len(plans) > 1 else None
            if pending is not None:
                kv = pending.wait()
        dk, dv = grads.wait() if grads is not None else (dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold a block's softmax-normalised output and log-sum-exp into the running ones (in place, fp32)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new)[..., None]).add_(
        block_out.to(out.dtype) * torch.exp(block_lse - new)[..., None]
    )
    lse.copy_(new)


class _MathBlock:
    """One block of attention (and its gradient) from plain matmuls in fp32 (fp64 stays fp64): CPU, fp32, odd sizes.

    Grouped key/value heads are broadcast, not copied: queries are viewed ``[B, K, H/K, S, D]``.
    """

    @staticmethod
    def _probabilities(q: Tensor, k: Tensor, lse: Tensor | None, causal: bool, scale: float) -> Tensor:
        """Scores ``[B, K, H/K, Sq, Sk]``, or with ``lse`` the probabilities they give."""
        B, H, Sq, D = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        q5 = q.to(acc).reshape(B, k.shape[1], H // k.shape[1], Sq, D)
        scores = q5 @ k.to(acc)[:, :, None].transpose(-1, -2) * scale
        if causal:  # the own block: square, sequence order
            future = torch.ones(Sq, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if lse is None:
            return scores
        return torch.exp(scores - lse.reshape(*q5.shape[:-1])[..., None])

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        B, H, Sq, _ = q.shape
        scores = _MathBlock._probabilities(q, k, None, causal, scale)
        lse = scores.logsumexp(-1)
        out = torch.exp(scores - lse[..., None]) @ v.to(scores.dtype)[:, :, None]
        return out.reshape(B, H, Sq, -1), lse.reshape(B, H, Sq)

    @staticmethod
    def prepare(dout: Tensor, out: Tensor) -> Tensor:
        """``rowsum(dout * out)`` ``[B, H, S]`` of the final output: the softmax gradient's correction."""
        acc = torch.promote_types(out.dtype, torch.float32)
        return (dout.to(acc) * out.to(acc)).sum(-1)

    @staticmethod
    def backward(
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        delta: Tensor | None,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        B, H, Sq, D = q.shape
        p = _MathBlock._probabilities(q, k, lse, causal, scale)  # [B, K, H/K, Sq, Sk]
        do = dout.to(p.dtype).reshape(*p.shape[:-1], -1)
        dv = (p.transpose(-1, -2) @ do).sum(2)
        dp = do @ v.to(p.dtype)[:, :, None].transpose(-1, -2)
        ds = p * (dp - delta.reshape(*p.shape[:-1])[..., None]) * scale
        dq = ds @ k.to(p.dtype)[:, :, None]
        dk = (ds.transpose(-1, -2) @ q.to(p.dtype).reshape(*p.shape[:-1], D)).sum(2)
        return dq.reshape(B, H, Sq, D), dk, dv


class _FlashBlock:
    """One block on FlashAttention's ATen ops (``_scaled_dot_product_flash_attention`` and its backward), which
    return the log-sum-exp the merge needs. CUDA only, fp16 / bf16.

    The default (CPU) tests check the ops' signatures and shapes on the meta device; the ``gpu``-marked test in
    ``tests/test_context_parallel.py`` runs these blocks in a simulated ring against SDPA on CUDA. Key/value heads
    are expanded to the query heads (the op's backward is only used with equal heads here), and values narrower
    than queries (multi-latent attention) are zero-padded to the query head size.
    """

    @staticmethod
    def usable(q: Tensor, k: Tensor, v: Tensor) -> bool:
        D, Dv = q.shape[-1], v.shape[-1]
        return (
            capabilities(q.device).flash_attention
            and q.dtype in (torch.float16, torch.bfloat16)
            and D % 8 == 0
            and D <= 256
            and Dv <= D
        )

    @staticmethod
    def _expand(x: Tensor, heads: int, dim: int) -> Tensor:
        x = x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x
        return torch.nn.functional.pad(x, (0, dim - x.shape[-1])) if x.shape[-1] != dim else x

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        H, D = q.shape[1], q.shape[-1]
        k, v_full = _FlashBlock._expand(k, H, D), _FlashBlock._expand(v, H, D)
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v_full, 0.0, causal, False, scale=scale
        )
        return out[..., : v.shape[-1]], lse

    @staticmethod
    def prepare(dout: Tensor, out: Tensor) -> None:
        return None  # the op computes rowsum(dout * out) itself

    @staticmethod
    def backward(
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        delta: Tensor | None,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        B, H, Sq, D = q.shape
        K, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
        k_full, v_full = _FlashBlock._expand(k, H, D), _FlashBlock._expand(v, H, D)
        dout, out = (_FlashBlock._expand(t, H, D) for t in (dout, out))
        # Dense inputs: no cumulative sequence lengths; dropout 0: the RNG state is not read.
        rng = (
            torch.empty(2, dtype=torch.uint64, device=q.device),
            torch.empty((), dtype=torch.uint64, device=q.device),
        )
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k_full, v_full, out, lse.contiguous(), None, None, Sq, Sk, 0.0, causal, *rng, scale=scale
        )
        dk, dv = dk.reshape(B, K, H // K, Sk, D).sum(2), dv.reshape(B, K, H // K, Sk, D).sum(2)
        return dq, dk, dv[..., :Dv]

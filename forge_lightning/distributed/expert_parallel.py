"""Expert parallelism: each rank of an expert-parallel group holds ``E / ep`` routed experts; tokens travel to the
ranks of their experts and back by ``all_to_all_single``.

One MoE layer on one rank (T local tokens, K experts per token, D hidden size)::

    x [T,D], indices [T,K]
      ── sort the T*K assignments by expert (experts are contiguous per rank, so also by destination rank)
      ── exchange the per-expert counts (one all-to-all of [ep, E/ep] integers: the split sizes)
      ── dispatch: all_to_all_single of the sorted rows ── rows of every rank routed to this rank's experts
      ── group them by local expert, grouped SwiGLU, ungroup
      ── combine: all_to_all_single back ── unsort, weighted sum over each token's K outputs ── out [T,D]

With ``overlap`` the tokens are split into two halves whose collectives run asynchronously
(``async_op=True``), so communication hides behind compute::

    dispatch A ─┐ dispatch B ─┐            combine A ─┐              combine B ─┐
                shared experts (all T) ─ wait A ─ experts(A) ─ wait B ─ experts(B) ─ wait A, B ─ out

Backward mirrors it: each collective's gradient is the reverse all-to-all, started where the forward waited and
waited for where the forward started. Routing weights never travel: the weighted sum runs on the token's own rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# local_experts(rows [N, D] grouped by local expert, rows per local expert [E_local]) -> [N, D]
LocalExperts = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ExpertParallel:
    """An expert-parallel group: its ranks split the routed experts of every MoE layer into equal contiguous ranges.

    Args:
        group: the process group of the ranks that exchange tokens (rank ``r`` holds experts
            ``[r * E / ep, (r + 1) * E / ep)``).
        overlap: split each micro-batch's tokens into two halves and overlap one half's dispatch / combine with the
            other half's expert compute and with the shared experts (asynchronous all-to-alls).
        mesh: the group as a one-dimensional ``DeviceMesh``, or ``None``. With it the held stacks are DTensors
            sharded on their expert dimension (their global shape is the full stack's), so state dicts and
            distributed checkpoints see every expert once, under its usual name; without it they are plain
            tensors of this rank's experts.
    """

    group: Any
    overlap: bool = True
    mesh: Any = None

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return dist.get_rank(self.group)

    def local_experts(self, num_experts: int) -> range:
        """The experts this rank holds.

        Raises:
            ValueError: ``num_experts`` not divisible by the group size.
        """
        if num_experts % self.size:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by the expert-parallel size ({self.size}): each "
                "expert-parallel rank holds an equal share of the experts"
            )
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def shard(self, full: Tensor) -> Tensor:
        """This rank's experts of a full stack ``[E, ...]``: a copy of its rows, as a DTensor with ``mesh``."""
        local = self.local_experts(full.shape[0])
        part = full[local.start : local.stop].detach().clone()
        if self.mesh is None:
            return part
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(part, self.mesh, [Shard(0)], run_check=False)

    @staticmethod
    def local(held: Tensor) -> Tensor:
        """The local rows of a stack :meth:`shard` made (differentiable)."""
        to_local = getattr(held, "to_local", None)
        return held if to_local is None else to_local()


@dataclass
class _Exchange:
    """One all-to-all of rows in flight, and its reverse in backward."""

    group: Any
    send: list[int]
    recv: list[int]
    work: Any = None
    grad_work: Any = None
    grad_in: Tensor | None = field(default=None, repr=False)


def _launch(out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Any:
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


class _Start(torch.autograd.Function):
    """Start sending rows ``[N, D]`` (forward); in backward, wait for their gradients' return trip."""

    @staticmethod
    def forward(ctx: Any, x_ND: Tensor, ex: _Exchange) -> Tensor:
        ctx.ex = ex
        out = x_ND.new_empty(sum(ex.recv), x_ND.shape[1])
        ex.work = _launch(out, x_ND.contiguous(), ex.recv, ex.send, ex.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None]:
        ex = ctx.ex
        ex.grad_work.wait()
        grad_in, ex.grad_in = ex.grad_in, None
        return grad_in, None


class _Wait(torch.autograd.Function):
    """Wait for the rows ``_Start`` sent (forward); in backward, start sending their gradients back."""

    @staticmethod
    def forward(ctx: Any, y_ND: Tensor, ex: _Exchange) -> Tensor:
        ctx.ex = ex
        ex.work.wait()
        ex.work = None
        return y_ND.view_as(y_ND)

    @staticmethod
    def backward(ctx: Any, grad_ND: Tensor) -> tuple[Tensor, None]:
        ex = ctx.ex
        ex.grad_in = grad_ND.new_empty(sum(ex.send), grad_ND.shape[1])
        ex.grad_work = _launch(ex.grad_in, grad_ND.contiguous(), ex.send, ex.recv, ex.group)
        # _Start.backward ignores this and returns the exchanged gradient instead.
        return grad_ND, None


def _exchange_counts(counts_HE: Tensor, ep: ExpertParallel) -> Tensor:
    """Every rank's per-expert counts for this rank's experts: ``[H, E]`` sent -> ``[ep, H, E_local]`` received."""
    H, E = counts_HE.shape
    send_PHL = counts_HE.view(H, ep.size, E // ep.size).transpose(0, 1).contiguous()
    recv_PHL = torch.empty_like(send_PHL)
    dist.all_to_all_single(recv_PHL, send_PHL, group=ep.group)
    return recv_PHL


def _run_local(rows_ND: Tensor, recv_PL: Tensor, local_experts: LocalExperts) -> Tensor:
    """Rows received from every rank (rank-major, then local-expert-major) through the local experts, in the same
    order."""
    P, L = recv_PL.shape
    expert_N = torch.arange(L, device=rows_ND.device).repeat(P).repeat_interleave(recv_PL.flatten())
    order_N = expert_N.argsort(stable=True)
    y_ND = local_experts(rows_ND[order_N], recv_PL.sum(dim=0))
    return torch.empty_like(y_ND).index_copy_(0, order_N, y_ND)


def expert_parallel_mix(
    x_TD: Tensor,
    indices_TK: Tensor,
    weights_TK: Tensor,
    ep: ExpertParallel,
    num_experts: int,
    local_experts: LocalExperts,
    shared: Callable[[Tensor], Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """``sum_k weights[t, k] * expert[indices[t, k]](x[t])`` with the experts spread over the ranks of ``ep``.

    Collective over ``ep.group``: every rank calls it once per MoE layer forward, with its own tokens.

    Args:
        x_TD: ``[T, D]`` this rank's tokens.
        indices_TK: ``[T, K]`` experts of each token (global expert ids).
        weights_TK: ``[T, K]`` weights of their outputs.
        ep: the expert-parallel group.
        num_experts: routed experts over all ranks.
        local_experts: this rank's experts on rows grouped by local expert (see :data:`LocalExperts`).
        shared: always-active experts ``shared(x_TD) -> [T, D]`` (or ``None``), computed while the dispatch is in
            flight and added to the output.

    Returns:
        ``[T, D]`` and the assignments per expert of this rank's tokens ``[E]``.
    """
    T, K = indices_TK.shape
    halves = 2 if ep.overlap and T >= 2 else 1
    bounds = [(h * T // halves, (h + 1) * T // halves) for h in range(halves)]
    orders, counts = [], []
    for lo, hi in bounds:
        experts_N = indices_TK[lo:hi].flatten()  # token-major assignments of this half
        orders.append(experts_N.argsort(stable=True))
        counts.append(torch.bincount(experts_N, minlength=num_experts))
    counts_HE = torch.stack(counts)
    recv_PHL = _exchange_counts(counts_HE, ep)
    send_HP = counts_HE.view(halves, ep.size, -1).sum(dim=-1).tolist()
    recv_HP = recv_PHL.sum(dim=-1).transpose(0, 1).tolist()

    dispatched = []
    for h, (lo, hi) in enumerate(bounds):
        ex = _Exchange(ep.group, send=send_HP[h], recv=recv_HP[h])
        dispatched.append((_Start.apply(x_TD[lo:hi][orders[h] // K], ex), ex))
    shared_TD = shared(x_TD) if shared is not None else None
    combined = []
    for h, (rows_ND, ex) in enumerate(dispatched):
        y_ND = _run_local(_Wait.apply(rows_ND, ex), recv_PHL[:, h], local_experts)
        back = _Exchange(ep.group, send=ex.recv, recv=ex.send)
        combined.append((_Start.apply(y_ND, back), back))
    outs = []
    for h, ((y_ND, back), (lo, hi)) in enumerate(zip(combined, bounds, strict=True)):
        y_ND = _Wait.apply(y_ND, back)
        y_TKD = y_ND.new_empty(y_ND.shape).index_copy_(0, orders[h], y_ND).view(hi - lo, K, -1)
        outs.append((y_TKD * weights_TK[lo:hi, :, None].to(y_TKD.dtype)).sum(dim=1))
    out_TD = torch.cat(outs) if halves > 1 else outs[0]
    if shared_TD is not None:
        out_TD = out_TD + shared_TD
    return out_TD, counts_HE.sum(dim=0)

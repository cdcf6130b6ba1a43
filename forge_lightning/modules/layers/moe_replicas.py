"""Training with replicated experts: the token split, the gradient sum and the re-plan, in one process.

This is the single-process reference of what expert-parallel dispatch does with a
:class:`~forge_lightning.distributed.expert_placement.Placement`::

    assignments of expert e (token-major order) ── split by index ──▶ primary: the first share_0 of them
                                                                     replica 1: the next share_1, ...
    backward: every holder's gradient of e ── summed (an all-reduce over e's holders under EP) ──▶ each holder
    optimizer: each holder steps on the same gradient with the same state, so all stay equal to the primary
    re-plan: a slot that takes a new expert copies its weights and its optimizer state from the primary

Replicas live in a fixed stack of spare slots (``spare_gate_up_proj`` / ``spare_down_proj``, rank ``r``'s spare
slots at ``r * spare_per_rank ...``), so the optimizer's parameters never change shape; an empty slot holds zeros
and gets no gradient. Training is that of no replication up to the order of floating-point sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.distributed.expert_placement import Placement
from forge_lightning.modules.layers.moe import Experts, grouped_linear


def split_by_index(experts_N: Tensor, holders: Tensor, bounds: Tensor) -> Tensor:
    """Which holder of its expert each assignment goes to: the ``n``-th assignment of expert ``e`` (in the given
    order) goes to holder ``j`` when ``bounds[e, j] <= n / count_e < bounds[e, j + 1]``.

    Args:
        experts_N: ``[N]`` expert of each assignment (token-major: reproducible for the same batch).
        holders: ``[E, H]`` slot of each holder (``-1`` past an expert's last holder).
        bounds: ``[E, H + 1]`` cumulative shares (``bounds[:, 0] = 0``, ``bounds[:, -1] = 1``).

    Returns:
        ``[N]`` slot of each assignment.
    """
    order_N = experts_N.argsort(stable=True)
    counts_E = torch.bincount(experts_N, minlength=holders.shape[0])
    starts_E = counts_E.cumsum(0) - counts_E
    rank_N = torch.empty_like(order_N)
    rank_N[order_N] = torch.arange(experts_N.numel(), device=experts_N.device) - starts_E[experts_N[order_N]]
    # Holder j takes the assignments below floor(bounds[j+1] * count): integer cut points, exact for any count.
    cuts_NH = torch.floor(bounds[experts_N, 1:] * counts_E[experts_N, None]).long()
    j_N = (rank_N[:, None] >= cuts_NH).sum(dim=1).clamp(max=holders.shape[1] - 1)
    return holders[experts_N, j_N]


class ReplicatedExperts(nn.Module):
    """A drop-in for :class:`~forge_lightning.modules.layers.moe.Experts` whose hot experts have replicas.

    The primaries are the wrapped module's own parameters (same names, ``gate_up_proj`` / ``down_proj``); the
    replicas are spare slots. After ``loss.backward()`` call :meth:`sum_replica_grads`; re-plan with
    :meth:`set_placement` (passing the optimizer, whose state it copies into new replicas).

    Args:
        experts: the layer's experts (their parameters are shared, not copied).
        placement: where the replicas go (its ``slots_per_rank`` fixes the number of spare slots).
    """

    def __init__(self, experts: Experts, placement: Placement) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.spare_per_rank = placement.slots_per_rank - self.num_experts // placement.ep_size
        num_spare = self.spare_per_rank * placement.ep_size
        self.spare_gate_up_proj = nn.Parameter(
            self.gate_up_proj.new_zeros(num_spare, *self.gate_up_proj.shape[1:])
        )
        self.spare_down_proj = nn.Parameter(self.down_proj.new_zeros(num_spare, *self.down_proj.shape[1:]))
        self.register_buffer("slot_expert", torch.full((num_spare,), -1, dtype=torch.long), persistent=False)
        self.placement: Placement | None = None
        self.set_placement(placement)

    def _layout(self, placement: Placement) -> tuple[Tensor, Tensor, Tensor]:
        """``(slot_expert [S], holders [E, H], bounds [E, H + 1])``: slots ``E + s`` are the spare ones."""
        if placement.num_experts != self.num_experts:
            raise ValueError(
                f"placement has {placement.num_experts} experts; the layer has {self.num_experts}"
            )
        slot_expert = torch.full_like(self.slot_expert, -1)
        used = [0] * placement.ep_size
        width = max(len(h) for h in placement.holders)
        holders = torch.full((self.num_experts, width), -1, dtype=torch.long)
        bounds = torch.ones(self.num_experts, width + 1, dtype=torch.float64)
        for e, (ranks, shares) in enumerate(zip(placement.holders, placement.shares)):
            holders[e, 0] = e
            for j, r in enumerate(ranks[1:], 1):
                if used[r] == self.spare_per_rank:
                    raise ValueError(f"placement puts more than {self.spare_per_rank} replicas on rank {r}")
                slot = r * self.spare_per_rank + used[r]
                used[r] += 1
                slot_expert[slot], holders[e, j] = e, self.num_experts + slot
            cumulative = torch.tensor([0.0, *shares], dtype=torch.float64).cumsum(0)
            bounds[e, : len(ranks) + 1] = cumulative / cumulative[-1]
        return slot_expert, holders, bounds

    @torch.no_grad()
    def set_placement(self, placement: Placement, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Re-plan: slots whose expert changes copy its primary's weights and optimizer state (emptied slots are
        zeroed with their state).

        Args:
            placement: the new placement (same experts and layout).
            optimizer: the optimizer training these parameters (``None``: before the first step).

        Returns:
            Bytes copied (weights plus optimizer state of every slot that changed).
        """
        slot_expert, self._holders, self._bounds = self._layout(placement)
        moved = 0
        pairs = ((self.spare_gate_up_proj, self.gate_up_proj), (self.spare_down_proj, self.down_proj))
        for s in torch.nonzero(slot_expert != self.slot_expert).flatten().tolist():
            e = int(slot_expert[s])
            for spare, primary in pairs:
                tensors = [(spare, primary)]
                if optimizer is not None:
                    spare_state, primary_state = (
                        optimizer.state.get(spare, {}),
                        optimizer.state.get(primary, {}),
                    )
                    tensors += [
                        (spare_state[k], primary_state[k])
                        for k in spare_state
                        if k in primary_state and spare_state[k].shape == spare.shape
                    ]
                for dst, src in tensors:
                    dst[s] = src[e] if e >= 0 else 0
                    moved += dst[s].numel() * dst.element_size() if e >= 0 else 0
        self.slot_expert.copy_(slot_expert)
        self.placement = placement
        return moved

    @torch.no_grad()
    def sum_replica_grads(self) -> None:
        """Gives every holder of an expert the sum of all its holders' gradients (under EP: an all-reduce over the
        expert's holders), so each steps as the primary would without replicas."""
        used = torch.nonzero(self.slot_expert >= 0).flatten()
        experts = self.slot_expert[used]
        for spare, primary in (
            (self.spare_gate_up_proj, self.gate_up_proj),
            (self.spare_down_proj, self.down_proj),
        ):
            if spare.grad is None or primary.grad is None:
                continue
            primary.grad.index_add_(0, experts, spare.grad[used])
            spare.grad[used] = primary.grad[experts]

    def forward(
        self,
        x_TD: Tensor,
        indices_TK: Tensor,
        weights_TK: Tensor,
        shared: Callable[[Tensor], Tensor | None] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """As :meth:`Experts.forward` (``shared``: the always-active experts, added to the output), each assignment
        computed by the holder :func:`split_by_index` picks.

        Returns:
            The mixed outputs ``[T, D]`` and the assignments per (original) expert ``[E]``.
        """
        T, K = indices_TK.shape
        experts_N = indices_TK.flatten()
        slots_N = split_by_index(experts_N, self._holders.to(x_TD.device), self._bounds.to(x_TD.device))
        gate_up = torch.cat([self.gate_up_proj, self.spare_gate_up_proj])
        down = torch.cat([self.down_proj, self.spare_down_proj])
        order_N = slots_N.argsort(stable=True)
        counts_S = torch.bincount(slots_N, minlength=gate_up.shape[0])
        x_ND = x_TD[order_N // K]
        gate_NI, up_NI = grouped_linear(x_ND, gate_up, counts_S).chunk(2, dim=-1)
        y_ND = grouped_linear(F.silu(gate_NI) * up_NI, down, counts_S)
        unsort_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(T * K, device=order_N.device))
        y_TKD = y_ND[unsort_N].view(T, K, -1)
        out_TD = (y_TKD * weights_TK[..., None].to(y_TKD.dtype)).sum(dim=1)
        shared_TD = shared(x_TD) if shared is not None else None
        if shared_TD is not None:
            out_TD = out_TD + shared_TD
        return out_TD, torch.bincount(experts_N, minlength=self.num_experts)

"""Mixture-of-experts feed-forward blocks: routers, experts with grouped computation, router losses.

Data flow of a :class:`MoEBlock` (T tokens, E experts, K experts per token, D hidden size)::

    x [T,D] ─┬─ gate (router) ─ top-k ─ weights [T,K], indices [T,K] ─┐
             ├─ experts: sort the T*K assignments by expert, one SwiGLU per expert (grouped matmul), unsort,
             │           weighted sum over each token's K outputs ────┴─ routed [T,D]
             └─ shared expert(s), always active (optional) ──────────── + shared [T,D]

Parameter names and layouts are those of transformers 5 (``gate.weight``, ``experts.gate_up_proj`` ``[E, 2I, D]``,
``experts.down_proj`` ``[E, D, I]``, ``gate.e_score_correction_bias``, ``shared_expert(s).*``), so its state dict
loads one to one; Hugging Face files store the experts one by one, which ``forge_lightning.modules.llm.hf``
converts.

Under expert parallelism (:meth:`Experts.enable_expert_parallel`, applied by a strategy from the plan's
``Component.experts``) each rank holds ``E / ep`` of the experts and the tokens travel to them and back by
all-to-all (:mod:`forge_lightning.distributed.expert_parallel`), the shared experts computed meanwhile.

Each block keeps what its router did in its last forward (:attr:`MoEBlock.stats`): the per-expert token counts for
logging and the differentiable statistics of the load-balancing loss and the router z-loss, which
:func:`router_losses` combines over all MoE layers of a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.accelerators.capabilities import capabilities
from forge_lightning.distributed.expert_parallel import ExpertParallel, expert_parallel_mix
from forge_lightning.modules.layers.mlp import GatedMLP, init_linear


@dataclass
class Routing:
    """A router's decision for T tokens.

    Args:
        weights: ``[T, K]`` weight of each chosen expert's output.
        indices: ``[T, K]`` chosen experts.
        logits: ``[T, E]`` router logits (for the z-loss).
        probs: ``[T, E]`` each token's routing distribution (sums to one; for the load-balancing loss).
    """

    weights: Tensor
    indices: Tensor
    logits: Tensor
    probs: Tensor


@dataclass
class RouterStats:
    """What one MoE layer's router did in its last forward.

    Args:
        tokens_per_expert: ``[E]`` assignments per expert (float, no gradient); sums to ``num_tokens * K``.
        prob_sum: ``[E]`` sum over tokens of the routing distribution (differentiable).
        z_loss: mean over tokens of ``logsumexp(logits)^2`` (differentiable).
        num_tokens: tokens routed.
        probs: ``[T, E]`` each token's routing distribution (differentiable), for losses over some tokens only.
        indices: ``[T, K]`` each token's experts.
    """

    tokens_per_expert: Tensor
    prob_sum: Tensor
    z_loss: Tensor
    num_tokens: int
    probs: Tensor
    indices: Tensor


@dataclass
class RouterLosses:
    """Router losses of a model's last forward, combined over its MoE layers (see :func:`router_losses`).

    Args:
        aux_loss: load-balancing loss (unweighted).
        z_loss: router z-loss (unweighted).
        tokens_per_expert: ``[num_moe_layers, E]`` assignments per expert and layer.
    """

    aux_loss: Tensor
    z_loss: Tensor
    tokens_per_expert: Tensor


class TopKRouter(nn.Module):
    """Softmax router: each token goes to its ``top_k`` most probable experts (Qwen2-MoE, Qwen3-MoE).

    Args:
        hidden_size: model width.
        num_experts: routed experts.
        top_k: experts per token.
        norm_topk_prob: renormalise the chosen probabilities to sum to one.
        scaling: factor on the expert weights.
        init_std: standard deviation of the normal initialisation of ``weight``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = False,
        scaling: float = 1.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.scaling, self.init_std = scaling, init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, x_TD: Tensor) -> Routing:
        logits_TE = F.linear(x_TD, self.weight)
        probs_TE = logits_TE.softmax(dim=-1, dtype=torch.float32)
        weights_TK, indices_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        weights_TK = (weights_TK * self.scaling).to(logits_TE.dtype)
        return Routing(weights_TK, indices_TK, logits_TE, probs_TE)


class GroupLimitedRouter(nn.Module):
    """Sigmoid router with group-limited top-k and a selection-only bias (DeepSeek-V3, arXiv:2412.19437).

    Each expert gets an independent score ``sigmoid(logit)``. The experts are chosen by ``score + bias``, where
    ``e_score_correction_bias`` is the per-expert bias of auxiliary-loss-free load balancing (Wang et al. 2024,
    arXiv:2408.15664); the weights are the unbiased scores of the chosen experts. With groups, a token first keeps
    the ``topk_group`` groups whose two best biased scores sum highest, then picks its experts inside them. The
    logits are computed in fp32, and the bias stays fp32 when the module is cast.

    Args:
        hidden_size: model width.
        num_experts: routed experts.
        top_k: experts per token.
        num_groups: expert groups (1: no group limit).
        topk_group: groups a token may use.
        norm_topk_prob: renormalise the chosen scores to sum to one.
        scaling: factor on the expert weights (``routed_scaling_factor``).
        init_std: standard deviation of the normal initialisation of ``weight``.
    """

    e_score_correction_bias: Tensor

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        num_groups: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        scaling: float = 1.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.top_k, self.num_groups, self.topk_group = top_k, num_groups, topk_group
        self.norm_topk_prob, self.scaling, self.init_std = norm_topk_prob, scaling, init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(num_experts, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.e_score_correction_bias)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> GroupLimitedRouter:
        # Biases are small differences between scores in [0, 1]: rounding them to bf16 changes which experts win.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.to(self.e_score_correction_bias.device, torch.float32)
        return self

    def forward(self, x_TD: Tensor) -> Routing:
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE = logits_TE.sigmoid()
        choice_TE = scores_TE.detach() + self.e_score_correction_bias
        if self.num_groups > 1:
            T, E = choice_TE.shape
            choice_TGX = choice_TE.view(T, self.num_groups, E // self.num_groups)
            group_scores_TG = choice_TGX.topk(2, dim=-1).values.sum(dim=-1)
            chosen_TJ = group_scores_TG.topk(self.topk_group, dim=-1).indices  # J = topk_group
            keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, chosen_TJ, True)
            choice_TE = choice_TGX.masked_fill(~keep_TG[..., None], float("-inf")).view(T, E)
        indices_TK = choice_TE.topk(self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(1, indices_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        return Routing(weights_TK * self.scaling, indices_TK, logits_TE, probs_TE)


def grouped_linear(
    x_ND: Tensor, weight_EOD: Tensor, counts_E: Tensor, *, use_grouped_mm: bool | None = None
) -> Tensor:
    """``x @ weight[e].T`` for consecutive row groups of ``x``: rows of expert 0 first, then expert 1, ...

    Args:
        x_ND: ``[N, D]`` rows sorted by expert.
        weight_EOD: ``[E, O, D]`` one ``nn.Linear``-style weight per expert.
        counts_E: ``[E]`` rows per expert (summing to ``N``).
        use_grouped_mm: use ``torch._grouped_mm`` (one kernel for all experts); ``None`` picks it where it runs
            (bf16 on CPU or on CUDA compute capability >= 9.0; other dtypes on CPU without torch.compile), else
            a loop over the experts.

    Returns:
        ``[N, O]``.
    """
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_supported(x_ND)
    if use_grouped_mm:
        offsets_E = counts_E.cumsum(0).to(torch.int32)  # end row of each expert's group
        return torch._grouped_mm(x_ND, weight_EOD.transpose(-2, -1), offs=offsets_E)
    groups = x_ND.split(counts_E.tolist())
    return torch.cat([F.linear(rows, weight_EOD[e]) for e, rows in enumerate(groups)])


def _grouped_mm_supported(x: Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype == torch.bfloat16:
        return x.device.type == "cpu" or (
            capabilities(x.device).grouped_mm and torch.cuda.get_device_capability(x.device) >= (9, 0)
        )
    # Other dtypes: CPU's eager kernel only (the shape function torch.compile traces with accepts bf16 only).
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


class Experts(nn.Module):
    """The routed SwiGLU experts of one layer, stored as 3-D tensors (transformers 5 layout).

    Tokens are dispatched by sorting their ``T * K`` assignments by expert, so each expert's rows are contiguous
    and one grouped matmul serves all experts.

    Args:
        num_experts: routed experts.
        hidden_size: model width.
        intermediate_size: SwiGLU width of one expert.
        init_std: standard deviation of the normal initialisation.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, init_std: float = 0.02
    ) -> None:
        super().__init__()
        self.num_experts, self.init_std = num_experts, init_std
        self.expert_parallel: ExpertParallel | None = None
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=self.init_std)
        nn.init.normal_(self.down_proj, mean=0.0, std=self.init_std)

    def matrix_parts(self) -> dict[str, tuple[int, ...]]:
        """Both weights are stacks of one matrix per expert; ``gate_up_proj`` fuses the gate and up rows (Muon
        orthogonalises them apart, as separate ``gate_proj`` / ``up_proj`` would be)."""
        intermediate = self.down_proj.shape[-1]
        return {"gate_up_proj": (intermediate, intermediate), "down_proj": (self.down_proj.shape[-2],)}

    def enable_expert_parallel(self, ep: ExpertParallel) -> None:
        """Keep only this rank's experts (``E / ep`` consecutive ones) and exchange tokens with the other ranks of
        ``ep`` in every forward (:mod:`forge_lightning.distributed.expert_parallel`). Call it on every rank of the
        group, after the weights are initialised (each rank takes its slice of the same full stacks).

        Raises:
            ValueError: ``num_experts`` not divisible by the group size.
        """
        ep.local_experts(self.num_experts)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(ep.shard(full), requires_grad=full.requires_grad))
        self.expert_parallel = ep

    def _swiglu(self, x_ND: Tensor, counts_E: Tensor) -> Tensor:
        """The held experts on rows grouped by expert (``counts_E`` rows each, in order)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.expert_parallel is not None:
            gate_up, down = self.expert_parallel.local(gate_up), self.expert_parallel.local(down)
        gate_NI, up_NI = grouped_linear(x_ND, gate_up, counts_E).chunk(2, dim=-1)
        return grouped_linear(F.silu(gate_NI) * up_NI, down, counts_E)

    def forward(
        self,
        x_TD: Tensor,
        indices_TK: Tensor,
        weights_TK: Tensor,
        shared: Callable[[Tensor], Tensor | None] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Mix each token's chosen experts.

        Args:
            x_TD: ``[T, D]`` tokens.
            indices_TK: ``[T, K]`` experts of each token.
            weights_TK: ``[T, K]`` weights of their outputs.
            shared: always-active experts ``shared(x_TD)`` (``None``, or returning ``None``: none), added to the
                output; under expert parallelism computed while the tokens travel.

        Returns:
            ``sum_k weights[t, k] * expert[indices[t, k]](x[t])`` (plus ``shared``) ``[T, D]`` and the assignments
            per expert ``[E]``.
        """
        if self.expert_parallel is not None:
            return expert_parallel_mix(
                x_TD, indices_TK, weights_TK, self.expert_parallel, self.num_experts, self._swiglu, shared
            )
        T, K = indices_TK.shape
        experts_N = indices_TK.flatten()  # N = T * K assignments, token-major
        order_N = experts_N.argsort(stable=True)
        counts_E = torch.bincount(experts_N, minlength=self.num_experts)
        y_ND = self._swiglu(x_TD[order_N // K], counts_E)
        unsort_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(T * K, device=order_N.device))
        y_TKD = y_ND[unsort_N].view(T, K, -1)  # back to token-major order
        out_TD = (y_TKD * weights_TK[..., None].to(y_TKD.dtype)).sum(dim=1)
        shared_TD = shared(x_TD) if shared is not None else None
        return (out_TD if shared_TD is None else out_TD + shared_TD), counts_E


class MoEBlock(nn.Module):
    """Routed experts without a shared expert (Qwen3-MoE); subclasses add shared experts.

    Args:
        hidden_size: model width.
        router: the layer's router (:class:`TopKRouter` or :class:`GroupLimitedRouter`), kept as ``gate``.
        num_experts: routed experts.
        intermediate_size: SwiGLU width of one routed expert.
        init_std: standard deviation of the normal initialisation.
    """

    def __init__(
        self,
        hidden_size: int,
        router: nn.Module,
        num_experts: int,
        intermediate_size: int,
        *,
        init_std: float,
    ) -> None:
        super().__init__()
        self.gate = router
        self.experts = Experts(num_experts, hidden_size, intermediate_size, init_std=init_std)
        self.stats: RouterStats | None = None

    def shared_output(self, x_TD: Tensor) -> Tensor | None:
        """The always-active experts' output ``[T, D]`` (``None``: there are none)."""
        return None

    def __getstate__(self) -> dict[str, Any]:
        # The last forward's statistics hold autograd graphs, which can be neither copied nor pickled.
        return {**super().__getstate__(), "stats": None}

    def tp_plan(self) -> dict[str, str]:
        """Tensor-parallel styles of submodules (relative names); routed experts and router stay replicated."""
        return {}

    def forward(self, x_BSD: Tensor) -> Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.gate(x_TD)
        out_TD, counts_E = self.experts(x_TD, routing.indices, routing.weights, shared=self.shared_output)
        self.stats = RouterStats(
            tokens_per_expert=counts_E.detach().float(),
            prob_sum=routing.probs.sum(dim=0),
            z_loss=torch.logsumexp(routing.logits.float(), dim=-1).square().mean(),
            num_tokens=x_TD.shape[0],
            probs=routing.probs,
            indices=routing.indices,
        )
        return out_TD.view_as(x_BSD)


class _SharedExpertMoE(MoEBlock):
    """Routed experts plus an always-active shared SwiGLU; the two families below differ only in its name and gate.

    The shared expert is registered as ``shared_name`` (the family's Hugging Face name, so checkpoints load
    as they are); with ``gated`` its output is scaled by ``sigmoid(shared_expert_gate(x))`` per token.

    Args:
        hidden_size: model width.
        router: the layer's router.
        num_experts: routed experts.
        intermediate_size: SwiGLU width of one routed expert.
        shared_intermediate_size: SwiGLU width of the shared expert (DeepSeek: ``n_shared_experts`` experts as one).
        init_std: standard deviation of the normal initialisation.
    """

    shared_name: ClassVar[str]
    gated: ClassVar[bool] = False

    def __init__(
        self,
        hidden_size: int,
        router: nn.Module,
        num_experts: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        *,
        init_std: float,
    ) -> None:
        super().__init__(hidden_size, router, num_experts, intermediate_size, init_std=init_std)
        self.add_module(self.shared_name, GatedMLP(hidden_size, shared_intermediate_size, init_std=init_std))
        if self.gated:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.gated:
            init_linear(self.shared_expert_gate, self.experts.init_std)

    def shared_output(self, x_TD: Tensor) -> Tensor:
        shared_TD = getattr(self, self.shared_name)(x_TD)
        if self.gated:
            return torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
        return shared_TD

    def tp_plan(self) -> dict[str, str]:
        # A scalar gate stays replicated: it reads the full hidden state.
        styles = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
        return {f"{self.shared_name}.{proj}": style for proj, style in styles.items()}


class SharedExpertsMoE(_SharedExpertMoE):
    """Routed experts plus an ungated shared SwiGLU ``shared_experts`` (DeepSeek-V3); arguments as
    :class:`_SharedExpertMoE`."""

    shared_name = "shared_experts"


class GatedSharedExpertMoE(_SharedExpertMoE):
    """Routed experts plus a shared SwiGLU ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))`` per token
    (Qwen2-MoE); arguments as :class:`_SharedExpertMoE`."""

    shared_name, gated = "shared_expert", True


def router_losses(blocks: Sequence[MoEBlock], token_mask: Tensor | None = None) -> RouterLosses:
    """Load-balancing loss and router z-loss of the blocks' last forward.

    The load-balancing loss is the Switch Transformer's (Fedus et al. 2021, arXiv:2101.03961, eq. 4-6)
    ``E * sum_e f_e * P_e`` with ``f_e`` the expert's assignments per token (top-k: they sum to K) and ``P_e`` its
    mean routing probability, both pooled over all MoE layers first, as transformers computes its ``aux_loss``; it
    equals K for perfectly balanced routing. For sigmoid routers ``P`` is the token's normalised scores. The z-loss
    is ST-MoE's (Zoph et al. 2022, arXiv:2202.08906, eq. 5) ``mean_t logsumexp(logits_t)^2``, averaged over layers.

    With ``token_mask`` the load-balancing loss and the expert loads count only the tokens it keeps, as transformers
    leaves padding out by the attention mask; the z-loss stays the mean over all tokens.

    Args:
        blocks: the MoE blocks of a model, each after a forward.
        token_mask: ``[B, S]`` (or ``[T]``), nonzero at the tokens to count, in the order the blocks saw them.
    """
    stats = [block.stats for block in blocks]
    if not stats or any(s is None for s in stats):
        raise ValueError("router_losses needs every MoE block to have run a forward")
    if token_mask is None:
        counts_LE = torch.stack([s.tokens_per_expert for s in stats])
        prob_sum_E = torch.stack([s.prob_sum for s in stats]).sum(dim=0)
        num_tokens = sum(s.num_tokens for s in stats)
    else:
        counts_LE, prob_sum_E, num_tokens = _masked_router_stats(stats, token_mask.reshape(-1))
    f_E, p_E = counts_LE.sum(dim=0) / num_tokens, prob_sum_E / num_tokens
    aux_loss = counts_LE.shape[-1] * (f_E * p_E).sum()
    z_loss = torch.stack([s.z_loss for s in stats]).mean()
    return RouterLosses(aux_loss=aux_loss, z_loss=z_loss, tokens_per_expert=counts_LE)


def _masked_router_stats(stats: Sequence[RouterStats], keep_T: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(assignments [L, E], summed routing distribution [E], kept tokens over the layers)`` of the tokens
    ``keep_T`` keeps."""
    if any(s.num_tokens != keep_T.numel() for s in stats):
        raise ValueError(
            f"token_mask holds {keep_T.numel()} tokens but the MoE blocks routed {stats[0].num_tokens}"
        )
    keep_T = keep_T.to(torch.float32)
    K = stats[0].indices.shape[-1]
    counts = [
        torch.zeros_like(s.tokens_per_expert).index_add_(0, s.indices.flatten(), keep_T.repeat_interleave(K))
        for s in stats
    ]
    prob_sum_E = sum((s.probs.float() * keep_T[:, None]).sum(dim=0) for s in stats)
    return torch.stack(counts), prob_sum_E, keep_T.sum() * len(stats)

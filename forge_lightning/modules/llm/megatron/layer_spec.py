"""Layer spec of the decoder for megatron-core: its own parallel linears and MoE layer, our norm and SDPA attention.

megatron-core's local spec (no TransformerEngine) cannot do what the dense path needs: its torch norms refuse
sequence parallelism and its ``DotProductAttention`` materialises the ``[b, heads, s, s]`` scores. This spec
keeps megatron's column / row parallel linears, ``SelfAttention``, ``MLP``, ``MoELayer`` (router, all-to-all token
dispatcher, ``SequentialMLP``'s expert parameters, shared expert) and ``TransformerLayer`` and swaps in

* :class:`MegatronRMSNorm`: forge's RMSNorm (fp32 statistics, as Hugging Face) whose weight is tagged
  ``sequence_parallel`` so megatron all-reduces its gradient over the TP group when the sequence is sharded;
* :class:`SDPACoreAttention`: causal ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient
  kernels on CUDA, a math kernel on CPU; packed rows: within each document, the native ``DocumentMask``); with
  context parallelism, forge's Ulysses (``cp_comm_type`` ``a2a``), ring (``p2p``) or hybrid (``a2a+p2p``) attention
  over megatron's CP groups (megatron's own CP needs TransformerEngine's attention).

Multi-latent attention (DeepSeek-V3) is megatron's ``MLASelfAttention`` with the same core attention, its query and
key/value down projections replicated over the TP ranks (as in megatron's TE spec, see :func:`local_mla_spec`) and
DeepSeek's latent norms (:class:`LatentRMSNorm`). MoE routers are :class:`MegatronTopKRouter` (the selection bias
stays fp32).

With TransformerEngine importable, :func:`gpt_decoder_spec` uses megatron's TE layer spec instead (not for MLA).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from torch import Tensor

from forge_lightning.distributed.context_parallel import (
    ContextParallel,
    hybrid_attention,
    ring_attention,
    to_head_parallel,
    to_sequence_parallel,
)
from forge_lightning.kernels import apply_rope, rms_norm
from forge_lightning.modules.layers.attention import DocumentMask
from forge_lightning.modules.layers.mla import LATENT_NORM_EPS
from forge_lightning.modules.layers.moe import grouped_linear
from forge_lightning.modules.layers.norms import RMSNorm


def transformer_engine_available() -> bool:
    """Whether TransformerEngine's PyTorch extension is importable."""
    return importlib.util.find_spec("transformer_engine") is not None


class MegatronRMSNorm(RMSNorm):
    """forge's RMSNorm with megatron's constructor; the weight is tagged for sequence-parallel gradient sync.

    Runs forge's fused RMSNorm kernel (:func:`~forge_lightning.kernels.rms_norm`: Triton on CUDA, the same
    HF-semantics torch code elsewhere): megatron's layers are not compiled, so a plain-torch norm would be several
    elementwise kernels over the activations.

    Args:
        config: the transformer config (reads ``sequence_parallel``).
        hidden_size: normalised width.
        eps: epsilon added to the mean square.
        backend: the kernel (``performance.kernels.rms_norm``: ``auto``, ``triton`` or ``torch``).
    """

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, backend: str = "auto", **_: Any
    ) -> None:
        super().__init__(hidden_size, eps)
        self.backend = backend
        # With sequence parallelism each TP rank sees a slice of the tokens, so this weight's gradient is partial:
        # megatron's finalize_model_grads all-reduces parameters carrying this attribute over the TP group.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, backend=self.backend)


class LatentRMSNorm(MegatronRMSNorm):
    """MLA's query and key/value latent norms (``q_layernorm``, ``kv_layernorm``): DeepSeek's fixed epsilon
    (:data:`~forge_lightning.modules.layers.mla.LATENT_NORM_EPS`), whatever ``layernorm_epsilon`` megatron passes."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, backend: str = "auto", **_: Any
    ) -> None:
        super().__init__(config, hidden_size, LATENT_NORM_EPS, backend)


class SDPACoreAttention(MegatronModule):
    """Causal core attention on ``scaled_dot_product_attention``, in megatron's ``[s, b, heads, dim]`` layout.

    With context parallelism (``config.context_parallel_size`` = P > 1) each rank holds ``S / P`` positions of the
    sequence in megatron's load-balanced layout (rank ``r``: chunks ``r`` and ``2P - 1 - r`` of ``2P``, see
    :func:`~forge_lightning.modules.llm.megatron.steps.shard_on_context_parallel_rank`), and attention runs over
    megatron's CP group as ``cp_comm_type`` says (:mod:`forge_lightning.distributed.context_parallel`):

    * ``a2a`` (default), Ulysses::

        q, k, v [s/P, b, heads, D] ──all-to-all──▶ [b, heads/P, S, D] in sequence order ── causal SDPA ──▶
                                   ──all-to-all──▶ [s/P, b, heads, D]

      When the rank's key/value groups do not divide by ``P`` (e.g. MQA), they are repeated to the query heads first.
    * ``p2p``, ring attention: key/value blocks pass around the CP ranks, outputs merge by log-sum-exp; no head
      constraint, grouped key/value heads are not repeated.
    * ``a2a+p2p``: Ulysses inside megatron's first hierarchical CP group (``hierarchical_context_parallel_sizes[0]``
      ranks), ring across the second.

    RoPE: with :attr:`rotary_freqs` set (by :class:`FusedRopeSelfAttention`, for the duration of one call) this module
    rotates the queries and keys first, with forge's fused RoPE kernel (Triton on CUDA), at the positions megatron's
    rotary embedding gives (this rank's chunks under CP); otherwise megatron's attention rotated them before. Values
    may have another head size than queries and keys (multi-latent attention).

    Args:
        config: the transformer config.
        layer_number: 1-based layer index (unused; megatron passes it).
        attn_mask_type: must be causal.
        attention_type: ``self`` (megatron passes it).
        attention_dropout: dropout probability (default: ``config.attention_dropout``).
        softmax_scale: score scale (default: ``1 / sqrt(query head size)``; MLA passes its own).
        cp_comm_type: ``a2a``, ``p2p`` or ``a2a+p2p`` (megatron passes ``config.cp_comm_type``; ``None``: ``a2a``).
        pg_collection: megatron's process groups (its ``cp`` and ``hcp`` groups; default: megatron's parallel state).
        rope_backend: the RoPE kernel (``performance.kernels.rope``: ``auto``, ``triton`` or ``torch``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        rope_backend: str = "auto",
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        self.rotary_freqs: Tensor | None = None
        self.rope_backend = rope_backend
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.cp: ContextParallel | None = None
        if config.context_parallel_size > 1:
            self.cp = _context_parallel(config, cp_comm_type or "a2a", pg_collection)
            if self.cp.comm_type != "a2a" and self.dropout:
                raise NotImplementedError(
                    f"attention dropout ({self.dropout}) with cp_comm_type {self.cp.comm_type!r}: ring attention has "
                    "no dropout; use cp_comm_type 'a2a'"
                )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """Attention output ``[s, b, heads * dim_v]`` of ``query`` ``[s, b, heads, dim]``, ``key``
        ``[s, b, groups, dim]`` and ``value`` ``[s, b, groups, dim_v]`` (``s`` is this rank's share under CP).

        Causal; ``attention_mask``, when given, is the micro-batch's ``document_ids`` ``[b, S]`` of packed rows (the
        whole sequence, see ``schedule.forward_step``): each token then attends causally within its document only,
        through the native :class:`~forge_lightning.modules.layers.attention.DocumentMask` (its dense ``sdpa`` form).
        Under Ulysses CP the mask applies after the all-to-all, on the whole sequence.
        """
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("megatron's packed_seq_params and attention bias are not yet supported")
        if self.rotary_freqs is not None:
            freqs, backend = self.rotary_freqs, self.rope_backend
            query, key = _rotate(query, freqs, backend), _rotate(key, freqs, backend)
        s, b, heads, _ = query.shape
        q_BHSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        documents = None
        if attention_mask is not None:
            if self.cp is not None and self.cp.comm_type != "a2a":
                raise NotImplementedError(
                    f"packed batches (document_ids) with cp_comm_type {self.cp.comm_type!r}: ring attention has no "
                    "document mask; use cp_comm_type 'a2a' or unpacked data"
                )
            documents = DocumentMask.build(attention_mask, "sdpa")  # dense [b, 1, S, S]
        if self.cp is not None and self.cp.comm_type != "a2a":  # ring or hybrid: [b, h, s/P, D] in and out
            attend = ring_attention if self.cp.comm_type == "p2p" else hybrid_attention
            out_BHSD = attend(q_BHSD, k_BGSD, v_BGSD, self.cp, causal=True, scale=self.softmax_scale)
            return out_BHSD.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads * dim_v]
        repeat = heads // k_BGSD.shape[1]
        if repeat > 1 and (self.cp is None or k_BGSD.shape[1] % self.cp.size):
            # GQA: each key/value group serves `repeat` consecutive query heads. Under CP, groups that do not split
            # over the CP ranks are expanded to the query heads before the exchange.
            k_BGSD = k_BGSD.repeat_interleave(repeat, dim=1)
            v_BGSD = v_BGSD.repeat_interleave(repeat, dim=1)
            repeat = 1
        if self.cp is not None:  # [b, h, s/P, D] -> [b, h/P, S, D]: whole sequence, 1/P of the heads
            q_BHSD, k_BGSD, v_BGSD = (to_head_parallel(t, self.cp) for t in (q_BHSD, k_BGSD, v_BGSD))
        if repeat > 1:  # after the exchange, rank j's query heads are exactly those of its key/value groups
            k_BGSD = k_BGSD.repeat_interleave(repeat, dim=1)
            v_BGSD = v_BGSD.repeat_interleave(repeat, dim=1)
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD,
            k_BGSD,
            v_BGSD,
            attn_mask=None if documents is None else documents.dense,
            is_causal=documents is None,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )
        if self.cp is not None:
            out_BHSD = to_sequence_parallel(out_BHSD, self.cp)  # [b, h, s/P, D]
        return out_BHSD.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads * dim_v]


def _rotate(x_SBHD: Tensor, freqs_SB1D: Tensor, backend: str = "auto") -> Tensor:
    """Rotate-half RoPE of ``x`` ``[s, b, heads, dim]`` by megatron's angles ``[s, 1 or b, 1, rotary dim]``.

    The kernel takes ``[batch, seq, heads, dim]`` with tables ``[batch or 1, seq, rotary dim]``: megatron's ``s``
    plays the batch and its ``b`` the sequence, so no copy of ``x`` is made.
    """
    s, b = x_SBHD.shape[:2]
    angles_SBD = freqs_SB1D[:, :, 0].float()
    cos, sin = angles_SBD.cos().expand(s, b, -1), angles_SBD.sin().expand(s, b, -1)
    return apply_rope(x_SBHD, cos, sin, backend=backend)


class FusedRopeSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` whose RoPE runs inside :class:`SDPACoreAttention`, as one fused kernel per query
    and key tensor instead of megatron's eager rotate-half (several elementwise kernels each).

    The rotary angles reach the core attention for the duration of one call (the layer's forward, also when full
    recompute reruns it); megatron's own path runs where that cannot hold: inference, cross attention (a pair of
    tables), selective recompute of the core attention alone (which reruns it outside this call), or another
    core attention (TransformerEngine's).
    """

    def forward(self, *args: Any, rotary_pos_emb: Any = None, **kwargs: Any) -> tuple[Tensor, Tensor]:
        fused = (
            isinstance(rotary_pos_emb, Tensor)
            and isinstance(self.core_attention, SDPACoreAttention)
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
            and self.config.recompute_granularity != "selective"
            and not self.config.rotary_interleaved
        )
        if not fused:
            return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        self.core_attention.rotary_freqs = rotary_pos_emb
        try:
            return super().forward(*args, rotary_pos_emb=None, **kwargs)
        finally:
            self.core_attention.rotary_freqs = None


def _context_parallel(config: TransformerConfig, comm_type: str, pg_collection: Any) -> ContextParallel:
    """megatron's CP group (and, for ``a2a+p2p``, its hierarchical groups) in megatron's load-balanced layout."""
    group = getattr(pg_collection, "cp", None)
    group = parallel_state.get_context_parallel_group() if group is None else group
    order = load_balanced_chunk_order(config.context_parallel_size)
    if comm_type != "a2a+p2p":
        return ContextParallel(group, order, comm_type)
    hcp = parallel_state.get_hierarchical_context_parallel_groups
    groups = getattr(pg_collection, "hcp", None) or hcp(check_initialized=False)
    if not groups or len(groups) != 2:
        raise ValueError(
            "cp_comm_type 'a2a+p2p' needs megatron's two hierarchical context-parallel groups: set "
            "hierarchical_context_parallel_sizes [a2a, p2p] (megatron's initialize_model_parallel creates them)"
        )
    return ContextParallel(group, order, comm_type, a2a_group=groups[0], p2p_group=groups[1])


def load_balanced_chunk_order(cp: int) -> tuple[int, ...]:
    """megatron's causal load-balanced split: the sequence in ``2 * cp`` chunks, rank ``r`` holding ``r`` and
    ``2 * cp - 1 - r`` (cp = 2: ``(0, 3, 1, 2)``), as listed for :class:`ContextParallel`."""
    return tuple(c for r in range(cp) for c in (r, 2 * cp - 1 - r))


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router GEMM tests ``te_general_gemm is not None``, a name it defines only when
    TransformerEngine imports: without TE every MoE forward raises ``NameError``. Define it as ``None`` there (the
    torch ``mm`` branch megatron then takes is its own fallback); with TE this changes nothing."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class MegatronTopKRouter(TopKRouter):
    """megatron's ``TopKRouter`` whose selection bias (``expert_bias``, sigmoid routing) and its token counts stay
    fp32 when the model is cast (``Float16Module``), as natively: the biases are small differences between scores in
    [0, 1], and rounding them to bf16 changes which experts win (megatron casts them back to fp32 only after the
    rounding).

    In training it also counts the tokens it routes to each expert (``step_tokens_per_expert``, ``[experts]``
    fp32, summed over the forwards since :func:`~.schedule.expert_load_metrics` last read and cleared it).
    """

    step_tokens_per_expert: Tensor | None = None

    def forward(self, input: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        probs, routing_map = super().forward(input, *args, **kwargs)
        # Not when activation recomputation re-runs the layer inside backward (the autograd engine's task).
        if self.training and torch._C._current_graph_task_id() == -1:
            counts_E = routing_map.detach().sum(dim=0, dtype=torch.float32)
            seen = self.step_tokens_per_expert
            self.step_tokens_per_expert = counts_E if seen is None else seen + counts_E
        return probs, routing_map

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MegatronTopKRouter:
        kept = {name: getattr(self, name, None) for name in ("expert_bias", "local_tokens_per_expert")}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            if before is not None and after.dtype != torch.float32:
                setattr(self, name, before.to(after.device, torch.float32))
        return self


class GroupedSequentialMLP(SequentialMLP):
    """megatron's ``SequentialMLP`` experts (same parameters, names and checkpoints) computed as two grouped GEMMs
    over all local experts (:func:`~forge_lightning.modules.layers.moe.grouped_linear`: ``torch._grouped_mm`` on
    Hopper GPUs in bf16 and on CPUs, a loop elsewhere) instead of one small GEMM pair per expert.

    The experts' weights are stacked at each forward (their gradients flow back to each expert's own parameter);
    the activation is the experts' SwiGLU weighted by the routing probabilities, megatron's fused kernel when
    ``bias_activation_fusion`` is on. megatron's per-expert loop runs for what this does not cover: biases,
    activation clamps or offsets, TE activations, FP8 / FP4 padding, probabilities applied to the inputs.
    """

    def _grouped(self) -> bool:
        c = self.config
        first = self.local_experts[0] if len(self.local_experts) else None
        return (
            first is not None
            and c.gated_linear_unit
            and c.activation_func is F.silu
            and not c.use_te_activation_func
            and c.activation_func_clamp_value is None
            and not c.glu_linear_offset
            and not (c.fp8 or c.fp4)
            and not c.moe_apply_probs_on_input
            and first.linear_fc1.bias is None
            and first.linear_fc2.bias is None
        )

    def forward(
        self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor
    ) -> tuple[Tensor, None]:
        if not self._grouped():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x_ND = permuted_local_hidden_states
        counts_E = torch.as_tensor(tokens_per_expert, device=x_ND.device)
        w1_EOD = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])
        w2_EDI = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])
        h_NO = grouped_linear(x_ND, w1_EOD, counts_E)
        probs_N1 = permuted_probs.unsqueeze(-1)
        if self.config.bias_activation_fusion:
            h_NI = weighted_bias_swiglu_impl(
                h_NO, None, probs_N1, self.config.activation_func_fp8_input_store
            )
        else:
            gate_NI, up_NI = h_NO.chunk(2, dim=-1)
            h_NI = (F.silu(gate_NI) * up_NI * probs_N1).to(h_NO.dtype)
        return grouped_linear(h_NI, w2_EDI, counts_E), None


def local_moe_spec() -> ModuleSpec:
    """megatron's ``MoELayer`` from its own parallel linears: top-k router, token dispatcher, the experts as
    :class:`GroupedSequentialMLP` (megatron's ``SequentialMLP`` layout, grouped GEMMs) and an optional shared
    expert."""
    _define_missing_te_gemm()
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=GroupedSequentialMLP, submodules=linears),
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=linears),
            router=MegatronTopKRouter,
        ),
        metainfo={"fuse_pre_mlp_layernorm": False},
    )


def _mark_missing_te_for_mla() -> None:
    """megatron-core 0.16.1's MLA module imports its TransformerEngine wrappers even without TE (they are then mocks,
    not classes), so it believes TE present and every MLA build fails on ``isinstance(..., TELinear)``. Without TE,
    tell it so (it then takes its own torch path); with TE this changes nothing."""
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine_available():
        multi_latent_attention.HAVE_TE = False


def local_mla_spec(kernels: Mapping[str, str] | None = None) -> ModuleSpec:
    """megatron's ``MLASelfAttention`` from its own linears, DeepSeek's latent norms and SDPA core attention (query and
    key heads of ``qk_nope_head_dim + qk_rope_head_dim``, value heads of ``v_head_dim``).

    The query and key/value down projections are megatron's replicated ``Linear`` (the local counterpart of TE's
    ``duplicated`` linear in megatron's TE spec), not the column-parallel ones of megatron's local MLA spec: those
    all-gather their outputs, and the gather's backward keeps each TP rank's own slice of the gradient, but the
    rotary key (one key shared by every head) gets on each rank the gradient of that rank's heads only, so the
    rotary rows of ``linear_kv_down_proj`` (and the hidden states' gradient through them) would miss the other
    ranks' heads. Replicated under sequence parallelism, each rank projects its own tokens, megatron all-gathers the
    rotary key over the sequence and that gather's backward (a reduce-scatter) sums every head's gradient; the
    weights' gradients are summed over the TP ranks (their ``sequence_parallel`` tag). The up projections are split
    by heads (column-parallel), the output projection row-parallel.

    Args:
        kernels: the ``rms_norm`` / ``rope`` kernel choices (``performance.kernels``; default ``auto``).
    """
    from megatron.core.post_training.modelopt.layers import Linear

    _mark_missing_te_for_mla()
    latent_norm = _with_kernels(LatentRMSNorm, kernels)
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=Linear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=Linear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=_with_kernels(SDPACoreAttention, kernels),
            linear_proj=RowParallelLinear,
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
        ),
    )


def local_layer_spec(
    qk_norm: bool, *, moe: bool = False, mla: bool = False, kernels: Mapping[str, str] | None = None
) -> ModuleSpec:
    """The decoder layer from megatron's parallel linears with :class:`MegatronRMSNorm` and SDPA attention.

    Args:
        qk_norm: per-head RMSNorm on queries and keys (Qwen3).
        moe: a mixture-of-experts MLP (:func:`local_moe_spec`) instead of the dense one.
        mla: multi-latent attention (:func:`local_mla_spec`, DeepSeek-V3) instead of grouped-query attention.
        kernels: the ``rms_norm`` / ``rope`` kernel choices (``performance.kernels``; default ``auto``).
    """
    norm = _with_kernels(MegatronRMSNorm, kernels)
    qk = norm if qk_norm else IdentityOp
    gqa = ModuleSpec(
        module=FusedRopeSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=_with_kernels(SDPACoreAttention, kernels),
            linear_proj=RowParallelLinear,
            q_layernorm=qk,
            k_layernorm=qk,
        ),
    )
    attention = local_mla_spec(kernels) if mla else gqa
    mlp = (
        local_moe_spec()
        if moe
        else ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _with_kernels(module: type, kernels: Mapping[str, str] | None) -> ModuleSpec:
    """``module``'s spec with its kernel choice as a constructor argument (norms: ``rms_norm``, the core attention:
    ``rope``)."""
    kernels = kernels or {}
    if issubclass(module, SDPACoreAttention):
        return ModuleSpec(module=module, params={"rope_backend": kernels.get("rope", "auto")})
    return ModuleSpec(module=module, params={"backend": kernels.get("rms_norm", "auto")})


def gpt_decoder_spec(
    config: TransformerConfig,
    *,
    vp_stage: int | None = None,
    use_transformer_engine: bool | None = None,
    kernels: Mapping[str, str] | None = None,
) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage: one layer spec per layer it builds, and the final norm.

    TransformerEngine's spec when TE is importable (or forced), else :func:`local_layer_spec` with
    :class:`MegatronRMSNorm` as the final norm (megatron's default torch norm refuses sequence parallelism). With
    ``num_moe_experts`` set, layer ``i`` is a MoE layer where ``moe_layer_freq[i]`` (a per-layer list) is 1.
    Multi-latent attention always takes the local spec (TE's MLA spec fuses the latent norms into the up
    projections, with the model's epsilon and other weight names, and has not been run).

    Args:
        config: the transformer config (layer count, pipeline layout, ``qk_layernorm``, MoE layer pattern, MLA).
        vp_stage: virtual pipeline stage of the model chunk being built.
        use_transformer_engine: force the choice (``None``: TE when importable).
        kernels: the local spec's ``rms_norm`` / ``rope`` kernel choices (``performance.kernels``; default
            ``auto``: Triton on CUDA, torch elsewhere).

    Raises:
        NotImplementedError: ``use_transformer_engine=True`` with multi-latent attention.
    """
    mla = config.multi_latent_attention
    if use_transformer_engine and mla:
        raise NotImplementedError(
            "use_transformer_engine=True with multi-latent attention (DeepSeek-V3): the megatron twin builds MLA "
            "from the local layer spec only; leave use_transformer_engine unset"
        )
    use_te = transformer_engine_available() if use_transformer_engine is None else use_transformer_engine
    use_te = use_te and not mla
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    moe_layers = _moe_layer_pattern(config)[offset : offset + num_layers]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        specs = {
            moe: get_gpt_layer_with_transformer_engine_spec(
                num_experts=config.num_moe_experts if moe else None,
                moe_grouped_gemm=False,
                qk_layernorm=config.qk_layernorm,
            )
            for moe in set(moe_layers)
        }
        return TransformerBlockSubmodules(layer_specs=[specs[moe] for moe in moe_layers], layer_norm=TENorm)
    specs = {
        moe: local_layer_spec(config.qk_layernorm, moe=moe, mla=mla, kernels=kernels)
        for moe in set(moe_layers)
    }
    return TransformerBlockSubmodules(
        layer_specs=[specs[moe] for moe in moe_layers], layer_norm=_with_kernels(MegatronRMSNorm, kernels)
    )


def _moe_layer_pattern(config: TransformerConfig) -> list[bool]:
    """Whether each of the model's layers is a MoE layer (``moe_layer_freq``: a per-layer list or a period)."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(x) for x in freq]

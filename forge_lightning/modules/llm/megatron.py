"""The megatron-core twin of a decoder LM: its ``TransformerConfig``, its ``GPTModel`` and the HF weight mapping.

An :class:`LLMConfig` (Llama / Qwen2 / Qwen3 dense, Qwen2-MoE / Qwen3-MoE, DeepSeek-V3) maps onto megatron-core's GPT
as follows::

    HF (DecoderLM)                                   megatron-core GPTModel (per TP rank r of T, PP stage)
    model.embed_tokens.weight        [V, H]      ->  embedding.word_embeddings.weight   rows r*V/T ...   (first stage)
    model.layers.L.input_layernorm               ->  decoder.layers.l.input_layernorm                    (replicated)
    self_attn.{q,k,v}_proj  [nh*D|ng*D|ng*D, H]  ->  self_attention.linear_qkv   per group g: [q_g; k_g; v_g], the
                                                     groups g in [r*ng/T, (r+1)*ng/T) on rank r
    self_attn.o_proj                 [H, nh*D]   ->  self_attention.linear_proj          columns split
    self_attn.{q,k}_norm                         ->  self_attention.{q,k}_layernorm                      (replicated)
    post_attention_layernorm                     ->  pre_mlp_layernorm                                   (replicated)
    mlp.{gate,up}_proj                 [I, H]    ->  mlp.linear_fc1   [gate rows of rank r; up rows of rank r]
    mlp.down_proj                      [H, I]    ->  mlp.linear_fc2                      columns split
    model.norm.weight                            ->  decoder.final_layernorm                             (last stage)
    lm_head.weight (or the tied embedding)       ->  output_layer.weight                 rows split      (last stage)

  MoE layers (``config.is_moe_layer(L)``; megatron's ``MoELayer`` with ``SequentialMLP``-layout experts), on expert-parallel
  rank p of P with E experts (rank p holds experts ``e`` in ``[p*E/P, (p+1)*E/P)`` as ``local_experts.i``,
  ``i = e - p*E/P``; each expert is split over TP like a dense MLP)::

    mlp.gate.weight                    [E, H]    ->  mlp.router.weight                                   (replicated)
    mlp.experts.e.{gate,up}_proj       [I, H]    ->  mlp.experts.local_experts.i.linear_fc1   [gate; up] per TP rank
    mlp.experts.e.down_proj            [H, I]    ->  mlp.experts.local_experts.i.linear_fc2   columns split
    mlp.shared_expert.{gate,up,down}_proj        ->  mlp.shared_experts.linear_fc1 / linear_fc2          (Qwen2-MoE)
    mlp.shared_expert_gate.weight      [1, H]    ->  mlp.shared_experts.gate_weight                      (replicated)
    mlp.shared_experts.{gate,up,down}_proj       ->  mlp.shared_experts.linear_fc1 / linear_fc2        (DeepSeek-V3)
    mlp.gate.e_score_correction_bias   [E]       ->  mlp.router.expert_bias    a buffer, fp32            (replicated)

  Multi-latent attention (``config.mla``, DeepSeek-V3; megatron's ``MLASelfAttention``, an ``MLATransformerConfig``;
  nh heads, Q / K latent widths, N + R query/key and V value head sizes)::

    self_attn.q_a_proj                 [Q, H]    ->  self_attention.linear_q_down_proj                   (replicated)
    self_attn.q_a_layernorm                      ->  self_attention.q_layernorm                          (replicated)
    self_attn.q_b_proj          [nh*(N+R), Q]    ->  self_attention.linear_q_up_proj     rows split (heads)
    self_attn.q_proj            [nh*(N+R), H]    ->  self_attention.linear_q_proj        rows split (no query latent)
    self_attn.kv_a_proj_with_mqa     [K+R, H]    ->  self_attention.linear_kv_down_proj                  (replicated)
    self_attn.kv_a_layernorm                     ->  self_attention.kv_layernorm                         (replicated)
    self_attn.kv_b_proj          [nh*(N+V), K]   ->  self_attention.linear_kv_up_proj    rows split (heads)
    self_attn.o_proj                 [H, nh*V]   ->  self_attention.linear_proj          columns split

  The down projections are replicated, not split as in megatron's local MLA spec (see the strategy's layer spec):
  their gradients are then exact at TP > 1, which needs sequence parallelism. Both lay out heads as HF does
  (``[nope | rope]`` queries, ``[k_nope | v]`` up-projected keys / values); megatron de-interleaves the rotary dims
  (``rope_interleave=True``).

``L`` is the global layer index (``layer.layer_number - 1``), ``l`` the index within the stage's chunk. The layer
spec (which attention / norm modules fill the layer) is the caller's: strategies supply it, this module never
imports a strategy.

Router losses. The native model (as transformers) pools the load-balancing loss over all MoE layers,
``E * sum_e f_e * P_e``; megatron computes ``E / K * sum_e f_e * P_e`` per layer and adds the layers' losses. The
twin sets ``moe_aux_loss_coeff = aux_loss_coef * K / num_moe_layers`` and ``moe_z_loss_coeff = z_loss_coef /
num_moe_layers``, so megatron's router losses are the native coefficients times the *mean over layers* of each
layer's own loss: the z-loss is then the native one exactly, the load-balancing loss equal for one MoE layer and
otherwise not (per-layer mean instead of pooled; see docs/megatron.md). Both are per micro-batch, as natively.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.kernels import fused_linear_cross_entropy
from forge_lightning.modules.layers.rope import rope_inv_freq
from forge_lightning.modules.llm.config import LLMConfig

# Kinds of mapping between HF tensors and one TP rank's megatron shard.
REPLICATED, COLUMN, ROW, QKV, GATE_UP = "replicated", "column", "row", "qkv", "gate_up"


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """How one megatron parameter is made from Hugging Face tensors.

    Args:
        megatron: parameter name in the megatron model chunk.
        hf: the Hugging Face tensor name(s) it is made of.
        kind: ``replicated``, ``column`` (rows split over TP), ``row`` (columns split), ``qkv`` or ``gate_up``.
        expert: a routed expert's weight: held by one expert-parallel rank, split over the expert-TP group and
            replicated over expert-data-parallel ranks (instead of the TP group and data-parallel ranks).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str
    expert: bool = False


def check_supported(config: LLMConfig) -> None:
    """Raise ``NotImplementedError`` for configs the megatron twin cannot express exactly.

    megatron-core has one switch for the q/k/v bias (``add_qkv_bias``) and one for every linear's bias
    (``add_bias_linear``), so an output-projection bias without MLP biases (or the reverse) has no twin.
    """
    if config.mla is not None:
        _check_mla_supported(config)
    if config.moe is not None:
        _check_moe_supported(config)
    linear_biases = (config.o_proj_bias, config.mlp_bias)
    if linear_biases not in ((False, False), (True, True)) or (
        config.o_proj_bias and not config.attention_bias
    ):
        raise NotImplementedError(
            f"attention_bias={config.attention_bias}, o_proj_bias={config.o_proj_bias}, mlp_bias={config.mlp_bias} "
            "is not yet supported by the megatron twin (supported: no biases, q/k/v biases only, or all biases)"
        )


def _check_mla_supported(config: LLMConfig) -> None:
    if not config.mla.rope_interleave:
        raise NotImplementedError(
            "mla.rope_interleave=False (rotary dimensions stored as halves) is not supported by the megatron twin: "
            "megatron-core's multi-latent attention always de-interleaves them (DeepSeek's layout, "
            "rope_interleave=True)"
        )
    if config.attention_bias:
        raise NotImplementedError(
            "attention_bias=True with multi-latent attention is not supported by the megatron twin: megatron-core's "
            "MLA projections have no biases"
        )


def _check_moe_supported(config: LLMConfig) -> None:
    moe = config.moe
    if moe.num_experts_per_tok == 1 and moe.norm_topk_prob:
        raise NotImplementedError(
            "moe.num_experts_per_tok=1 with moe.norm_topk_prob=True (every weight 1) has no megatron-core router "
            "(its top-1 routing keeps the expert's score)"
        )
    if moe.score_func == "sigmoid":
        _check_sigmoid_routing(moe)
    if config.mlp_bias:
        raise NotImplementedError(
            "mlp_bias=True with moe is not supported by the megatron twin (no expert biases)"
        )


def _check_sigmoid_routing(moe: Any) -> None:
    """Refuse the sigmoid-routing variants megatron-core's router computes differently from DeepSeek-V3's."""
    k, groups, per_tok = moe.num_experts_per_tok, moe.num_groups, moe.num_groups_per_tok
    if k > 1 and not moe.norm_topk_prob:
        raise NotImplementedError(
            "moe.score_func='sigmoid' with moe.norm_topk_prob=False is not supported by the megatron twin: "
            "megatron-core always renormalises the chosen sigmoid scores of top-k routing (k > 1)"
        )
    if groups > 1 and k // per_tok != 2:
        raise NotImplementedError(
            f"moe.num_groups ({groups}) > 1 with moe.num_experts_per_tok ({k}) // moe.num_groups_per_tok "
            f"({per_tok}) = {k // per_tok} is not supported by the megatron twin: megatron-core ranks an expert "
            "group by the sum of its top num_experts_per_tok // num_groups_per_tok scores, DeepSeek-V3 by its top 2; "
            "they agree when the quotient is 2 (DeepSeek-V3: 8 // 4)"
        )
    if moe.aux_loss_coef:
        raise NotImplementedError(
            f"moe.aux_loss_coef ({moe.aux_loss_coef}) > 0 with sigmoid routing is not supported by the megatron "
            "twin: megatron-core counts the experts' tokens for the load-balancing loss by a plain top-k of the "
            "scores, without the selection bias and group limit the routing uses (natively: the routed tokens). "
            "DeepSeek-V3 balances its experts with the selection bias (aux_loss_coef 0)"
        )


def _moe_fields(config: LLMConfig, shards: int) -> dict[str, Any]:
    """``TransformerConfig`` fields of the MoE layers (see the module docstring for the router-loss scaling).

    With ``calculate_per_token_loss`` megatron-core 0.16.1 scales each router loss by the tokens its rank routed, then
    divides every gradient by the global batch's tokens; under sequence parallelism (TP) and context parallelism
    (CP) a rank routes ``1 / shards`` of a micro-batch's tokens (``shards = tp * cp``, megatron's TP x CP group), so
    the router losses would count ``1 / shards`` of their weight: the coefficients are multiplied by ``shards`` to
    undo it (measured against the native model in tests/megatron/test_moe.py and test_context_parallel.py).
    """
    moe = config.moe
    num_moe_layers = config.num_moe_layers
    if not num_moe_layers:
        return {}
    aux = moe.aux_loss_coef * moe.num_experts_per_tok / num_moe_layers * shards
    z_loss = moe.z_loss_coef / num_moe_layers * shards
    scaling = None if moe.routed_scaling_factor == 1.0 else moe.routed_scaling_factor
    sigmoid = moe.score_func == "sigmoid"
    groups = moe.num_groups if moe.num_groups > 1 else None
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.intermediate_size,
        moe_layer_freq=[int(config.is_moe_layer(i)) for i in range(config.num_layers)],
        moe_router_topk=moe.num_experts_per_tok,
        moe_router_score_function=moe.score_func,
        # Softmax over all experts, then top-k (norm_topk_prob=False); megatron's default (top-k of the logits,
        # then a softmax over those k) gives the renormalised top-k probabilities (norm_topk_prob=True). Sigmoid
        # scores of top-k > 1 are always renormalised (see _check_sigmoid_routing).
        moe_router_pre_softmax=not moe.norm_topk_prob and not sigmoid,
        moe_router_topk_scaling_factor=scaling,
        # DeepSeek-V3: group-limited top-k, experts chosen by score + selection bias (`mlp.router.expert_bias`,
        # fp32), weighted by the unbiased scores; logits in fp32 as natively. megatron's aux-loss-free update of
        # the bias (in its gradient finalisation: the step's routed tokens all-reduced over TP x CP x DP, then
        # bias += rate * sign(mean - load)) is the native moe.bias_update_rate's.
        moe_router_num_groups=groups,
        moe_router_group_topk=moe.num_groups_per_tok if groups else None,
        moe_router_enable_expert_bias=sigmoid,
        moe_router_bias_update_rate=moe.bias_update_rate,
        moe_router_dtype="fp32" if sigmoid else None,
        moe_shared_expert_intermediate_size=moe.shared_intermediate_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=z_loss or None,
        # No token dropping; all-to-all dispatch over the expert-parallel group; megatron's grouped-GEMM experts
        # need TransformerEngine or the grouped_gemm package (the layer spec groups SequentialMLP's itself).
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def transformer_config(config: LLMConfig, **parallel: Any) -> Any:
    """megatron-core's ``TransformerConfig`` of ``config``.

    Fusions that need TransformerEngine or Apex are off; the loss is a per-token sum normalised by the schedule
    (``calculate_per_token_loss``), which is what the one batch rule needs.

    Args:
        config: the decoder's configuration.
        **parallel: further ``TransformerConfig`` fields (``tensor_model_parallel_size``,
            ``pipeline_model_parallel_size``, ``sequence_parallel``, ``params_dtype``, ``bf16`` ...); they
            override the defaults set here (e.g. ``use_cpu_initialization``).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_supported(config)
    tp = parallel.get("tensor_model_parallel_size", 1)
    cp = parallel.get("context_parallel_size", 1)
    moe = _moe_fields(config, tp * cp) if config.moe is not None else {}
    if (moe or config.mla is not None) and tp > 1 and not parallel.get("sequence_parallel", False):
        # MoE, as megatron-LM requires: without it every TP rank routes the same tokens and megatron's router
        # losses count each token once per TP rank. MLA: the rotary key's gradient is summed over the TP ranks'
        # heads by the sequence all-gather's backward, and megatron sums the latent norms' gradients over TP.
        raise ValueError(
            f"tensor_model_parallel_size ({tp}) with a mixture-of-experts model or multi-latent attention needs "
            "sequence_parallel=True (as megatron-core's MoE and MLA layers expect)"
        )
    cls, mla = (TransformerConfig, {}) if config.mla is None else (MLATransformerConfig, _mla_fields(config))
    fields = dict(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_heads,
        num_query_groups=config.num_kv_heads,
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=config.mlp_bias,
        add_qkv_bias=config.attention_bias,
        qk_layernorm=config.qk_norm or config.mla is not None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=config.initializer_range,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,
        **mla,
        **moe,
    )
    return cls(**{**fields, **parallel})


def _mla_fields(config: LLMConfig) -> dict[str, Any]:
    """``MLATransformerConfig`` fields of multi-latent attention (DeepSeek-V3).

    Plain RoPE on the ``qk_rope_head_dim`` rotary part, whose frequencies :func:`build_gpt_model` replaces with
    forge's own (plain, linear or llama3-scaled; YaRN is not a rope type of the native model), and no YaRN mscale:
    the softmax scale is ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, as natively. megatron de-interleaves the
    rotary dimensions of queries and keys (``rope_interleave=True``, checked by :func:`check_supported`).
    """
    m = config.mla
    return dict(
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type="rope",
        rotary_base=config.rope_theta,
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
    )


def build_gpt_model(
    config: LLMConfig,
    tf_config: Any,
    decoder_spec: Any,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    z_loss: float = 0.0,
    loss_backend: str | None = None,
) -> nn.Module:
    """Build one megatron-core ``GPTModel`` chunk (this rank's TP shard of one pipeline stage).

    RoPE frequencies (plain, linear or llama3-scaled) are those of forge's own model, so the twin computes the
    same function as :class:`~forge_lightning.modules.llm.model.DecoderLM`; the chunk is a
    :func:`forge_gpt_model_class`, whose RoPE follows ``position_ids`` and whose per-token loss adds the z-loss.

    Args:
        config: the decoder's configuration.
        tf_config: its ``TransformerConfig`` (see :func:`transformer_config`).
        decoder_spec: the layer spec or decoder block spec to build the layers from.
        pre_process: this chunk holds the embedding (first stage).
        post_process: this chunk holds the final norm and output layer (last stage).
        vp_stage: virtual pipeline stage of this chunk.
        z_loss: weight of the z-loss (``z_loss * logsumexp(logits)^2`` per token) in the per-token loss, as
            ``CausalLM``'s.
        loss_backend: at tensor-parallel size 1, the per-token loss is forge's fused linear + cross-entropy
            with this backend (``auto``, ``triton`` or ``torch``; see
            :func:`~forge_lightning.kernels.fused_linear_cross_entropy`), which never builds the fp32 logits;
            ``None``, or vocabulary split over TP ranks: megatron's output layer and cross-entropy.
    """
    tp = tf_config.tensor_model_parallel_size
    if config.vocab_size % tp:
        raise ValueError(
            f"vocab_size ({config.vocab_size}) must be divisible by tensor_model_parallel_size ({tp}): megatron "
            "splits the embedding and output layer by rows, and padding them would change the softmax"
        )
    model = forge_gpt_model_class()(
        config=tf_config,
        transformer_layer_spec=decoder_spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(config.rope_theta),
        vp_stage=vp_stage,
    )
    # With MLA each layer's attention has its own rotary embedding (of a head's rotary part), the model none.
    if config.mla is None:
        rotaries = [model.rotary_pos_emb]
    else:
        rotaries = [layer.self_attention.rotary_pos_emb for layer in model.decoder.layers]
    for rotary in rotaries:
        rotary.inv_freq = rope_inv_freq(config.rope_head_dim, config.rope_theta, config.rope_scaling)
    model.z_loss = z_loss
    model.loss_backend = loss_backend if tp == 1 else None
    return model


@functools.cache
def forge_gpt_model_class() -> type:
    """megatron's ``GPTModel`` with two native behaviours (a function: megatron is imported on first use).

    * **RoPE at** ``position_ids``: megatron's rotary embedding always covers positions ``0..s-1``; given
      ``position_ids`` ``[b, s]`` (packed rows: restarting at every document, see
      :func:`~forge_lightning.modules.layers.attention.document_positions`) the twin rotates each token by its own
      position, from megatron's table of the same frequencies (``[s, b, 1, dim]``; under context parallelism this
      rank's chunks of it, as megatron cuts its own). MLA rotates inside each layer: not covered (refused upstream).
    * **z-loss**: ``z_loss * logsumexp(logits)^2`` added to every token's cross-entropy, the logsumexp taken over
      the whole vocabulary across the TP ranks' shards (:func:`vocab_parallel_logsumexp`).
    * **Fused loss** (``loss_backend`` set, TP = 1): training and evaluation losses come from forge's fused
      linear + cross-entropy over the final hidden states and the output weight (the embedding when tied), in
      chunks of tokens, never materialising the ``[s, b, vocab]`` logits and their fp32 copies; the same
      per-token values (z-loss included) as megatron's output layer + cross-entropy (both round the logit GEMM's
      output to the parameters' dtype, then take the softmax in fp32).
    """
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
    from megatron.core.models.gpt import GPTModel

    class ForgeGPTModel(GPTModel):
        z_loss: float = 0.0
        loss_backend: str | None = None

        def _postprocess(self, hidden_states: Tensor, input_ids: Tensor, position_ids: Tensor, labels: Tensor,
                         *args: Any, **kwargs: Any) -> Tensor:  # fmt: skip
            plain = (
                self.loss_backend is None
                or labels is None
                or not self.post_process
                or kwargs.get("mtp_in_postprocess")
                or self.config.mtp_num_layers is not None
                or kwargs.get("inference_context") is not None
                or kwargs.get("inference_params") is not None
            )
            if plain:
                return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
            weight = (
                self.shared_embedding_or_output_weight()
                if self.share_embeddings_and_output_weights
                else self.output_layer.weight
            )
            S, B, _ = hidden_states.shape
            # Tokens in [s, b] order, as the hidden states are laid out: no copy of them.
            loss_SB = fused_linear_cross_entropy(
                hidden_states.reshape(S * B, -1),
                weight,
                labels.t().reshape(S * B),
                reduction="none",
                z_loss=self.z_loss,
                backend=self.loss_backend,
            )
            return loss_SB.view(S, B).t()

        def _preprocess(
            self, input_ids: Tensor, position_ids: Tensor | None, *args: Any, **kwargs: Any
        ) -> tuple:
            out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
            if position_ids is None or out[1] is None:  # default positions, or no model-level RoPE (MLA)
                return out
            rotary = self.rotary_pos_emb
            table_PD = rotary.get_emb(int(position_ids.max()) + 1)[:, 0, 0]  # [positions, dim]
            emb_SB1D = table_PD[position_ids.t()][:, :, None]
            cp_group = rotary.cp_group
            if cp_group is not None and cp_group.size() > 1:
                emb_SB1D = get_pos_emb_on_this_cp_rank(emb_SB1D, 0, cp_group)
            return (out[0], emb_SB1D, *out[2:])

        def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
            if not self.z_loss:
                return super().compute_language_model_loss(labels, logits)
            # Before megatron's cross-entropy, which works on fp32 logits in place.
            lse_BS = vocab_parallel_logsumexp(logits).t()
            return super().compute_language_model_loss(labels, logits) + self.z_loss * lse_BS.square()

    return ForgeGPTModel


def vocab_parallel_logsumexp(logits_SBV: Tensor) -> Tensor:
    """``logsumexp`` ``[s, b]`` (fp32) over the whole vocabulary of logits split by vocabulary over the TP ranks.

    Differentiable: the shards' sums of exponentials are all-reduced (backward: each rank's own gradient). Keeps
    no reference to ``logits`` for backward, so megatron's cross-entropy may then overwrite them in place.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x_SBV = logits_SBV.float()
    max_SB = x_SBV.detach().amax(dim=-1)  # the shift cancels in the value and the gradient
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        torch.distributed.all_reduce(max_SB, op=torch.distributed.ReduceOp.MAX, group=group)
    sum_SB = reduce_from_tensor_model_parallel_region((x_SBV - max_SB[..., None]).exp().sum(dim=-1))
    return max_SB + sum_SB.log()


# ----------------------------------------------------------------------------------------------- weight rules


def weight_rules(model: nn.Module, config: LLMConfig) -> Iterator[WeightRule]:
    """The rule of every parameter of one megatron model chunk (any TP rank, any pipeline stage).

    Args:
        model: a ``GPTModel`` chunk built by :func:`build_gpt_model` (may be wrapped, e.g. by megatron's DDP).
        config: the decoder's configuration.
    """
    gpt = unwrap(model)
    if gpt.pre_process:
        yield WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), COLUMN)
    for i, layer in enumerate(gpt.decoder.layers):
        yield from _layer_rules(f"decoder.layers.{i}.", layer, config)
    if gpt.post_process:
        yield WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED)
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        if not (config.tie_word_embeddings and gpt.pre_process):  # one stage: the output layer has no weight
            yield WeightRule("output_layer.weight", (head,), COLUMN)


def _layer_rules(m: str, layer: nn.Module, config: LLMConfig) -> Iterator[WeightRule]:
    index = layer.layer_number - 1
    h = f"model.layers.{index}."
    attn = f"{h}self_attn."
    yield WeightRule(f"{m}input_layernorm.weight", (f"{h}input_layernorm.weight",), REPLICATED)
    yield WeightRule(f"{m}pre_mlp_layernorm.weight", (f"{h}post_attention_layernorm.weight",), REPLICATED)
    if config.mla is not None:
        yield from _mla_rules(f"{m}self_attention.", attn, config)
    else:
        yield from _attention_rules(f"{m}self_attention.", attn, config)
    if config.is_moe_layer(index):
        yield from _moe_rules(f"{m}mlp.", f"{h}mlp.", layer.mlp, config)
    else:
        yield from _mlp_rules(f"{m}mlp.", f"{h}mlp.", bias=config.mlp_bias)


def _attention_rules(m: str, attn: str, config: LLMConfig) -> Iterator[WeightRule]:
    """Grouped-query attention: fused QKV, output projection, their biases and the q/k norms."""
    qkv = tuple(f"{attn}{p}_proj.weight" for p in "qkv")
    yield WeightRule(f"{m}linear_qkv.weight", qkv, QKV)
    yield WeightRule(f"{m}linear_proj.weight", (f"{attn}o_proj.weight",), ROW)
    if config.attention_bias:
        yield WeightRule(f"{m}linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), QKV)
    if config.o_proj_bias:
        yield WeightRule(f"{m}linear_proj.bias", (f"{attn}o_proj.bias",), REPLICATED)
    if config.qk_norm:
        yield WeightRule(f"{m}q_layernorm.weight", (f"{attn}q_norm.weight",), REPLICATED)
        yield WeightRule(f"{m}k_layernorm.weight", (f"{attn}k_norm.weight",), REPLICATED)


def _mla_rules(m: str, attn: str, config: LLMConfig) -> Iterator[WeightRule]:
    """Multi-latent attention: the down projections and latent norms whole on every TP rank, the up projections
    split by heads (rows), the output projection by heads (columns)."""
    if config.mla.q_lora_rank is None:
        yield WeightRule(f"{m}linear_q_proj.weight", (f"{attn}q_proj.weight",), COLUMN)
    else:
        yield WeightRule(f"{m}linear_q_down_proj.weight", (f"{attn}q_a_proj.weight",), REPLICATED)
        yield WeightRule(f"{m}q_layernorm.weight", (f"{attn}q_a_layernorm.weight",), REPLICATED)
        yield WeightRule(f"{m}linear_q_up_proj.weight", (f"{attn}q_b_proj.weight",), COLUMN)
    yield WeightRule(f"{m}linear_kv_down_proj.weight", (f"{attn}kv_a_proj_with_mqa.weight",), REPLICATED)
    yield WeightRule(f"{m}kv_layernorm.weight", (f"{attn}kv_a_layernorm.weight",), REPLICATED)
    yield WeightRule(f"{m}linear_kv_up_proj.weight", (f"{attn}kv_b_proj.weight",), COLUMN)
    yield WeightRule(f"{m}linear_proj.weight", (f"{attn}o_proj.weight",), ROW)


def _mlp_rules(m: str, h: str, *, bias: bool = False, expert: bool = False) -> Iterator[WeightRule]:
    """A SwiGLU MLP's rules: megatron ``linear_fc1`` / ``linear_fc2`` from HF ``gate_proj``, ``up_proj``, ``down_proj``."""
    yield WeightRule(f"{m}linear_fc1.weight", (f"{h}gate_proj.weight", f"{h}up_proj.weight"), GATE_UP, expert)
    yield WeightRule(f"{m}linear_fc2.weight", (f"{h}down_proj.weight",), ROW, expert)
    if bias:
        yield WeightRule(f"{m}linear_fc1.bias", (f"{h}gate_proj.bias", f"{h}up_proj.bias"), GATE_UP)
        yield WeightRule(f"{m}linear_fc2.bias", (f"{h}down_proj.bias",), REPLICATED)


def _moe_rules(m: str, h: str, moe_layer: nn.Module, config: LLMConfig) -> Iterator[WeightRule]:
    """A MoE layer's rules: the router (and its selection bias, a buffer), this expert-parallel rank's experts and
    the shared expert."""
    yield WeightRule(f"{m}router.weight", (f"{h}gate.weight",), REPLICATED)
    if config.moe.score_func == "sigmoid":
        yield WeightRule(f"{m}router.expert_bias", (f"{h}gate.e_score_correction_bias",), REPLICATED)
    # `local_expert_indices`: the global indices of the experts this expert-parallel rank holds, in order.
    for i, e in enumerate(moe_layer.local_expert_indices):
        yield from _mlp_rules(f"{m}experts.local_experts.{i}.", f"{h}experts.{e}.", expert=True)
    if config.moe.shared_intermediate_size:
        shared = "shared_expert" if config.moe.shared_expert_gate else "shared_experts"
        yield from _mlp_rules(f"{m}shared_experts.", f"{h}{shared}.")
        if config.moe.shared_expert_gate:
            yield WeightRule(f"{m}shared_experts.gate_weight", (f"{h}shared_expert_gate.weight",), REPLICATED)


def unwrap(model: nn.Module) -> nn.Module:
    """The ``GPTModel`` inside megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def named_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The tensors the weight rules fill, by megatron name: the chunk's parameters and buffers (a DeepSeek-V3
    router's selection bias, ``mlp.router.expert_bias``, is a buffer)."""
    gpt = unwrap(model)
    return {**dict(gpt.named_buffers()), **dict(gpt.named_parameters())}


# ------------------------------------------------------------------------------------------ HF -> TP shard


def shard_for_rank(
    rule: WeightRule, tensors: list[Tensor], config: LLMConfig, rank: int, size: int
) -> Tensor:
    """This TP rank's megatron shard of ``rule``'s parameter, from the full Hugging Face tensors.

    Args:
        rule: the parameter's rule.
        tensors: the full HF tensors named by ``rule.hf``, in that order.
        config: the decoder's configuration.
        rank: tensor-parallel rank.
        size: tensor-parallel size.
    """
    if rule.kind == REPLICATED:
        return tensors[0]
    if rule.kind == COLUMN:
        return tensors[0].chunk(size, dim=0)[rank]
    if rule.kind == ROW:
        return tensors[0].chunk(size, dim=-1)[rank]
    if rule.kind == GATE_UP:
        gate, up = (t.chunk(size, dim=0)[rank] for t in tensors)
        return torch.cat([gate, up], dim=0)  # [2 * I / T, ...]: megatron's GLU splits fc1's output in halves
    return _fused_qkv(*tensors, config).chunk(size, dim=0)[rank]


def _fused_qkv(q: Tensor, k: Tensor, v: Tensor, config: LLMConfig, groups: int | None = None) -> Tensor:
    """megatron's fused QKV rows: for each key/value group, its query heads, then its key, then its value.

    ``groups``: the key/value groups ``q``, ``k``, ``v`` hold (default: all of them, ``config.num_kv_heads``).
    """
    groups, d = groups or config.num_kv_heads, config.head_dim
    per_group = config.num_heads // config.num_kv_heads
    q_G = q.reshape(groups, per_group * d, *q.shape[1:])  # [ng, heads/group * D, (H)]
    k_G = k.reshape(groups, d, *k.shape[1:])  # [ng, D, (H)]
    v_G = v.reshape(groups, d, *v.shape[1:])
    return torch.cat([q_G, k_G, v_G], dim=1).reshape(-1, *q.shape[1:])  # [ng * (heads/group + 2) * D, (H)]


def _chunk_range(n: int, size: int, rank: int) -> slice:
    """The indices of ``torch.arange(n).chunk(size)[rank]`` as a slice (chunks of ``ceil(n / size)``)."""
    step = -(-n // size)
    start = min(rank * step, n)
    return slice(start, min(start + step, n))


def shard_indices(
    rule: WeightRule, shapes: list[tuple[int, ...]], config: LLMConfig, rank: int, size: int
) -> list[tuple[slice, ...]]:
    """The part of each Hugging Face tensor of ``rule`` that this TP rank's shard is made of (see
    :func:`assemble_shard`): whole tensors (replicated), a block of rows (column, gate_up), of columns (row), or
    of the rows of this rank's key/value groups (qkv). ``shard_for_rank`` of the full tensors equals
    ``assemble_shard`` of these parts.

    Args:
        rule: the parameter's rule.
        shapes: the full shapes of the tensors named by ``rule.hf``, in that order.
        config: the decoder's configuration.
        rank: tensor-parallel rank.
        size: tensor-parallel size.
    """
    if rule.kind == REPLICATED:
        return [()]
    if rule.kind in (COLUMN, GATE_UP):
        return [(_chunk_range(shape[0], size, rank),) for shape in shapes]
    if rule.kind == ROW:
        shape = shapes[0]
        return [(slice(None),) * (len(shape) - 1) + (_chunk_range(shape[-1], size, rank),)]
    groups, d = config.num_kv_heads, config.head_dim
    if groups % size:
        raise ValueError(
            f"{rule.megatron}: num_kv_heads ({groups}) must be divisible by tensor_model_parallel_size ({size})"
        )
    g = _chunk_range(groups, size, rank)  # this rank's key/value groups
    per_group = config.num_heads // groups
    return [
        (slice(g.start * per_group * d, g.stop * per_group * d),),
        (slice(g.start * d, g.stop * d),),
        (slice(g.start * d, g.stop * d),),
    ]


def assemble_shard(rule: WeightRule, parts: list[Tensor], config: LLMConfig, size: int) -> Tensor:
    """This TP rank's megatron shard of ``rule``'s parameter from the parts :func:`shard_indices` names."""
    if rule.kind == GATE_UP:
        return torch.cat(parts, dim=0)  # [gate rows of rank r; up rows of rank r]
    if rule.kind == QKV:
        return _fused_qkv(*parts, config, groups=config.num_kv_heads // size)
    return parts[0]


@torch.no_grad()
def load_hf_weights(
    model: nn.Module,
    config: LLMConfig,
    read: Callable[[str], Tensor],
    tp_rank: int,
    tp_size: int,
    *,
    expert_tp: tuple[int, int] | None = None,
) -> None:
    """Fill one megatron model chunk from Hugging Face tensors; ``read`` is called only for the tensors it needs.

    Args:
        model: a chunk built by :func:`build_gpt_model` (or wrapped by megatron's DDP).
        config: the decoder's configuration.
        read: returns the full HF tensor of a name (e.g. from a safetensors file or a state dict).
        tp_rank: this process's tensor-parallel rank.
        tp_size: tensor-parallel size.
        expert_tp: (rank, size) in the expert-tensor-parallel group, which splits the routed experts (default:
            ``tp_rank``, ``tp_size``; megatron's default expert TP size is the TP size).

    Raises:
        ValueError: a shard's shape differs from the parameter's (names both), or a parameter has no rule.
    """
    params = named_tensors(model)
    filled = set()
    for rule in weight_rules(model, config):
        rank, size = expert_tp if rule.expert and expert_tp is not None else (tp_rank, tp_size)
        shard = shard_for_rank(rule, [read(name) for name in rule.hf], config, rank, size)
        param = params[rule.megatron]
        if shard.shape != param.shape:
            raise ValueError(
                f"{rule.megatron}: shard of {rule.hf} has shape {tuple(shard.shape)}, parameter {tuple(param.shape)}"
            )
        param.copy_(shard)
        filled.add(rule.megatron)
    check_all_filled(model, filled)


def check_all_filled(model: nn.Module, filled: set[str]) -> None:
    """Raise ``ValueError`` naming the chunk's parameters outside ``filled``: a parameter no weight rule fills
    would silently keep megatron's random initialisation."""
    unfilled = sorted({name for name, _ in unwrap(model).named_parameters()} - filled)
    if unfilled:
        raise ValueError(f"megatron parameters without a Hugging Face weight rule: {unfilled}")


# ------------------------------------------------------------------------------------------ TP shards -> HF


def merge_shards(rule: WeightRule, shards: list[Tensor], config: LLMConfig) -> dict[str, Tensor]:
    """The full Hugging Face tensors of ``rule`` from the shards of every TP rank (in rank order).

    Args:
        rule: the parameter's rule.
        shards: the parameter on TP ranks ``0 .. T-1``.
        config: the decoder's configuration.
    """
    if rule.kind == REPLICATED:
        return {rule.hf[0]: shards[0]}
    if rule.kind == COLUMN:
        return {rule.hf[0]: torch.cat(shards, dim=0)}
    if rule.kind == ROW:
        return {rule.hf[0]: torch.cat(shards, dim=-1)}
    if rule.kind == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return {rule.hf[0]: torch.cat([g for g, _ in halves]), rule.hf[1]: torch.cat([u for _, u in halves])}
    groups, d = config.num_kv_heads, config.head_dim
    per_group = config.num_heads // groups
    fused = torch.cat(shards, dim=0).reshape(groups, (per_group + 2) * d, *shards[0].shape[1:])
    q, k, v = fused.split([per_group * d, d, d], dim=1)
    rest = shards[0].shape[1:]
    return {
        rule.hf[0]: q.reshape(-1, *rest),
        rule.hf[1]: k.reshape(-1, *rest),
        rule.hf[2]: v.reshape(-1, *rest),
    }

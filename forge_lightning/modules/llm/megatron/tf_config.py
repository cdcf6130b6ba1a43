"""megatron-core's ``TransformerConfig`` of an :class:`~forge_lightning.modules.llm.config.LLMConfig`, and the
architectures the twin cannot express (refused with the reason).

Router losses. The native model (as transformers) pools the load-balancing loss over all MoE layers,
``E * sum_e f_e * P_e``; megatron computes ``E / K * sum_e f_e * P_e`` per layer and adds the layers' losses. The
twin sets ``moe_aux_loss_coeff = aux_loss_coef * K / num_moe_layers`` and ``moe_z_loss_coeff = z_loss_coef /
num_moe_layers``, so megatron's router losses are the native coefficients times the *mean over layers* of each
layer's own loss: the z-loss is then the native one exactly, the load-balancing loss equal for one MoE layer and
otherwise not (per-layer mean instead of pooled; see docs/megatron.md). Both are per micro-batch, as natively.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from forge_lightning.modules.llm.config import LLMConfig


def check_supported(config: LLMConfig) -> None:
    """Raise ``NotImplementedError`` for configs the megatron twin cannot express exactly.

    megatron-core has one switch for the q/k/v bias (``add_qkv_bias``) and one for every linear's bias
    (``add_bias_linear``), so an output-projection bias without MLP biases (or the reverse) has no twin.
    """
    if config.num_nextn_predict_layers:
        raise NotImplementedError(
            f"num_nextn_predict_layers ({config.num_nextn_predict_layers}) (multi-token prediction) is not yet "
            "supported by the megatron twin: train MTP with FSDP2Strategy or DDPStrategy, or set it to 0"
        )
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

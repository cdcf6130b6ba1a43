"""The megatron-core twin of a decoder LM: its ``TransformerConfig``, its ``GPTModel`` and the HF weight mapping.

An :class:`LLMConfig` (Llama / Qwen2 / Qwen3 dense) maps onto megatron-core's GPT as follows::

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

``L`` is the global layer index (``layer.layer_number - 1``), ``l`` the index within the stage's chunk. The layer
spec (which attention / norm modules fill the layer) is the caller's: strategies supply it, this module never
imports a strategy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str


def check_supported(config: LLMConfig) -> None:
    """Raise ``NotImplementedError`` for configs the megatron twin cannot express exactly.

    megatron-core has one switch for the q/k/v bias (``add_qkv_bias``) and one for every linear's bias
    (``add_bias_linear``), so an output-projection bias without MLP biases (or the reverse) has no twin.
    """
    if config.moe is not None or config.mla is not None:
        raise NotImplementedError(
            f"{config.architecture}: mixture-of-experts and multi-latent attention models are not yet built on "
            "megatron-core by the twin; train them with a native strategy (fsdp2, ddp, zero1)"
        )
    linear_biases = (config.o_proj_bias, config.mlp_bias)
    if linear_biases not in ((False, False), (True, True)) or (
        config.o_proj_bias and not config.attention_bias
    ):
        raise NotImplementedError(
            f"attention_bias={config.attention_bias}, o_proj_bias={config.o_proj_bias}, mlp_bias={config.mlp_bias} "
            "is not yet supported by the megatron twin (supported: no biases, q/k/v biases only, or all biases)"
        )


def transformer_config(config: LLMConfig, **parallel: Any) -> Any:
    """megatron-core's ``TransformerConfig`` of ``config``.

    Fusions that need TransformerEngine or Apex are off; the loss is a per-token sum normalised by the schedule
    (``calculate_per_token_loss``), which is what the one batch rule needs.

    Args:
        config: the decoder's configuration.
        **parallel: further ``TransformerConfig`` fields (``tensor_model_parallel_size``,
            ``pipeline_model_parallel_size``, ``sequence_parallel``, ``params_dtype``, ``bf16`` ...).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_supported(config)
    return TransformerConfig(
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
        qk_layernorm=config.qk_norm,
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
        **parallel,
    )


def build_gpt_model(
    config: LLMConfig,
    tf_config: Any,
    decoder_spec: Any,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
) -> nn.Module:
    """Build one megatron-core ``GPTModel`` chunk (this rank's TP shard of one pipeline stage).

    RoPE frequencies (plain, linear or llama3-scaled) are those of forge's own model, so the twin computes the
    same function as :class:`~forge_lightning.modules.llm.model.DecoderLM`.

    Args:
        config: the decoder's configuration.
        tf_config: its ``TransformerConfig`` (see :func:`transformer_config`).
        decoder_spec: the layer spec or decoder block spec to build the layers from.
        pre_process: this chunk holds the embedding (first stage).
        post_process: this chunk holds the final norm and output layer (last stage).
        vp_stage: virtual pipeline stage of this chunk.
    """
    from megatron.core.models.gpt import GPTModel

    tp = tf_config.tensor_model_parallel_size
    if config.vocab_size % tp:
        raise ValueError(
            f"vocab_size ({config.vocab_size}) must be divisible by tensor_model_parallel_size ({tp}): megatron "
            "splits the embedding and output layer by rows, and padding them would change the softmax"
        )
    model = GPTModel(
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
    model.rotary_pos_emb.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return model


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
        yield from _layer_rules(f"decoder.layers.{i}.", f"model.layers.{layer.layer_number - 1}.", config)
    if gpt.post_process:
        yield WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED)
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        if not (config.tie_word_embeddings and gpt.pre_process):  # one stage: the output layer has no weight
            yield WeightRule("output_layer.weight", (head,), COLUMN)


def _layer_rules(m: str, h: str, config: LLMConfig) -> Iterator[WeightRule]:
    attn, mlp = f"{h}self_attn.", f"{h}mlp."
    yield WeightRule(f"{m}input_layernorm.weight", (f"{h}input_layernorm.weight",), REPLICATED)
    yield WeightRule(f"{m}pre_mlp_layernorm.weight", (f"{h}post_attention_layernorm.weight",), REPLICATED)
    qkv = tuple(f"{attn}{p}_proj.weight" for p in "qkv")
    yield WeightRule(f"{m}self_attention.linear_qkv.weight", qkv, QKV)
    yield WeightRule(f"{m}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), ROW)
    yield WeightRule(f"{m}mlp.linear_fc1.weight", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"), GATE_UP)
    yield WeightRule(f"{m}mlp.linear_fc2.weight", (f"{mlp}down_proj.weight",), ROW)
    if config.attention_bias:
        yield WeightRule(
            f"{m}self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), QKV
        )
    if config.o_proj_bias:
        yield WeightRule(f"{m}self_attention.linear_proj.bias", (f"{attn}o_proj.bias",), REPLICATED)
    if config.mlp_bias:
        gate_up = (f"{mlp}gate_proj.bias", f"{mlp}up_proj.bias")
        yield WeightRule(f"{m}mlp.linear_fc1.bias", gate_up, GATE_UP)
        yield WeightRule(f"{m}mlp.linear_fc2.bias", (f"{mlp}down_proj.bias",), REPLICATED)
    if config.qk_norm:
        yield WeightRule(f"{m}self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), REPLICATED)
        yield WeightRule(f"{m}self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), REPLICATED)


def unwrap(model: nn.Module) -> nn.Module:
    """The ``GPTModel`` inside megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


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


def _fused_qkv(q: Tensor, k: Tensor, v: Tensor, config: LLMConfig) -> Tensor:
    """megatron's fused QKV rows: for each key/value group, its query heads, then its key, then its value."""
    groups, d = config.num_kv_heads, config.head_dim
    per_group = config.num_heads // groups
    q_G = q.reshape(groups, per_group * d, *q.shape[1:])  # [ng, heads/group * D, (H)]
    k_G = k.reshape(groups, d, *k.shape[1:])  # [ng, D, (H)]
    v_G = v.reshape(groups, d, *v.shape[1:])
    return torch.cat([q_G, k_G, v_G], dim=1).reshape(-1, *q.shape[1:])  # [ng * (heads/group + 2) * D, (H)]


@torch.no_grad()
def load_hf_weights(
    model: nn.Module, config: LLMConfig, read: Callable[[str], Tensor], tp_rank: int, tp_size: int
) -> None:
    """Fill one megatron model chunk from Hugging Face tensors; ``read`` is called only for the tensors it needs.

    Args:
        model: a chunk built by :func:`build_gpt_model` (or wrapped by megatron's DDP).
        config: the decoder's configuration.
        read: returns the full HF tensor of a name (e.g. from a safetensors file or a state dict).
        tp_rank: this process's tensor-parallel rank.
        tp_size: tensor-parallel size.

    Raises:
        ValueError: a shard's shape differs from the parameter's (names both).
    """
    params = dict(unwrap(model).named_parameters())
    for rule in weight_rules(model, config):
        shard = shard_for_rank(rule, [read(name) for name in rule.hf], config, tp_rank, tp_size)
        param = params[rule.megatron]
        if shard.shape != param.shape:
            raise ValueError(
                f"{rule.megatron}: shard of {rule.hf} has shape {tuple(shard.shape)}, parameter {tuple(param.shape)}"
            )
        param.copy_(shard)


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

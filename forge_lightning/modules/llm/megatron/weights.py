"""The weight rules between a decoder LM's Hugging Face tensors and its megatron-core twin's parameters.

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
spec (which attention / norm modules fill the layer) is :mod:`~forge_lightning.modules.llm.megatron.layer_spec`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.megatron.gpt import named_tensors, unwrap

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
    groups, d = config.num_kv_heads, config.head_dim  # TP divides them: the plan's tp_dims, checked once
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

"""Shared by the MoE twin tests and their 2-process worker: tiny MoE configs, the native reference and the twin's run.

Both sides see the same weights (a seeded native ``DecoderLM``, router weights scaled up so that no token sits near
a routing tie) and the same micro-batches; each returns the loss parts and the gradients under Hugging Face names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.hf import split_experts
from forge_lightning.modules.llm.model import DecoderLM

# Qwen3-MoE (q/k norm, renormalised top-2 of 8, both layers MoE, no router losses); Qwen2-MoE (q/k/v bias,
# top-2 softmax probabilities kept, a shared expert with its sigmoid gate, layer 0 dense and layer 1 MoE, both
# router losses: with one MoE layer megatron's per-layer losses equal the native pooled ones); Qwen3-MoE with the
# load-balancing loss in both layers (pooled natively, per layer in megatron: compared on its own); DeepSeek-V3
# (multi-latent attention with a query latent, value heads narrower than query/key heads, linear RoPE scaling; layer 0
# dense, layer 1 with 16 sigmoid-routed experts in 4 groups of which a token uses 2, top-4, a random selection bias,
# routed_scaling_factor, an ungated shared expert; the z-loss); its variant without a query latent (q_proj), with
# llama3 RoPE scaling and top-1 sigmoid routing without groups or renormalisation.
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        moe=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=True)
    ),
    "qwen2_moe": dict(
        architecture="qwen2_moe",
        qk_norm=False,
        attention_bias=True,
        moe=dict(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            shared_intermediate_size=48,
            shared_expert_gate=True,
            layer_step=2,
            aux_loss_coef=0.01,
            z_loss_coef=0.001,
        ),
    ),
    "qwen3_moe_aux": dict(
        moe=dict(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            norm_topk_prob=True,
            aux_loss_coef=0.01,
        )
    ),
    "deepseek_v3": dict(
        architecture="deepseek_v3",
        qk_norm=False,
        num_kv_heads=4,
        head_dim=None,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        mla=dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12),
        moe=dict(
            num_experts=16,
            num_experts_per_tok=4,
            intermediate_size=32,
            score_func="sigmoid",
            norm_topk_prob=True,
            num_groups=4,
            num_groups_per_tok=2,
            routed_scaling_factor=2.5,
            shared_intermediate_size=32,
            first_dense_layers=1,
            z_loss_coef=0.001,
        ),
    ),
}
MOE_CONFIGS["deepseek_v3_plain"] = dict(
    MOE_CONFIGS["deepseek_v3"],
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8,
    ),
    mla=dict(MOE_CONFIGS["deepseek_v3"]["mla"], q_lora_rank=None),
    moe=dict(
        MOE_CONFIGS["deepseek_v3"]["moe"],
        num_experts_per_tok=1,
        norm_topk_prob=False,
        num_groups=1,
        num_groups_per_tok=1,
    ),
)


def moe_config(name: str) -> LLMConfig:
    return LLMConfig.from_preset("debug-moe", **MOE_CONFIGS[name])


def native_model(config: LLMConfig, seed: int = 0) -> DecoderLM:
    """A seeded fp32 native model with well-separated routing and non-trivial norms, biases and selection biases."""
    torch.manual_seed(seed)
    model = DecoderLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(25.0)  # router logits of std ~3: top-k choices far from ties
            elif name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: the selection changes with it
                buffer.normal_(0.0, 0.1)
    return model


def micro_batches(
    config: LLMConfig, count: int, size: int = 2, seq: int = 16
) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of ``size`` rows; every label is trainable (next token)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, config.vocab_size, (size, seq + 1), generator=g)
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def native_reference(model: DecoderLM, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Native loss parts and gradients over ``batches`` as one global batch (the one batch rule).

    The LM loss is the token mean over all batches; each micro-batch's weighted router losses count with its share
    of the tokens (the native mean over micro-batches / DP ranks, which is megatron's weighting when every token
    is trainable).
    """
    moe = model.config.moe
    model.zero_grad()
    total = sum(b["labels"].numel() for b in batches)
    lm_sum, router, aux, per_layer = 0.0, 0.0, [], []
    for b in batches:
        logits = model(b["input_ids"])
        ce = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum")
        losses = model.router_losses()
        weighted = moe.aux_loss_coef * losses.aux_loss + moe.z_loss_coef * losses.z_loss
        share = b["labels"].numel() / total
        (ce / total + weighted * share).backward()
        lm_sum += ce.item()
        router += weighted.item() * share
        aux.append(losses.aux_loss.item())
        stats = [block.stats for block in model.moe_blocks()]
        per_layer.append([_balancing_loss(s.tokens_per_expert, s.prob_sum, s.num_tokens) for s in stats])
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    return {
        "lm_loss": lm_sum / total,
        "router_loss": router,
        "aux_loss": aux,  # per micro-batch, pooled over the MoE layers (natively)
        "aux_per_layer": per_layer,  # per micro-batch and MoE layer (megatron's)
        "grads": split_experts(grads),
    }


def _balancing_loss(counts_E: torch.Tensor, prob_sum_E: torch.Tensor, tokens: int) -> float:
    """One layer's Switch load-balancing loss ``E * sum_e f_e * P_e`` (the native formula for that layer alone)."""
    return (counts_E.numel() * (counts_E / tokens * prob_sum_E / tokens).sum()).item()


def decoder_twin(model: DecoderLM, *, bf16: bool = False, moe_overlap: Any = None, **degrees: Any) -> Any:
    """The decoder's megatron twin (``DecoderTwin``, as ``CausalLM.megatron_model`` builds it) at the layout of
    ``degrees`` (megatron-core's option names; parallel state already set), on the CPU, in fp32 or bf16, with the MoE
    communication overlap options ``moe_overlap`` (a ``MoECommOverlap``; ``None``: none)."""
    from forge_lightning.contracts import MegatronBuild, MegatronDims, MoECommOverlap
    from forge_lightning.modules.llm.loss import LMLoss
    from forge_lightning.modules.llm.megatron import DecoderTwin
    from forge_lightning.modules.objective import GlobalBatchLoss

    build = MegatronBuild(
        dims=MegatronDims(**degrees),
        device=torch.device("cpu"),
        bf16=bf16,
        use_transformer_engine=False,
        moe_overlap=moe_overlap or MoECommOverlap(),
    )
    return DecoderTwin(model, build, loss=LMLoss(), objective=GlobalBatchLoss(), log=lambda *a, **k: None)


def build_twin(model: DecoderLM, *, moe_overlap: Any = None, **degrees: Any) -> list[torch.nn.Module]:
    """The strategy's DDP-wrapped twin chunks of ``model`` at the layout of ``degrees`` (parallel state already
    set), with the MoE communication overlap options ``moe_overlap`` (``None``: none)."""
    from forge_lightning.contracts import MegatronDims
    from forge_lightning.strategies.megatron.wrapping import wrap_ddp

    chunks = decoder_twin(model, moe_overlap=moe_overlap, **degrees).build_chunks()
    return wrap_ddp(chunks, MegatronDims(**degrees), overlap_grad_reduce=False)


def megatron_run(
    chunks: list[torch.nn.Module], config: LLMConfig, batches: list[dict[str, torch.Tensor]]
) -> dict:
    """Forward + backward of ``batches`` through the strategy's schedule on DDP-wrapped ``chunks``.

    Returns (on global rank 0 for the gradients) the summed loss and tokens of this DP rank, megatron's per-layer
    load-balancing losses as tracked (``aux / coeff``, summed over micro-batches and ranks) and the finalised
    gradients (divided by the global batch's tokens) under Hugging Face names.
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    from forge_lightning.modules.llm.megatron import unwrap
    from forge_lightning.strategies.megatron.schedule import run_schedule

    unwrap(chunks[0]).config.finalize_model_grads_func = finalize_model_grads
    clear_aux_losses_tracker()
    for chunk in chunks:
        chunk.train()
        chunk.zero_grad_buffer()

    with torch.device("meta"):  # the twin's forward step only: no weights needed
        twin = decoder_twin(DecoderLM(config))
    sums = run_schedule(chunks, batches, forward_only=False, twin=twin)
    tracker = get_moe_layer_wise_logging_tracker()
    tracked = {k: v["values"].clone() for k, v in tracker.items()}
    return {"sums": sums, "tracked": tracked, "grads": hf_gradients(chunks, config)}


def hf_gradients(chunks: list[torch.nn.Module], config: LLMConfig) -> dict[str, torch.Tensor]:
    """The chunks' finalised gradients (megatron DDP's ``main_grad``) gathered under Hugging Face names, on global
    rank 0: the weights' export path run on the gradients."""
    from forge_lightning.modules.llm.megatron import export_hf_state, unwrap

    params = [p for chunk in chunks for p in unwrap(chunk).parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad
        exported = export_hf_state(chunks, config)
        # The routers' selection biases are buffers (no gradient): exported as they are, left out here.
        return {k: v for k, v in exported.items() if not k.endswith("e_score_correction_bias")}
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data

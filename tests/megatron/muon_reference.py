"""Shared by the Muon-under-megatron tests and their worker: the dense debug decoder, its twin and its batches."""

from __future__ import annotations

from typing import Any

import torch

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.model import DecoderLM


def dense_config() -> LLMConfig:
    """The dense debug decoder (Llama-style, GQA: 4 query heads in 2 groups, SwiGLU), untied."""
    return LLMConfig.from_preset("debug")


def native_model(config: LLMConfig, seed: int = 0) -> DecoderLM:
    """A seeded fp32 native model with non-trivial norms."""
    torch.manual_seed(seed)
    model = DecoderLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def twin_chunks(config: LLMConfig, **degrees: Any) -> list[torch.nn.Module]:
    """The unwrapped megatron twin chunks of the seeded native model at the layout of ``degrees`` (parallel state
    already set), fp32, on the CPU."""
    from moe_reference import decoder_twin

    return decoder_twin(native_model(config), **degrees).build_chunks()


MUON = dict(lr=0.02, weight_decay=0.05, ns_dtype="float32")
"""``optimizer.muon`` of the tests: its own rate and decay, Newton-Schulz in fp32 so that layouts compare tightly."""
LR, WEIGHT_DECAY = 0.01, 0.1  # AdamW's (embeddings, head, norms)
STEPS = 3


def optimizer_config() -> Any:
    from forge_lightning.optim import OptimizerConfig

    return OptimizerConfig(name="muon", lr=LR, weight_decay=WEIGHT_DECAY, muon=dict(MUON))


def step_batches(config: LLMConfig, steps: int = STEPS) -> list[list[dict[str, torch.Tensor]]]:
    """The global batch of each step: two micro-batches of two rows."""
    from moe_reference import micro_batches

    batches = micro_batches(config, 2 * steps)
    return [batches[2 * s : 2 * s + 2] for s in range(steps)]


def megatron_optimizer(chunks: list[torch.nn.Module], **options: Any) -> Any:
    """The strategy's megatron optimizer of ``optimizer_config()`` over DDP-wrapped ``chunks`` (fp32, no clip)."""
    from forge_lightning.strategies.megatron.optimizer import build_megatron_optimizer

    kwargs = dict(use_distributed_optimizer=False, overlap_param_gather=False, clip_grad=0.0, bf16=False)
    return build_megatron_optimizer(chunks, optimizer_config(), **{**kwargs, **options})


def megatron_step(
    chunks: list[torch.nn.Module], optimizer: Any, config: LLMConfig, batches: list[dict]
) -> None:
    """Forward + backward of this DP rank's ``batches`` through the strategy's schedule, then megatron's step."""
    from megatron.core.distributed import finalize_model_grads
    from moe_reference import decoder_twin

    from forge_lightning.modules.llm.megatron import unwrap
    from forge_lightning.strategies.megatron.schedule import run_schedule

    unwrap(chunks[0]).config.finalize_model_grads_func = finalize_model_grads
    for chunk in chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with torch.device("meta"):  # the twin's forward step only: no weights needed
        twin = decoder_twin(DecoderLM(config))
    run_schedule(chunks, batches, forward_only=False, twin=twin)
    success, _, _ = optimizer.step()
    assert success


def _newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: Any, ns_steps: int, eps: float) -> torch.Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` in fp32 (torch's runs in bf16)."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def reference_weights(
    config: LLMConfig, steps: list[list[dict]], monkeypatch: Any
) -> dict[str, torch.Tensor]:
    """The native model after ``steps`` of ``torch.optim.Muon`` (Newton-Schulz in fp32) on its hidden matrices
    (q, k, v, o, gate, up, down: the unfused Hugging Face ones) and ``torch.optim.AdamW`` on the rest."""
    import torch.nn.functional as F

    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _newton_schulz_fp32)
    model = native_model(config)
    named = dict(model.named_parameters())
    hidden = [p for n, p in named.items() if p.ndim == 2 and "embed_tokens" not in n and "lm_head" not in n]
    decay = [named["lm_head.weight"]]
    no_decay = [p for n, p in named.items() if p.ndim < 2 or "embed_tokens" in n]
    muon = torch.optim.Muon(hidden, lr=MUON["lr"], weight_decay=MUON["weight_decay"], adjust_lr_fn="original")
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for batches in steps:
        model.zero_grad()
        total = sum(b["labels"].numel() for b in batches)
        for b in batches:
            logits = model(b["input_ids"])
            (F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum") / total).backward()
        muon.step()
        adamw.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def native_muon_weights(config: LLMConfig, steps: list[list[dict]]) -> dict[str, torch.Tensor]:
    """The native MoE model (``moe_reference``'s) after ``steps`` of the native path's Muon
    (``build_optimizer`` of ``optimizer_config()``: expert stacks, fused ``gate_up_proj`` / ``kv_a_proj_with_mqa``
    orthogonalised part by part), its weights under Hugging Face names (one tensor per expert)."""
    from moe_reference import native_model as moe_native_model
    from moe_reference import native_reference

    from forge_lightning.modules.llm.hf import split_experts
    from forge_lightning.optim import build_optimizer

    model = moe_native_model(config)
    optimizer = build_optimizer(model, optimizer_config())
    for batches in steps:
        native_reference(model, batches)  # the global batch's gradients (router losses included)
        optimizer.step()
    return {k: v.detach().clone() for k, v in split_experts(model.state_dict()).items()}

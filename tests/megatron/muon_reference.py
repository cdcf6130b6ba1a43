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

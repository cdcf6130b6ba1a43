"""Decoder LM family (Llama / Qwen2 / Qwen3 / Mistral; Qwen2-MoE / Qwen3-MoE / DeepSeek-V3) with Hugging Face
interchange.

Public names are imported lazily, so importing one submodule (e.g. ``config``) does not import the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ARCHITECTURES": "config",
    "LLMConfig": "config",
    "MLAConfig": "config",
    "MoEConfig": "config",
    "PRESETS": "config",
    "attention_flops_per_token": "config",
    "llm_flops_per_token": "config",
    "DecoderLM": "model",
    "DecoderLayer": "model",
    "DecoderModel": "model",
    "block_tp_plan": "model",
    "check_compatible": "hf",
    "fuse_experts": "hf",
    "split_experts": "hf",
    "load_hf_state_dict": "hf",
    "load_pretrained": "hf",
    "save_pretrained": "hf",
    "generate": "generation",
    "sample_next_token": "generation",
    "CausalLM": "module",
    "GenerationConfig": "module",
}

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "GenerationConfig",
    "PRESETS",
    "DecoderLM",
    "DecoderLayer",
    "DecoderModel",
    "LLMConfig",
    "MLAConfig",
    "MoEConfig",
    "attention_flops_per_token",
    "block_tp_plan",
    "check_compatible",
    "fuse_experts",
    "generate",
    "llm_flops_per_token",
    "load_hf_state_dict",
    "load_pretrained",
    "sample_next_token",
    "save_pretrained",
    "split_experts",
]

if TYPE_CHECKING:
    from forge_lightning.modules.llm.config import (
        ARCHITECTURES,
        PRESETS,
        LLMConfig,
        MLAConfig,
        MoEConfig,
        attention_flops_per_token,
        llm_flops_per_token,
    )
    from forge_lightning.modules.llm.generation import generate, sample_next_token
    from forge_lightning.modules.llm.hf import (
        check_compatible,
        fuse_experts,
        load_hf_state_dict,
        load_pretrained,
        save_pretrained,
        split_experts,
    )
    from forge_lightning.modules.llm.model import DecoderLayer, DecoderLM, DecoderModel, block_tp_plan
    from forge_lightning.modules.llm.module import CausalLM, GenerationConfig


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

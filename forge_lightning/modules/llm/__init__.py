"""Dense decoder LM family (Llama / Qwen2 / Qwen3 / Mistral) with Hugging Face interchange.

Public names are imported lazily, so importing one submodule (e.g. ``config``) does not import the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ARCHITECTURES": "config",
    "LLMConfig": "config",
    "PRESETS": "config",
    "attention_flops_per_token": "config",
    "llm_flops_per_token": "config",
    "DecoderLM": "model",
    "DecoderLayer": "model",
    "DecoderModel": "model",
    "check_compatible": "hf",
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
    "attention_flops_per_token",
    "check_compatible",
    "generate",
    "llm_flops_per_token",
    "load_hf_state_dict",
    "load_pretrained",
    "sample_next_token",
    "save_pretrained",
]

if TYPE_CHECKING:
    from forge_lightning.modules.llm.config import (
        ARCHITECTURES,
        PRESETS,
        LLMConfig,
        attention_flops_per_token,
        llm_flops_per_token,
    )
    from forge_lightning.modules.llm.generation import generate, sample_next_token
    from forge_lightning.modules.llm.hf import (
        check_compatible,
        load_hf_state_dict,
        load_pretrained,
        save_pretrained,
    )
    from forge_lightning.modules.llm.model import DecoderLayer, DecoderLM, DecoderModel
    from forge_lightning.modules.llm.module import CausalLM, GenerationConfig


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

"""Embodied models: Pi0.5 (PaliGemma backbone + flow-matching Gemma action expert) with lerobot interchange.

Public names are imported lazily, so importing one submodule (e.g. ``config``) does not import the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "PRESETS": "config",
    "GemmaConfig": "config",
    "Pi05Config": "config",
    "SiglipConfig": "config",
    "Pi05": "model",
    "Pi05Inputs": "model",
    "PrefixCache": "model",
    "from_lerobot_state_dict": "checkpoint",
    "load_lerobot_checkpoint": "checkpoint",
    "to_lerobot_state_dict": "checkpoint",
    "PromptTokenizer": "prompt",
    "build_prompts": "prompt",
    "discretize_state": "prompt",
    "Pi05Policy": "module",
}

__all__ = [
    "GemmaConfig",
    "PRESETS",
    "Pi05",
    "Pi05Config",
    "Pi05Inputs",
    "Pi05Policy",
    "PrefixCache",
    "PromptTokenizer",
    "SiglipConfig",
    "build_prompts",
    "discretize_state",
    "from_lerobot_state_dict",
    "load_lerobot_checkpoint",
    "to_lerobot_state_dict",
]

if TYPE_CHECKING:
    from forge_lightning.modules.embodied.checkpoint import (
        from_lerobot_state_dict,
        load_lerobot_checkpoint,
        to_lerobot_state_dict,
    )
    from forge_lightning.modules.embodied.config import PRESETS, GemmaConfig, Pi05Config, SiglipConfig
    from forge_lightning.modules.embodied.model import Pi05, Pi05Inputs, PrefixCache
    from forge_lightning.modules.embodied.module import Pi05Policy
    from forge_lightning.modules.embodied.prompt import PromptTokenizer, build_prompts, discretize_state


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

"""Vision-language models: the composed model (:mod:`.model`, :mod:`.config`, Hugging Face interchange in
:mod:`.hf`), vision encoders (:mod:`.qwen2_5_vit`), the patch-grid layout they share (:mod:`.patches`).

Public names are imported lazily, so importing one submodule (e.g. ``positions``) does not import the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "VLMConfig": "config",
    "VisionLanguageModel": "model",
    "from_pretrained": "hf",
    "save_pretrained": "hf",
}

__all__ = ["VLMConfig", "VisionLanguageModel", "from_pretrained", "save_pretrained"]

if TYPE_CHECKING:
    from forge_lightning.modules.vlm.config import VLMConfig
    from forge_lightning.modules.vlm.hf import from_pretrained, save_pretrained
    from forge_lightning.modules.vlm.model import VisionLanguageModel


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

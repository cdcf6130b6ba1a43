"""Vision-language models: the composed model (:mod:`.model`, :mod:`.config`, Hugging Face interchange in
:mod:`.hf`, composition from component checkpoints in :mod:`.compose`), vision encoders (:mod:`.qwen2_5_vit`,
:mod:`.siglip`, :mod:`.clip`; LLaVA-OneVision's tiling in :mod:`.anyres`) and how each plugs in (:mod:`.towers`), projectors (:mod:`.projector`), the patch-grid layout the
Qwen encoder uses (:mod:`.patches`); the LightningModule that trains them (:mod:`.module`).

Public names are imported lazily, so importing one submodule (e.g. ``positions``) does not import the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AnyResVisionConfig": "anyres",
    "ClipVisionConfig": "clip",
    "ClipVisionTransformer": "clip",
    "FAMILIES": "config",
    "VISION_TYPES": "config",
    "VLMConfig": "config",
    "PROJECTORS": "projector",
    "MLPProjectorConfig": "projector",
    "MultiModalProjector": "projector",
    "SiglipVisionConfig": "siglip",
    "SiglipVisionTransformer": "siglip",
    "VisionLanguageModel": "model",
    "VisionLanguageModule": "module",
    "ComponentSettings": "module",
    "build_vlm": "compose",
    "from_pretrained": "hf",
    "save_pretrained": "hf",
}

__all__ = [
    "AnyResVisionConfig",
    "ClipVisionConfig",
    "ClipVisionTransformer",
    "ComponentSettings",
    "FAMILIES",
    "MLPProjectorConfig",
    "MultiModalProjector",
    "PROJECTORS",
    "SiglipVisionConfig",
    "SiglipVisionTransformer",
    "VISION_TYPES",
    "VLMConfig",
    "VisionLanguageModel",
    "VisionLanguageModule",
    "build_vlm",
    "from_pretrained",
    "save_pretrained",
]

if TYPE_CHECKING:
    from forge_lightning.modules.vlm.anyres import AnyResVisionConfig
    from forge_lightning.modules.vlm.clip import ClipVisionConfig, ClipVisionTransformer
    from forge_lightning.modules.vlm.compose import build_vlm
    from forge_lightning.modules.vlm.config import FAMILIES, VISION_TYPES, VLMConfig
    from forge_lightning.modules.vlm.hf import from_pretrained, save_pretrained
    from forge_lightning.modules.vlm.model import VisionLanguageModel
    from forge_lightning.modules.vlm.module import ComponentSettings, VisionLanguageModule
    from forge_lightning.modules.vlm.projector import PROJECTORS, MLPProjectorConfig, MultiModalProjector
    from forge_lightning.modules.vlm.siglip import SiglipVisionConfig, SiglipVisionTransformer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

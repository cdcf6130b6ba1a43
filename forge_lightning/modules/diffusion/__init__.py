"""Video diffusion (Wan-style): the Wan DiT (Wan 2.1 / 2.2 T2V, I2V, TI2V) with its diffusers interchange, the
flow-matching training targets, the Euler sampler and the frozen Wan encoders.

Public names are imported lazily, so importing one submodule (e.g. ``flow_matching``) does not import the others
(the encoders need diffusers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "PRESETS": "wan_config",
    "WanDiTConfig": "wan_config",
    "preset": "wan_config",
    "load_pretrained": "wan_hf",
    "save_pretrained": "wan_hf",
    "CrossContext": "wan_model",
    "WanBlock": "wan_model",
    "WanDiT": "wan_model",
    "FlowMatching": "flow_matching",
    "FlowMatchingConfig": "flow_matching",
    "FlowMatchingSample": "flow_matching",
    "Denoiser": "sampling",
    "flow_match_sigmas": "sampling",
    "sample_euler": "sampling",
    "VideoGenerationConfig": "sampling",
    "WanImageEncoder": "encoders",
    "WanTextEncoder": "encoders",
    "first_frame_condition_mask": "encoders",
    "WanVAE": "encoders",
    "PixelLatents": "pixels",
    "WanDiffusionModule": "module",
    "sample_generator": "module",
}

__all__ = [
    "CrossContext",
    "Denoiser",
    "FlowMatching",
    "FlowMatchingConfig",
    "FlowMatchingSample",
    "PRESETS",
    "PixelLatents",
    "VideoGenerationConfig",
    "WanBlock",
    "WanDiT",
    "WanDiTConfig",
    "WanDiffusionModule",
    "WanImageEncoder",
    "WanTextEncoder",
    "WanVAE",
    "first_frame_condition_mask",
    "flow_match_sigmas",
    "load_pretrained",
    "preset",
    "sample_euler",
    "sample_generator",
    "save_pretrained",
]

if TYPE_CHECKING:
    from forge_lightning.modules.diffusion.encoders import (
        WanImageEncoder,
        WanTextEncoder,
        WanVAE,
        first_frame_condition_mask,
    )
    from forge_lightning.modules.diffusion.flow_matching import (
        FlowMatching,
        FlowMatchingConfig,
        FlowMatchingSample,
    )
    from forge_lightning.modules.diffusion.module import WanDiffusionModule, sample_generator
    from forge_lightning.modules.diffusion.pixels import PixelLatents
    from forge_lightning.modules.diffusion.sampling import (
        Denoiser,
        VideoGenerationConfig,
        flow_match_sigmas,
        sample_euler,
    )
    from forge_lightning.modules.diffusion.wan_config import PRESETS, WanDiTConfig, preset
    from forge_lightning.modules.diffusion.wan_hf import load_pretrained, save_pretrained
    from forge_lightning.modules.diffusion.wan_model import CrossContext, WanBlock, WanDiT


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

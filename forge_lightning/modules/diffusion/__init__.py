"""Video diffusion (Wan-style): flow-matching training targets, the Euler sampler and the frozen Wan encoders.

Public names are imported lazily, so importing one submodule (e.g. ``flow_matching``) does not import the others
(the encoders need diffusers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "FlowMatching": "flow_matching",
    "FlowMatchingConfig": "flow_matching",
    "FlowMatchingSample": "flow_matching",
    "Denoiser": "sampling",
    "flow_match_sigmas": "sampling",
    "sample_euler": "sampling",
    "WanTextEncoder": "encoders",
    "WanVAE": "encoders",
}

__all__ = [
    "Denoiser",
    "FlowMatching",
    "FlowMatchingConfig",
    "FlowMatchingSample",
    "WanTextEncoder",
    "WanVAE",
    "flow_match_sigmas",
    "sample_euler",
]

if TYPE_CHECKING:
    from forge_lightning.modules.diffusion.encoders import WanTextEncoder, WanVAE
    from forge_lightning.modules.diffusion.flow_matching import (
        FlowMatching,
        FlowMatchingConfig,
        FlowMatchingSample,
    )
    from forge_lightning.modules.diffusion.sampling import Denoiser, flow_match_sigmas, sample_euler


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

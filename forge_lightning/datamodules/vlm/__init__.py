"""Vision-language data: Qwen2-VL / Qwen2.5-VL image and video inputs.

Public names are imported lazily, as in the other data packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Qwen2VLImageProcessor": "image_processor",
    "num_merged_tokens": "image_processor",
    "smart_resize": "image_processor",
}

__all__ = ["Qwen2VLImageProcessor", "num_merged_tokens", "smart_resize"]

if TYPE_CHECKING:
    from forge_lightning.datamodules.vlm.image_processor import (
        Qwen2VLImageProcessor,
        num_merged_tokens,
        smart_resize,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

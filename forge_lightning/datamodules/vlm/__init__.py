"""Vision-language data: image / video + text conversations (LLaVA, ShareGPT with images / videos, OpenAI content
parts), their encoding with vision tokens, Qwen2-VL / Qwen2.5-VL / Qwen3-VL image and video inputs,
fixed-resolution image inputs, LLaVA-OneVision's any-resolution image and video inputs, and the datamodule.

Public names are imported lazily, as in the other data packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BadSampleError": "scan",
    "FixedResolutionVisionInputs": "vision_inputs",
    "ImageSource": "records",
    "LlavaOnevisionImageProcessor": "anyres_processor",
    "LlavaOnevisionVisionInputs": "anyres_processor",
    "PROCESSORS": "vision_inputs",
    "Qwen2VLImageProcessor": "image_processor",
    "Qwen2VLVisionInputs": "vision_inputs",
    "Qwen3VLImageProcessor": "image_processor",
    "Qwen3VLVisionInputs": "vision_inputs",
    "Qwen3VideoSampling": "video",
    "ScanReport": "scan",
    "VLMDataModule": "datamodule",
    "VLMDataset": "dataset",
    "VLMEncoder": "encoding",
    "VLMRecord": "records",
    "VLMSample": "scan",
    "VideoFile": "video",
    "VideoInputs": "vision_inputs",
    "VideoSampling": "video",
    "VisionInputs": "vision_inputs",
    "num_merged_tokens": "image_processor",
    "parse_vlm_record": "records",
    "scan_files": "scan",
    "smart_resize": "image_processor",
    "vlm_collate": "dataset",
}

__all__ = [
    "BadSampleError",
    "FixedResolutionVisionInputs",
    "ImageSource",
    "LlavaOnevisionImageProcessor",
    "LlavaOnevisionVisionInputs",
    "PROCESSORS",
    "Qwen2VLImageProcessor",
    "Qwen2VLVisionInputs",
    "Qwen3VLImageProcessor",
    "Qwen3VLVisionInputs",
    "Qwen3VideoSampling",
    "ScanReport",
    "VLMDataModule",
    "VLMDataset",
    "VLMEncoder",
    "VLMRecord",
    "VLMSample",
    "VideoFile",
    "VideoInputs",
    "VideoSampling",
    "VisionInputs",
    "num_merged_tokens",
    "parse_vlm_record",
    "scan_files",
    "smart_resize",
    "vlm_collate",
]

if TYPE_CHECKING:
    from forge_lightning.datamodules.vlm.anyres_processor import (
        LlavaOnevisionImageProcessor,
        LlavaOnevisionVisionInputs,
    )
    from forge_lightning.datamodules.vlm.datamodule import VLMDataModule
    from forge_lightning.datamodules.vlm.dataset import VLMDataset, vlm_collate
    from forge_lightning.datamodules.vlm.encoding import VLMEncoder
    from forge_lightning.datamodules.vlm.image_processor import (
        Qwen2VLImageProcessor,
        Qwen3VLImageProcessor,
        num_merged_tokens,
        smart_resize,
    )
    from forge_lightning.datamodules.vlm.records import ImageSource, VLMRecord, parse_vlm_record
    from forge_lightning.datamodules.vlm.scan import BadSampleError, ScanReport, VLMSample, scan_files
    from forge_lightning.datamodules.vlm.video import Qwen3VideoSampling, VideoFile, VideoSampling
    from forge_lightning.datamodules.vlm.vision_inputs import (
        PROCESSORS,
        FixedResolutionVisionInputs,
        Qwen2VLVisionInputs,
        Qwen3VLVisionInputs,
        VideoInputs,
        VisionInputs,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

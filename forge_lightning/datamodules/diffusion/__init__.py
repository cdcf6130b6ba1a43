"""Video-diffusion data: video-caption datasets in resolution / frame-count buckets, their grouped loader, the
precompute of their frozen-encoder features (``forge_lightning.datamodules.feature_cache``), the training
datamodule and the prompts of ``forge predict``.

Public names are imported lazily, as in the other data packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ClipSampling": "buckets",
    "VideoBucket": "buckets",
    "choose_bucket": "buckets",
    "parse_buckets": "buckets",
    "resize_crop": "buckets",
    "VideoCaptionDataset": "dataset",
    "VideoCaptionSample": "dataset",
    "VideoScanReport": "dataset",
    "scan_video_captions": "dataset",
    "video_caption_collate": "dataset",
    "VideoDiffusionDataModule": "datamodule",
    "GroupedStepLoader": "loader",
    "group_batches": "loader",
    "PrecomputeConfig": "precompute",
    "VideoCaptionConfig": "precompute",
    "load_precompute_config": "precompute",
    "run_precompute": "precompute",
    "VideoPromptDataModule": "prompts",
    "read_prompts": "prompts",
}

__all__ = [
    "ClipSampling",
    "GroupedStepLoader",
    "PrecomputeConfig",
    "VideoBucket",
    "VideoCaptionConfig",
    "VideoCaptionDataset",
    "VideoCaptionSample",
    "VideoDiffusionDataModule",
    "VideoPromptDataModule",
    "VideoScanReport",
    "choose_bucket",
    "group_batches",
    "load_precompute_config",
    "parse_buckets",
    "read_prompts",
    "resize_crop",
    "run_precompute",
    "scan_video_captions",
    "video_caption_collate",
]

if TYPE_CHECKING:
    from forge_lightning.datamodules.diffusion.buckets import (
        ClipSampling,
        VideoBucket,
        choose_bucket,
        parse_buckets,
        resize_crop,
    )
    from forge_lightning.datamodules.diffusion.datamodule import VideoDiffusionDataModule
    from forge_lightning.datamodules.diffusion.dataset import (
        VideoCaptionDataset,
        VideoCaptionSample,
        VideoScanReport,
        scan_video_captions,
        video_caption_collate,
    )
    from forge_lightning.datamodules.diffusion.loader import GroupedStepLoader, group_batches
    from forge_lightning.datamodules.diffusion.precompute import (
        PrecomputeConfig,
        VideoCaptionConfig,
        load_precompute_config,
        run_precompute,
    )
    from forge_lightning.datamodules.diffusion.prompts import VideoPromptDataModule, read_prompts


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

"""Video-diffusion data: video-caption datasets in resolution / frame-count buckets, their grouped loader, and the
precompute of their frozen-encoder features (``forge_lightning.datamodules.feature_cache``)."""

from forge_lightning.datamodules.diffusion.buckets import (
    ClipSampling,
    VideoBucket,
    choose_bucket,
    parse_buckets,
    resize_crop,
)
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

__all__ = [
    "ClipSampling",
    "GroupedStepLoader",
    "PrecomputeConfig",
    "VideoBucket",
    "VideoCaptionConfig",
    "VideoCaptionDataset",
    "VideoCaptionSample",
    "VideoScanReport",
    "choose_bucket",
    "group_batches",
    "load_precompute_config",
    "parse_buckets",
    "resize_crop",
    "run_precompute",
    "scan_video_captions",
    "video_caption_collate",
]

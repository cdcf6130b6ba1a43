"""``forge-data precompute``: the feature cache of a video-caption dataset from a YAML file that says what to encode
and with which frozen modules::

    data:                              # the video-caption data (VideoCaptionConfig)
      entries: [captions.jsonl]
      buckets: [[17, 480, 832], [17, 832, 480]]
      fps: 16
    modules:                           # FrozenModule entries, run in order on each batch
      - name: vae
        target: diffusers.AutoencoderKLWan.from_pretrained
        init_args: {pretrained_model_name_or_path: Wan2.1-T2V-1.3B-Diffusers, subfolder: vae}
        method: encode
        inputs: {x: video}
        outputs: {latents: latent_dist.mean}
    keep: [caption]                    # sample fields stored as they are
    batch_size: 4
    samples_per_shard: 256
    device: cuda
    num_workers: 4                     # processes decoding the videos
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from forge_lightning.datamodules.diffusion.buckets import parse_buckets
from forge_lightning.datamodules.diffusion.dataset import (
    VideoCaptionDataset,
    VideoScanReport,
    scan_video_captions,
    video_caption_collate,
)
from forge_lightning.datamodules.feature_cache import FrozenModule, PrecomputeSummary, precompute


@dataclass(kw_only=True)
class VideoCaptionConfig:
    """The video-caption data of a cache or a training run.

    Args:
        entries: ``.jsonl`` caption files and WebDataset shard patterns.
        buckets: ``[[frames, height, width], ...]`` (frames ``4k + 1``).
        fps: the frame rate frames are sampled at.
        video_root: where relative video paths start (default: each ``.jsonl``'s directory).
        on_bad_sample: ``skip`` or ``error``.
        verify_frames: decode every sample's frames at the scan.
        temporal_stride: bucket frame counts are ``temporal_stride * k + 1`` (Wan's VAE: 4).
        spatial_stride: bucket sides are multiples of it (Wan: 8 (VAE) x 2 (patch) = 16).
    """

    entries: list[str]
    buckets: list[list[int]]
    fps: float
    video_root: str | None = None
    on_bad_sample: str = "skip"
    verify_frames: bool = False
    temporal_stride: int = 4
    spatial_stride: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.entries, str):
            self.entries = [self.entries]
        if self.fps <= 0:
            raise ValueError(f"fps ({self.fps}) must be positive")

    def load(self) -> tuple[VideoCaptionDataset, VideoScanReport]:
        """The scanned dataset and what the scan found."""
        samples, report = scan_video_captions(
            self.entries,
            parse_buckets(
                self.buckets, temporal_stride=self.temporal_stride, spatial_stride=self.spatial_stride
            ),
            fps=self.fps,
            video_root=self.video_root,
            on_bad_sample=self.on_bad_sample,
            verify_frames=self.verify_frames,
        )
        if not samples:
            raise ValueError(f"no usable sample: {report.describe()}")
        return VideoCaptionDataset(samples, fps=self.fps), report


@dataclass(kw_only=True)
class PrecomputeConfig:
    """A ``forge-data precompute`` YAML: the data, the frozen modules and how to run them (see the module doc)."""

    data: VideoCaptionConfig
    modules: list[FrozenModule]
    keep: list[str] = field(default_factory=lambda: ["caption"])
    batch_size: int = 4
    samples_per_shard: int = 256
    device: str = "cpu"
    num_workers: int = 0

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any], where: str = "the config") -> PrecomputeConfig:
        """From the parsed YAML; errors name the section."""
        config = dict(config)
        unknown = set(config) - {
            "data",
            "modules",
            "keep",
            "batch_size",
            "samples_per_shard",
            "device",
            "num_workers",
        }
        if unknown or "data" not in config or not config.get("modules"):
            raise ValueError(
                f"{where}: needs data and modules sections (and optionally keep, batch_size, samples_per_shard, "
                f"device, num_workers){f'; unknown keys {sorted(unknown)}' if unknown else ''}"
            )
        try:
            data = VideoCaptionConfig(**config.pop("data"))
        except TypeError as error:
            raise ValueError(f"{where}: data: {error}") from None
        modules = [FrozenModule.from_config(m) for m in config.pop("modules")]
        return cls(data=data, modules=modules, **config)


def load_precompute_config(path: str | Path) -> PrecomputeConfig:
    """The precompute config of a YAML file."""
    text = Path(path).read_text(encoding="utf-8")
    config = yaml.safe_load(text)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a precompute config is a YAML mapping")
    return PrecomputeConfig.from_mapping(config, str(path))


def run_precompute(
    config_path: str | Path,
    output: str | Path,
    *,
    device: str | None = None,
    log: Callable[[str], None] = print,
) -> PrecomputeSummary:
    """Scan the config's data, run its modules and write the cache at ``output`` (resuming an earlier run).

    Args:
        config_path: the YAML file.
        output: the cache directory.
        device: overrides the config's ``device``.
        log: where progress lines go.
    """
    config = load_precompute_config(config_path)
    dataset, report = config.data.load()
    log(report.describe())
    summary = precompute(
        dataset,
        config.modules,
        output,
        collate_fn=video_caption_collate,
        batch_size=config.batch_size,
        samples_per_shard=config.samples_per_shard,
        keep=config.keep,
        device=device or config.device,
        num_workers=config.num_workers,
        log=log,
    )
    log(
        f"feature cache {output}: {summary.samples} samples, {summary.shards_written} shard(s) written, "
        f"{summary.shards_kept} kept from an earlier run"
    )
    return summary

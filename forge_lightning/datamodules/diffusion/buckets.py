"""Resolution and frame-count buckets of video-diffusion training: which bucket a video goes to, which of its frames
are sampled, and how they are resized and centre-cropped into it::

    video header (frames, fps, width, height) ─ choose_bucket: the buckets whose frame count the video fills at the
      target fps, then the nearest aspect ratio ─ ClipSampling.indices (every source_fps / fps-th frame from the
      start) ─ read_video (PyAV) ─ resize_crop: scale to cover the bucket, centre-crop, [-1, 1]

Wan's VAE compresses time by 4 and keeps the first frame apart, so a bucket's frame count must be ``4k + 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from forge_lightning.datamodules.vlm.video import VideoInfo, VideoSampling


@dataclass(frozen=True)
class VideoBucket:
    """One training shape: ``num_frames`` frames of ``height`` x ``width`` pixels.

    Args:
        num_frames: frames of a clip (``temporal_stride * k + 1``).
        height: pixel rows.
        width: pixel columns.
    """

    num_frames: int
    height: int
    width: int

    @property
    def aspect(self) -> float:
        """Width over height."""
        return self.width / self.height

    def __str__(self) -> str:
        return f"{self.num_frames}x{self.height}x{self.width}"


def parse_buckets(
    buckets: Sequence[Sequence[int]], *, temporal_stride: int = 4, spatial_stride: int = 16
) -> list[VideoBucket]:
    """The buckets of a config list of ``(frames, height, width)``.

    Args:
        buckets: ``[[frames, height, width], ...]``.
        temporal_stride: frames must be ``temporal_stride * k + 1`` (the VAE's temporal compression; Wan: 4).
        spatial_stride: height and width must be multiples of it (VAE compression x DiT patch; Wan: 8 x 2).

    Raises:
        ValueError: an entry of the wrong length or size, naming it.
    """
    if not buckets:
        raise ValueError("buckets is empty: give at least one [frames, height, width]")
    parsed = []
    for entry in buckets:
        if len(entry) != 3 or any(int(v) != v or v < 1 for v in entry):
            raise ValueError(f"bucket {list(entry)} must be three positive integers [frames, height, width]")
        frames, height, width = (int(v) for v in entry)
        if (frames - 1) % temporal_stride:
            raise ValueError(
                f"bucket {list(entry)}: frames ({frames}) must be {temporal_stride}k + 1 (the VAE's temporal "
                f"compression), e.g. {(frames - 1) // temporal_stride * temporal_stride + 1}"
            )
        if height % spatial_stride or width % spatial_stride:
            raise ValueError(
                f"bucket {list(entry)}: height and width must be multiples of {spatial_stride} "
                "(VAE compression x patch size)"
            )
        parsed.append(VideoBucket(frames, height, width))
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"buckets {[list(b) for b in buckets]} repeat an entry")
    return parsed


def frames_available(info: VideoInfo, fps: float) -> int:
    """Frames a video gives when sampled at ``fps`` from its first frame (every ``info.fps / fps``-th frame)."""
    return math.floor((info.num_frames - 1) * fps / info.fps + 1e-9) + 1


def choose_bucket(info: VideoInfo, buckets: Sequence[VideoBucket], fps: float) -> VideoBucket | None:
    """The bucket of a video: among those whose frame count it fills at ``fps``, the nearest in aspect ratio
    (``|log(aspect ratio)|`` apart), then the one of most frames, then the first listed; ``None`` when it fills
    none."""
    available = frames_available(info, fps)
    fitting = [b for b in buckets if b.num_frames <= available]
    if not fitting:
        return None
    aspect = info.width / info.height
    return min(fitting, key=lambda b: (round(abs(math.log(b.aspect / aspect)), 9), -b.num_frames))


@dataclass(frozen=True, kw_only=True)
class ClipSampling(VideoSampling):
    """The frames of a bucket: ``num_frames`` frames at ``fps``, from the video's first frame (frame
    ``floor(k * video fps / fps)`` for ``k < num_frames``); the :class:`VideoSampling` that ``read_video`` takes.

    Args:
        fps: the target frame rate.
        num_frames: the bucket's frame count.
    """

    temporal_patch_size: int = 1

    def indices(self, info: VideoInfo) -> list[int]:
        """The frame indices to decode.

        Raises:
            ValueError: the video is too short for ``num_frames`` frames at ``fps``.
        """
        assert self.num_frames is not None, "ClipSampling needs num_frames"
        if frames_available(info, self.fps) < self.num_frames:
            raise ValueError(
                f"a video of {info.num_frames} frames at {info.fps:g} fps gives "
                f"{frames_available(info, self.fps)} frames at {self.fps:g} fps, fewer than {self.num_frames}"
            )
        step = np.float64(info.fps) / np.float64(self.fps)
        return np.floor(np.arange(self.num_frames) * step + 1e-9).astype(np.int64).tolist()


def resize_crop(frames_THWC: np.ndarray, bucket: VideoBucket) -> torch.Tensor:
    """uint8 frames ``[T, H, W, 3]`` scaled (bilinear, antialiased) to cover the bucket, centre-cropped to it, as
    float ``[3, T, height, width]`` in ``[-1, 1]``."""
    video_TCHW = torch.from_numpy(np.ascontiguousarray(frames_THWC)).permute(0, 3, 1, 2).float()
    height, width = video_TCHW.shape[-2:]
    scale = max(bucket.height / height, bucket.width / width)
    size = (max(bucket.height, round(height * scale)), max(bucket.width, round(width * scale)))
    if size != (height, width):
        video_TCHW = F.interpolate(
            video_TCHW, size=size, mode="bilinear", antialias=True, align_corners=False
        )
    top, left = (size[0] - bucket.height) // 2, (size[1] - bucket.width) // 2
    video_TCHW = video_TCHW[:, :, top : top + bucket.height, left : left + bucket.width]
    return (video_TCHW.clamp(0, 255) / 127.5 - 1).permute(1, 0, 2, 3).contiguous()  # [3, T, H, W]

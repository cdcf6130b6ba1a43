"""Images and video frames to the flat patch rows of the Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower, value for
value as transformers' processor makes them (``Qwen2VLImageProcessorPil``, the backend transformers uses without
torchvision, which Qwen3-VL uses for its images too)::

    image / frame (Pillow, any mode) ─ RGB, transparency composited onto white
      ─ smart_resize: both sides to multiples of patch_size * merge_size, pixel count in [min, max]
      ─ Pillow resize (bicubic) on uint8 ─ rescale (float64, then float32) ─ normalise (float32)
      ─ patch rows [grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size * patch_size]

Row order: temporal patch, then merge block (row-major over ``[grid_h / M, grid_w / M]``), then patch within
the block (row-major over ``[M, M]``), so each run of ``M * M`` rows is one token after the tower's patch
merger. A row is ``[C, temporal_patch_size, patch_size, patch_size]`` flattened. An image fills its
temporal patch with ``temporal_patch_size`` copies of itself (``grid_t = 1``); a video groups consecutive
frames, and a frame count that does not divide repeats the last frame (transformers' ``Qwen2VLVideoProcessor``).

Video frames here take the image path frame by frame (Pillow resize). transformers' video processor needs
torchvision and resizes with torchvision's bicubic instead, which differs from Pillow's by up to several uint8
levels; frames already at their target size (resized upstream) do not see the difference.

Qwen3-VL (:class:`Qwen3VLImageProcessor`) patches images as Qwen2-VL does (16-pixel patches, mean and std 0.5); its
video frames take another size (:func:`smart_resize_video`: the pixel bounds count the frames too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import Tensor

# The normalisation of OpenAI CLIP, which Qwen2-VL and Qwen2.5-VL keep.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200

VideoInput = Sequence[Image.Image] | np.ndarray | Tensor


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """The size Qwen2-VL resizes an image to: each side a multiple of ``factor``, the aspect ratio kept as
    closely as the rounding allows, the pixel count within ``[min_pixels, max_pixels]`` where possible.

    Each side is first rounded to the nearest multiple (Python's ``round``, halves to even). When that overshoots
    ``max_pixels`` both sides are scaled down by one factor and floored (never below ``factor``); when it
    undershoots ``min_pixels`` they are scaled up and ceiled. Tiny images are therefore upscaled (a 1x1 image
    becomes 56x56 with the defaults), not refused.

    Args:
        height: image height in pixels.
        width: image width in pixels.
        factor: the multiple both sides must have (``patch_size * merge_size``).
        min_pixels: the least ``height * width`` after resizing.
        max_pixels: the most ``height * width`` after resizing.

    Returns:
        ``(height, width)`` after resizing.

    Raises:
        ValueError: a side is not positive, or the longer side is over 200 times the shorter one.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image of {height}x{width} (height x width) is empty: both sides must be positive")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image of {height}x{width} (height x width) has an aspect ratio of {ratio:g}; Qwen2-VL accepts at "
            f"most {MAX_ASPECT_RATIO}: crop or pad it first"
        )
    new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
    # The float expressions keep transformers' order of operations: they decide the rounding at the boundaries.
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    factor: int,
    temporal_factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """The size Qwen3-VL resizes the frames of a video to (transformers' ``Qwen3VLVideoProcessor``): as
    :func:`smart_resize`, but the bounds are on ``frames * height * width`` (the frame count rounded to a multiple
    of ``temporal_factor``), and frames smaller than ``factor`` are first scaled up to it.

    Args:
        num_frames: the sampled frames.
        height: frame height in pixels.
        width: frame width in pixels.
        factor: the multiple both sides must have (``patch_size * merge_size``).
        temporal_factor: frames per temporal patch.
        min_pixels: the least ``frames * height * width`` after resizing (transformers' ``size.shortest_edge``).
        max_pixels: the most ``frames * height * width`` after resizing (``size.longest_edge``).

    Raises:
        ValueError: fewer frames than ``temporal_factor``, a side that is not positive, or an aspect ratio over 200.
    """
    if num_frames < temporal_factor:
        raise ValueError(
            f"{num_frames} sampled frame(s) are fewer than one temporal patch ({temporal_factor} frames)"
        )
    if height <= 0 or width <= 0:
        raise ValueError(
            f"frames of {height}x{width} (height x width) are empty: both sides must be positive"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"frames of {height}x{width} (height x width) have an aspect ratio of {ratio:g}; Qwen3-VL accepts at "
            f"most {MAX_ASPECT_RATIO}: crop or pad the video first"
        )
    new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
    frames = round(num_frames / temporal_factor) * temporal_factor
    # As in smart_resize, transformers' order of operations; beta takes the frame count before rounding.
    if frames * new_height * new_width > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


def num_merged_tokens(grid_thw: Tensor, merge_size: int) -> Tensor:
    """The number of LLM tokens each image or video becomes after the patch merger: ``t * h * w / merge**2``,
    the count of ``<|image_pad|>`` (or ``<|video_pad|>``) tokens its placeholder expands to.

    Args:
        grid_thw: ``[N, 3]`` patch grids, as ``image_grid_thw`` / ``video_grid_thw``.
        merge_size: the side of the square of patches merged into one token.

    Returns:
        ``[N]`` int64 token counts.
    """
    return grid_thw.prod(dim=-1) // merge_size**2


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in mode RGB; an alpha band or palette transparency is composited onto white, as transformers
    does (a plain ``convert("RGB")`` would drop it and keep whatever colour the transparent pixels hold)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


@dataclass(kw_only=True)
class Qwen2VLImageProcessor:
    """Turns images and videos into Qwen2-VL / Qwen2.5-VL vision inputs, equal to transformers' PIL processor
    (``Qwen2VLImageProcessorPil``) value for value.

    The defaults are transformers' class defaults; the released checkpoints set ``max_pixels`` in their
    ``preprocessor_config.json`` (12845056 for Qwen2-VL and Qwen2.5-VL), which bounds the tokens an image costs.

    Args:
        patch_size: side of a vision-tower patch in pixels.
        temporal_patch_size: frames per temporal patch; an image is repeated to fill one.
        merge_size: side of the square of patches the merger turns into one LLM token.
        min_pixels: the least pixels of a resized image.
        max_pixels: the most pixels of a resized image.
        video_min_pixels: the least pixels of a resized video frame (``Qwen2VLVideoProcessor``'s default).
        video_max_pixels: the most pixels of a resized video frame (``Qwen2VLVideoProcessor``'s default).
        image_mean: per-channel mean subtracted after rescaling.
        image_std: per-channel standard deviation divided by after subtracting the mean.
        rescale_factor: what uint8 values are multiplied by before normalising.
        resample: Pillow resampling filter by name (``PIL.Image.Resampling``, case-insensitive).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: str = "bicubic"

    def __post_init__(self) -> None:
        self.image_mean, self.image_std = tuple(self.image_mean), tuple(self.image_std)
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "video_min_pixels"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        for kind in ("", "video_"):
            low, high = getattr(self, f"{kind}min_pixels"), getattr(self, f"{kind}max_pixels")
            if high < low:
                raise ValueError(f"{kind}max_pixels ({high}) must be at least {kind}min_pixels ({low})")
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) != 3:
                raise ValueError(f"{name} ({getattr(self, name)}) must have one value per RGB channel")
        if not all(s > 0 for s in self.image_std):
            raise ValueError(f"image_std ({self.image_std}) must be positive")
        names = [r.name.lower() for r in Image.Resampling]
        if self.resample.lower() not in names:
            raise ValueError(f"resample ({self.resample!r}) must be one of {names}")
        self._filter = Image.Resampling[self.resample.upper()]
        # Rescaling and normalising map each uint8 value on its own, so a [3, 256] table holds their result,
        # rounded as transformers rounds it: the product in float64, cast to float32, then float32 arithmetic.
        scaled = (np.arange(256, dtype=np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None]
        self._table_C256 = (scaled[None, :] - mean) / std

    @property
    def factor(self) -> int:
        """The multiple both resized sides have: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """The length of one patch row: ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    # ----- sizes without pixels ---------------------------------------------------------------------------
    def image_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The ``(t, h, w)`` patch grid of an image of ``height x width``, without processing it."""
        new_height, new_width = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, new_height // self.patch_size, new_width // self.patch_size

    def video_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` the ``num_frames`` sampled frames of ``height x width`` are resized to:
        :func:`smart_resize` of one frame at the video pixel limits."""
        return smart_resize(height, width, self.factor, self.video_min_pixels, self.video_max_pixels)

    def video_grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The ``(t, h, w)`` patch grid of a video of ``num_frames`` frames of ``height x width``."""
        new_height, new_width = self.video_size(num_frames, height, width)
        return (
            -(-num_frames // self.temporal_patch_size),
            new_height // self.patch_size,
            new_width // self.patch_size,
        )

    def num_tokens(self, grid_thw: Tensor) -> Tensor:
        """The LLM tokens each grid of ``grid_thw`` ``[N, 3]`` becomes (see ``num_merged_tokens``)."""
        return num_merged_tokens(grid_thw, self.merge_size)

    # ----- pixels -----------------------------------------------------------------------------------------
    def preprocess_images(self, images: Sequence[Image.Image]) -> dict[str, Tensor]:
        """Patch rows of ``images``, concatenated in order.

        Args:
            images: Pillow images of any size and mode.

        Returns:
            ``pixel_values`` float32 ``[sum of t*h*w, patch_dim]`` and ``image_grid_thw`` int64 ``[N, 3]``.
        """
        if isinstance(images, Image.Image) or not images:
            raise ValueError("images must be a non-empty sequence of Pillow images")
        rows, grids = [], []
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise TypeError(f"images[{i}] is a {type(image).__name__}, not a Pillow image")
            image = to_rgb(image)
            size = smart_resize(image.height, image.width, self.factor, self.min_pixels, self.max_pixels)
            frame_HWC = self._frame(image, size)
            frames_THWC = frame_HWC[None].expand(self.temporal_patch_size, -1, -1, -1)
            rows.append(self._patchify(frames_THWC))
            grids.append(self._grid(frames_THWC))
        return {"pixel_values": torch.cat(rows), "image_grid_thw": torch.tensor(grids, dtype=torch.int64)}

    def preprocess_videos(self, videos: Sequence[VideoInput]) -> dict[str, Tensor]:
        """Patch rows of ``videos``, concatenated in order.

        Args:
            videos: each a sequence of Pillow frames of one size, or a uint8 array / tensor ``[T, H, W, C]``
                with ``C`` 3 (RGB) or 1 (grey).

        Returns:
            ``pixel_values_videos`` float32 ``[sum of t*h*w, patch_dim]`` and ``video_grid_thw`` int64 ``[N, 3]``.
        """
        if isinstance(videos, np.ndarray | Tensor | Image.Image) or not videos:
            raise ValueError(
                "videos must be a non-empty sequence of videos (a 4-D array or a list of frames each)"
            )
        rows, grids = [], []
        for i, video in enumerate(videos):
            frames = _video_frames(video, f"videos[{i}]")
            size = self.video_size(len(frames), frames[0].height, frames[0].width)
            frames_THWC = torch.stack([self._frame(f, size) for f in frames])
            if pad := -len(frames) % self.temporal_patch_size:
                frames_THWC = torch.cat([frames_THWC, frames_THWC[-1:].expand(pad, -1, -1, -1)])
            rows.append(self._patchify(frames_THWC))
            grids.append(self._grid(frames_THWC))
        return {
            "pixel_values_videos": torch.cat(rows),
            "video_grid_thw": torch.tensor(grids, dtype=torch.int64),
        }

    def _frame(self, image: Image.Image, size: tuple[int, int]) -> Tensor:
        """``image`` (RGB) resized to ``size`` ``(height, width)``, rescaled and normalised: float32 ``[H, W, 3]``."""
        height, width = size
        resized_HWC = np.asarray(image.resize((width, height), resample=self._filter))
        return torch.from_numpy(self._table_C256[np.arange(3), resized_HWC])

    def _grid(self, frames_THWC: Tensor) -> tuple[int, int, int]:
        T, H, W, _ = frames_THWC.shape
        return T // self.temporal_patch_size, H // self.patch_size, W // self.patch_size

    def _patchify(self, frames_THWC: Tensor) -> Tensor:
        """Frames ``[T, H, W, C]`` (``T`` a multiple of the temporal patch) to patch rows in the merger's order."""
        T, H, W, C = frames_THWC.shape
        P, M, S = self.patch_size, self.merge_size, self.temporal_patch_size
        x = frames_THWC.reshape(T // S, S, H // (P * M), M, P, W // (P * M), M, P, C)
        x = x.permute(0, 2, 5, 3, 6, 8, 1, 4, 7)  # [t, bh, bw, mh, mw, C, S, ph, pw]
        return x.reshape(T // S * (H // P) * (W // P), C * S * P * P)


@dataclass(kw_only=True)
class Qwen3VLImageProcessor(Qwen2VLImageProcessor):
    """Qwen3-VL's images and videos: images as :class:`Qwen2VLImageProcessor` (the class transformers uses for
    Qwen3-VL images) with 16-pixel patches and mean / std 0.5; video frames resized by :func:`smart_resize_video`,
    whose pixel bounds span all sampled frames (transformers' ``Qwen3VLVideoProcessor``).

    The defaults are transformers' class defaults (its image class is Qwen2-VL's: ``min_pixels`` / ``max_pixels``
    3136 / 1003520); released checkpoints set their own ``size`` in ``preprocessor_config.json`` and
    ``video_preprocessor_config.json``: pass ``shortest_edge`` / ``longest_edge`` as ``min_pixels`` / ``max_pixels``
    and ``video_min_pixels`` / ``video_max_pixels``.

    Args:
        video_min_pixels: the least ``frames * height * width`` of a resized video (``size.shortest_edge``).
        video_max_pixels: the most ``frames * height * width`` of a resized video (``size.longest_edge``).
        video_cap_pixels_per_frame: cap each frame as the reference implementation (qwen-vl-utils) does, so that
            a video's token cost grows with its frame count (transformers' ``cap_pixels_per_frame``).
        video_max_frame_tokens: the per-frame cap in merged tokens (transformers' ``max_video_tokens``).
        Other arguments: as :class:`Qwen2VLImageProcessor`.
    """

    patch_size: int = 16
    video_min_pixels: int = 128 * 32 * 32
    video_max_pixels: int = 768 * 32 * 32
    video_cap_pixels_per_frame: bool = False
    video_max_frame_tokens: int = 768
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.video_max_frame_tokens > 0:
            raise ValueError(f"video_max_frame_tokens ({self.video_max_frame_tokens}) must be positive")

    def video_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """:func:`smart_resize_video` of the ``num_frames`` sampled frames, the bound capped per frame where
        :attr:`video_cap_pixels_per_frame` is set."""
        max_pixels = self.video_max_pixels
        if self.video_cap_pixels_per_frame:
            frame_cap = self.video_max_frame_tokens * self.factor**2
            per_frame = max(min(frame_cap, max_pixels // num_frames), int(self.video_min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        return smart_resize_video(
            num_frames,
            height,
            width,
            factor=self.factor,
            temporal_factor=self.temporal_patch_size,
            min_pixels=self.video_min_pixels,
            max_pixels=max_pixels,
        )


def _video_frames(video: VideoInput, name: str) -> list[Image.Image]:
    """The frames of ``video`` as RGB Pillow images of one size; ``name`` names it in errors."""
    if isinstance(video, Tensor):
        video = video.numpy(force=True)
    if isinstance(video, np.ndarray):
        if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] not in (1, 3):
            raise ValueError(
                f"{name} is a {video.dtype} array of shape {list(video.shape)}; expected uint8 [T, H, W, C] with "
                "C 3 (RGB) or 1 (grey): convert other layouts, ranges or alpha to RGB uint8 first"
            )
        frames = [Image.fromarray(f[..., 0] if f.shape[-1] == 1 else f).convert("RGB") for f in video]
    else:
        if isinstance(video, Image.Image) or not all(isinstance(f, Image.Image) for f in video):
            raise TypeError(
                f"{name} must be a list of Pillow frames or a [T, H, W, C] array; for one video of frames, "
                "pass [frames]"
            )
        frames = [to_rgb(f) for f in video]
    if not frames:
        raise ValueError(f"{name} has no frames")
    sizes = {f.size for f in frames}
    if len(sizes) > 1:
        raise ValueError(f"{name} has frames of several sizes (width, height): {sorted(sizes)}")
    return frames

"""LLaVA-OneVision's images and videos for the data module (``processor: llava_onevision``), value for value as
transformers' ``LlavaOnevisionImageProcessorPil`` makes them (the backend it uses without torchvision)::

    image (Pillow, any mode) ─ RGB (transparency onto white)
      the sample's only image: ─ base tile: resize to S x S (bicubic)
                               ─ best pinpoint (best_resolution) ─ resize to fit it, aspect kept (sides ceiled)
                                 ─ zero padding centred (the odd pixel below / right) ─ S x S tiles, row-major
      one of several images:   ─ padded to a square with the mean colour (int(mean * 255)) ─ resize to S x S
    ─ rescale (float64, then float32) ─ normalise (float32) ─ pixel_values [tiles, 3, S, S]

beside ``image_sizes [images, 2]`` (height, width) and ``batch_num_images [1]`` per sample (the samples' counts in
a batch, as transformers' processor gives them). Each image becomes the ``<image>`` tokens the model's
:func:`~forge_lightning.modules.vlm.anyres.num_image_tokens` counts (the same functions, so the data and the model
agree by construction; the tests check them against ``LlavaOnevisionProcessor``).

A video: ``num_frames`` frames sampled as transformers' ``default_sample_indices_fn`` (``arange(n) * total // n``),
each resized to ``S x S`` and normalised as an image: ``pixel_values_videos [1, frames, 3, S, S]``, and
``frames * ceil(side / 2) ** 2 + 1`` ``<video>`` tokens (the pooled frames and one newline). transformers' video
processor needs torchvision and resizes with its bicubic, which differs from Pillow's by a few uint8 levels; frames
already at ``S x S`` see no difference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from forge_lightning.datamodules.vlm.image_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, to_rgb
from forge_lightning.datamodules.vlm.video import VideoInfo
from forge_lightning.modules.vlm.anyres import (
    best_resolution,
    check_aspect_ratio,
    grid_pinpoints,
    num_image_tokens,
    num_tiles,
    num_video_tokens,
)


@dataclass(kw_only=True)
class LlavaOnevisionImageProcessor:
    """Images and video frames to LLaVA-OneVision tiles, equal to transformers' ``LlavaOnevisionImageProcessorPil``.

    The defaults are the released checkpoints' (``llava-onevision-qwen2-*-ov-hf``: SigLIP at 384, patch 14, 1 to 6
    tiles a side, ``anyres_max_9``).

    Args:
        image_size: side of a tile (the tower's ``image_size``).
        patch_size: side of a tower patch (one feature per patch).
        image_grid_pinpoints: ``[height, width]`` resolutions an image may be tiled at, multiples of
            ``image_size`` (default: 1 to 6 tiles a side).
        vision_aspect_ratio: ``anyres_max_N``: tile features over ``N`` tiles' worth are shrunk (the token count).
        image_mean: per-channel mean subtracted after rescaling (OpenAI CLIP's, as transformers' class).
        image_std: per-channel standard deviation divided by.
        resample: Pillow resampling filter by name.
    """

    image_size: int = 384
    patch_size: int = 14
    image_grid_pinpoints: list[list[int]] | None = None
    vision_aspect_ratio: str = "anyres_max_9"
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    resample: str = "bicubic"

    def __post_init__(self) -> None:
        S = self.image_size
        if not 0 < self.patch_size <= S:  # need not divide it: SigLIP's 384 / 14 gives 27 patches a side
            raise ValueError(f"patch_size ({self.patch_size}) must be positive and at most image_size ({S})")
        self.image_grid_pinpoints = grid_pinpoints(self.image_grid_pinpoints, S)
        check_aspect_ratio(self.vision_aspect_ratio)
        self.image_mean, self.image_std = tuple(self.image_mean), tuple(self.image_std)
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or not all(s > 0 for s in self.image_std):
            raise ValueError(
                f"image_mean ({self.image_mean}) and image_std ({self.image_std}) need 3 values, std positive"
            )
        self._filter = Image.Resampling[self.resample.upper()]
        # uint8 -> normalised float32 per channel, rounded as transformers rounds it (rescale in float64, cast).
        scaled = (np.arange(256, dtype=np.float64) / 255).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None]
        self._table_C256 = (scaled[None, :] - mean) / std
        # transformers pads the images of multi-image samples with the mean colour, truncated to uint8.
        self._background = tuple(int(m * 255) for m in self.image_mean)

    # ----- the geometry (what modules.vlm.anyres reads) -----------------------------------------------------
    @property
    def grid_side(self) -> int:
        """Features a side of one tile: ``image_size // patch_size``."""
        return self.image_size // self.patch_size

    @property
    def max_tiles(self) -> int:
        """``N`` of :attr:`vision_aspect_ratio`."""
        return check_aspect_ratio(self.vision_aspect_ratio)

    def num_image_tokens(self, height: int, width: int, tiled: bool = True) -> int:
        """``<image>`` tokens of an image of ``height x width`` (tiled: the sample's only image)."""
        return num_image_tokens(self, (height, width), tiled)

    def num_tiles(self, height: int, width: int, tiled: bool = True) -> int:
        """Tiles of such an image in ``pixel_values``."""
        return num_tiles(self, (height, width), tiled)

    # ----- pixels -----------------------------------------------------------------------------------------
    def preprocess_images(self, images: Sequence[Image.Image]) -> dict[str, Tensor]:
        """The tiles of one sample's ``images``: each tiled when it is the only one, its base tile alone (padded
        to a square) when there are several.

        Returns:
            ``pixel_values`` float32 ``[tiles, 3, S, S]``, ``image_sizes`` int64 ``[images, 2]`` (height, width)
            and ``batch_num_images`` int64 ``[1]``.
        """
        if isinstance(images, Image.Image) or not images:
            raise ValueError("images must be a non-empty sequence of Pillow images")
        tiled = len(images) == 1
        tiles = [self.tiles_uint8(to_rgb(image), tiled) for image in images]
        return {
            "pixel_values": self._normalised(np.concatenate(tiles)),
            "image_sizes": torch.tensor([[i.height, i.width] for i in images], dtype=torch.int64),
            "batch_num_images": torch.tensor([len(images)], dtype=torch.int64),
        }

    def tiles_uint8(self, image: Image.Image, tiled: bool = True) -> np.ndarray:
        """The uint8 tiles ``[N, S, S, 3]`` of an RGB ``image``: its base tile then its grid tiles (``tiled``), or its
        base tile from the image padded to a square."""
        S = self.image_size
        if not tiled:
            return self._resized(self._square(image), S, S)[None]
        base = self._resized(image, S, S)
        height, width = best_resolution((image.height, image.width), self.image_grid_pinpoints)
        fit_h, fit_w = _fit_size(image.height, image.width, height, width)
        padded = np.zeros((height, width, 3), np.uint8)
        top, left = (height - fit_h) // 2, (width - fit_w) // 2
        padded[top : top + fit_h, left : left + fit_w] = self._resized(image, fit_h, fit_w)
        grid = padded.reshape(height // S, S, width // S, S, 3).transpose(0, 2, 1, 3, 4).reshape(-1, S, S, 3)
        return np.concatenate([base[None], grid])

    def preprocess_video(self, frames_THWC: np.ndarray) -> Tensor:
        """The sampled uint8 ``[T, H, W, 3]`` frames of a video, each resized to ``S x S`` and normalised:
        float32 ``[T, 3, S, S]``."""
        if frames_THWC.dtype != np.uint8 or frames_THWC.ndim != 4 or frames_THWC.shape[-1] != 3:
            raise ValueError(
                f"video frames are a {frames_THWC.dtype} array of shape {list(frames_THWC.shape)}; expected uint8 "
                "[T, H, W, 3]"
            )
        S = self.image_size
        return self._normalised(np.stack([self._resized(Image.fromarray(f), S, S) for f in frames_THWC]))

    def _resized(self, image: Image.Image, height: int, width: int) -> np.ndarray:
        return np.asarray(image.resize((width, height), resample=self._filter))

    def _square(self, image: Image.Image) -> Image.Image:
        """``image`` centred on a square of the mean colour (the top / left margin the smaller one)."""
        side = max(image.size)
        if image.width == image.height:
            return image
        square = Image.new("RGB", (side, side), self._background)
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        return square

    def _normalised(self, tiles_NHWC: np.ndarray) -> Tensor:
        values_NHWC = self._table_C256[np.arange(3), tiles_NHWC]
        return torch.from_numpy(values_NHWC).permute(0, 3, 1, 2).contiguous()


def _fit_size(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """The size an image is resized to before padding to ``target``: scaled to fit, the other side ceiled
    (transformers' ``get_patch_output_size``)."""
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


@dataclass(frozen=True)
class UniformFrameSampling:
    """``num_frames`` frames spread evenly over a video: ``arange(num_frames) * total // num_frames``
    (transformers' ``default_sample_indices_fn``, which LLaVA-OneVision's video processor uses).

    It stands where the video readers take a :class:`~forge_lightning.datamodules.vlm.video.VideoSampling`:
    they call only :meth:`indices`.

    Args:
        num_frames: frames per video (every video of a batch has as many: ``pixel_values_videos`` is one tensor).
    """

    num_frames: int = 32

    def __post_init__(self) -> None:
        if self.num_frames < 1:
            raise ValueError(f"video_num_frames ({self.num_frames}) must be positive")

    def indices(self, info: VideoInfo) -> list[int]:
        """The frame indices to decode.

        Raises:
            ValueError: the video has fewer frames than :attr:`num_frames`.
        """
        if self.num_frames > info.num_frames:
            raise ValueError(
                f"a video of {info.num_frames} frames cannot give {self.num_frames} sampled frames "
                "(video_num_frames): use a longer video or fewer frames"
            )
        return (np.arange(self.num_frames, dtype=np.int64) * info.num_frames // self.num_frames).tolist()


class LlavaOnevisionVisionInputs:
    """LLaVA-OneVision images and videos (``processor: llava_onevision``): any-resolution tiles of
    :class:`LlavaOnevisionImageProcessor` (``pixel_values [tiles, 3, S, S]``, ``image_sizes``,
    ``batch_num_images``), ``<image>`` tokens as the model counts them; videos of :class:`UniformFrameSampling`
    frames as ``pixel_values_videos [videos, frames, 3, S, S]`` and ``<video>`` tokens. 1-D positions.

    Args:
        processor: the image processor (its geometry must be the model's ``vision`` config).
        image_token_id: ``<image>``.
        video_token_id: ``<video>``, or ``None`` for a tokenizer without it (images only).
        sampling: the frames of a video.
    """

    name: ClassVar[str] = "llava_onevision"
    options: ClassVar[tuple[str, ...]] = (
        "image_size",
        "patch_size",
        "image_grid_pinpoints",
        "vision_aspect_ratio",
        "video_num_frames",
    )
    tokens: ClassVar[dict[str, str]] = {"image_token_id": "<image>"}
    image_token = "<image>"
    video_token = "<video>"
    tokens_per_second = None

    def __init__(
        self,
        processor: LlavaOnevisionImageProcessor,
        *,
        image_token_id: int,
        video_token_id: int | None = None,
        sampling: UniformFrameSampling | None = None,
    ) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.sampling = sampling or UniformFrameSampling()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **options: Any) -> LlavaOnevisionVisionInputs:
        """Built with the ``<image>`` (and, where it has one, ``<video>``) id of ``tokenizer`` and the
        :class:`LlavaOnevisionImageProcessor` ``options`` plus ``video_num_frames``.

        Raises:
            ValueError: the tokenizer lacks ``<image>``, or an option is out of range (named).
        """
        from forge_lightning.datamodules.vlm.vision_inputs import special_token_id, token_ids

        sampling = UniformFrameSampling(options.pop("video_num_frames", 32))
        return cls(
            LlavaOnevisionImageProcessor(**options),
            **token_ids(tokenizer, cls.tokens, cls.name),
            video_token_id=special_token_id(tokenizer, cls.video_token),
            sampling=sampling,
        )

    @property
    def special_token_ids(self) -> dict[str, int]:
        """``image_token_id``, and ``video_token_id`` when the tokenizer has ``<video>``."""
        ids = {"image_token_id": self.image_token_id}
        return ids if self.video_token_id is None else {**ids, "video_token_id": self.video_token_id}

    # ----- images: sizes are (width, height), as Pillow gives them --------------------------------------------
    def placeholder_ids(self, size: tuple[int, int]) -> list[int]:
        """The ``<image>`` tokens of a sample's only image of ``size``."""
        return self.sample_placeholder_ids([size])[0]

    def num_patches(self, size: tuple[int, int]) -> int:
        """Tower patches of a sample's only image: its tiles times ``grid_side ** 2``."""
        return self.sample_num_patches([size])

    def sample_placeholder_ids(self, sizes: Sequence[tuple[int, int]]) -> list[list[int]]:
        """The ``<image>`` tokens of each image of one sample (tiled only when it is the sample's only one)."""
        tiled = len(sizes) == 1
        return [[self.image_token_id] * self.processor.num_image_tokens(h, w, tiled) for w, h in sizes]

    def sample_num_patches(self, sizes: Sequence[tuple[int, int]]) -> int:
        """Tower patches of one sample's images."""
        tiled = len(sizes) == 1
        tiles = sum(self.processor.num_tiles(h, w, tiled) for w, h in sizes)
        return tiles * self.processor.grid_side**2

    def process(self, images: Sequence[Image.Image]) -> dict[str, Tensor]:
        """``pixel_values [tiles, 3, S, S]``, ``image_sizes [images, 2]`` and ``batch_num_images [1]``."""
        return self.processor.preprocess_images(images)

    # ----- videos -----------------------------------------------------------------------------------------
    def video_grid(self, info: VideoInfo) -> tuple[int, int, int]:
        """``(frames, grid_side, grid_side)``: the tower sees every sampled frame as one tile.

        Raises:
            ValueError: the video has fewer frames than the sampling takes.
        """
        side = self.processor.grid_side
        return len(self.sampling.indices(info)), side, side

    def video_text(self, info: VideoInfo) -> str:
        """The ``<video>`` token, once."""
        return self.video_token

    def video_placeholders(self, info: VideoInfo) -> list[list[int]]:
        """One item: ``frames * ceil(grid_side / 2) ** 2 + 1`` ``<video>`` tokens.

        Raises:
            ValueError: the tokenizer has no ``<video>``.
        """
        if self.video_token_id is None:
            raise ValueError(f"the tokenizer has no {self.video_token} token for videos")
        frames, _, _ = self.video_grid(info)
        return [[self.video_token_id] * num_video_tokens(self.processor, frames)]

    def video_num_patches(self, info: VideoInfo) -> int:
        """Tower patches of the sampled frames."""
        return math.prod(self.video_grid(info))

    def process_videos(self, videos: Sequence[np.ndarray], infos: Sequence[VideoInfo]) -> dict[str, Tensor]:
        """``pixel_values_videos [videos, frames, 3, S, S]`` of the sampled uint8 ``[T, H, W, 3]`` frames."""
        return {"pixel_values_videos": torch.stack([self.processor.preprocess_video(v) for v in videos])}

    def positions(self, input_ids: Tensor, inputs: dict[str, Tensor]) -> None:
        """``None``: 1-D positions ``0 .. n-1``, as LLaVA gives its LLM."""
        return None

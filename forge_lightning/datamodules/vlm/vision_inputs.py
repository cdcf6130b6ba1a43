"""The image side of a vision-language sample: which tokens stand for an image in the text, and its pixel inputs.

A :class:`VisionInputs` renders each image as one :attr:`~VisionInputs.image_token` in the chat text, then the
encoder replaces that token by :meth:`~VisionInputs.placeholder_ids` of the image's size; :meth:`process` makes the
pixel inputs the model takes. Two are built in (:data:`PROCESSORS`):

* ``qwen2_vl``: Qwen2-VL / Qwen2.5-VL dynamic resolution, ``<|vision_start|>`` + N x ``<|image_pad|>`` +
  ``<|vision_end|>`` with N the merged tokens after ``smart_resize``; ``pixel_values [patches, patch_dim]`` and
  ``image_grid_thw [images, 3]``. Videos (a :class:`VideoInputs`) likewise with ``<|video_pad|>``, their frames
  sampled by :class:`~forge_lightning.datamodules.vlm.video.VideoSampling`: ``pixel_values_videos``,
  ``video_grid_thw [videos, 3]`` and ``second_per_grid_ts [videos]``.
* ``fixed``: a fixed-resolution encoder (SigLIP, CLIP as in LLaVA): ``(image_size // patch_size) ** 2`` x
  ``<image>``; ``pixel_values [images, 3, image_size, image_size]``.
* ``llava_onevision``: LLaVA-OneVision's any-resolution tiles and videos
  (:mod:`~forge_lightning.datamodules.vlm.anyres_processor`); an image's tokens depend on whether it is its
  sample's only one (a :class:`SampleImageInputs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from forge_lightning.datamodules.vlm.anyres_processor import LlavaOnevisionVisionInputs
from forge_lightning.datamodules.vlm.image_processor import Qwen2VLImageProcessor
from forge_lightning.datamodules.vlm.video import VideoInfo, VideoSampling
from forge_lightning.modules.vlm.positions import get_rope_index


@runtime_checkable
class VisionInputs(Protocol):
    """How images enter a sample: their tokens in the text and their pixel inputs."""

    image_token: str
    """The token that stands for one image in the rendered chat text (a special token of the tokenizer)."""

    image_token_id: int
    """Its id."""

    video_token: str | None
    """The token that stands for one video, or ``None`` where the inputs take no videos."""

    video_token_id: int | None
    """Its id, or ``None`` where the inputs take no videos (or the tokenizer has no such token)."""

    tokens_per_second: float | None
    """Temporal positions per second of video the host-side positions use (``None`` where the inputs take no
    videos); the model's config must agree."""

    @property
    def special_token_ids(self) -> dict[str, int]:
        """The special token ids the model must agree on, by their config names (``image_token_id`` ...)."""
        ...

    def placeholder_ids(self, size: tuple[int, int]) -> list[int]:
        """The token ids that replace the image token for an image of ``size`` ``(width, height)``."""
        ...

    def num_patches(self, size: tuple[int, int]) -> int:
        """The vision-encoder patches of an image of ``size`` ``(width, height)``."""
        ...

    def process(self, images: Sequence[Image.Image]) -> dict[str, Tensor]:
        """The model's pixel inputs for RGB ``images`` of one sample, in order; concatenating those of several
        samples along dim 0 gives the batch's."""
        ...

    def positions(self, input_ids: Tensor, inputs: dict[str, Tensor]) -> Tensor | None:
        """The LLM positions of one sample's ``input_ids [n]`` with its pixel ``inputs`` (what packing puts in a
        row): ``[3, n]`` multimodal RoPE positions, or ``None`` for ``0 .. n-1``."""
        ...


@runtime_checkable
class VideoInputs(VisionInputs, Protocol):
    """Vision inputs that take videos too (where :attr:`video_token_id` is set)."""

    sampling: VideoSampling
    """Which frames of a video are sampled."""

    def video_placeholder_ids(self, info: VideoInfo) -> list[int]:
        """The token ids that replace the video token for a video whose header says ``info``."""
        ...

    def video_num_patches(self, info: VideoInfo) -> int:
        """The vision-encoder patches of such a video."""
        ...

    def video_grid(self, info: VideoInfo) -> tuple[int, int, int]:
        """Its ``(t, h, w)`` patch grid."""
        ...

    def process_videos(self, videos: Sequence[np.ndarray], infos: Sequence[VideoInfo]) -> dict[str, Tensor]:
        """The model's video inputs for the sampled uint8 ``[T, H, W, 3]`` frames of one sample's videos."""
        ...


@runtime_checkable
class SampleImageInputs(VisionInputs, Protocol):
    """Vision inputs whose image tokens depend on the sample's other images (LLaVA-OneVision tiles an image only
    when it is the sample's only one)."""

    def sample_placeholder_ids(self, sizes: Sequence[tuple[int, int]]) -> list[list[int]]:
        """The token ids that replace each image token of one sample whose images have ``sizes``."""
        ...

    def sample_num_patches(self, sizes: Sequence[tuple[int, int]]) -> int:
        """The vision-encoder patches of one sample's images."""
        ...


def image_placeholder_ids(vision: VisionInputs, sizes: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The token ids of each image of one sample whose images have ``sizes`` ``(width, height)``."""
    if isinstance(vision, SampleImageInputs):
        return vision.sample_placeholder_ids(sizes)
    return [vision.placeholder_ids(size) for size in sizes]


def image_num_patches(vision: VisionInputs, sizes: Sequence[tuple[int, int]]) -> int:
    """The vision-encoder patches of one sample's images."""
    if isinstance(vision, SampleImageInputs):
        return vision.sample_num_patches(sizes)
    return sum(vision.num_patches(size) for size in sizes)


VIDEO_OPTIONS = (
    "video_fps",
    "video_num_frames",
    "video_min_frames",
    "video_max_frames",
    "video_min_pixels",
    "video_max_pixels",
    "tokens_per_second",
)
"""The data module's video options of :class:`Qwen2VLVisionInputs`."""


def special_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` if the tokenizer has it as one token that text containing it encodes to, else ``None``."""
    token_id = tokenizer.get_vocab().get(token)
    if token_id is None or tokenizer.encode(token, add_special_tokens=False) != [token_id]:
        return None
    return token_id


def token_ids(tokenizer: Any, tokens: dict[str, str], processor: str) -> dict[str, int]:
    """``{name: id}`` of ``tokens`` (``{name: token}``) in ``tokenizer``.

    Raises:
        ValueError: naming every token the tokenizer lacks.
    """
    ids = {name: special_token_id(tokenizer, token) for name, token in tokens.items()}
    missing = [tokens[name] for name, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(
            f"the tokenizer ({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}) lacks the special "
            f"token(s) {', '.join(missing)} that processor {processor!r} writes for images: use the tokenizer of "
            "the model being trained (its checkpoint directory), whose vocabulary and embeddings have them"
        )
    return ids  # type: ignore[return-value]


class Qwen2VLVisionInputs:
    """Qwen2-VL / Qwen2.5-VL images and videos: dynamic resolution, one ``<|image_pad|>`` (``<|video_pad|>``) per
    merged patch between ``<|vision_start|>`` and ``<|vision_end|>``, the patches of :class:`Qwen2VLImageProcessor`.

    Args:
        processor: the image processor (its pixel limits decide the token count of each image and video frame).
        image_token_id: ``<|image_pad|>``.
        vision_start_token_id: ``<|vision_start|>``.
        vision_end_token_id: ``<|vision_end|>``.
        video_token_id: ``<|video_pad|>``, or ``None`` for a tokenizer without it (images only).
        sampling: which frames of a video are sampled (its ``temporal_patch_size`` must be the processor's).
        tokens_per_second: Qwen2.5-VL's temporal positions per second of video (the model's
            ``vision_config.tokens_per_second``), for the positions of packed rows.
    """

    name: ClassVar[str] = "qwen2_vl"
    options: ClassVar[tuple[str, ...]] = (
        "min_pixels",
        "max_pixels",
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        *VIDEO_OPTIONS,
    )
    tokens: ClassVar[dict[str, str]] = {
        "image_token_id": "<|image_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"

    def __init__(
        self,
        processor: Qwen2VLImageProcessor,
        *,
        image_token_id: int,
        vision_start_token_id: int,
        vision_end_token_id: int,
        video_token_id: int | None = None,
        sampling: VideoSampling | None = None,
        tokens_per_second: float = 2.0,
    ) -> None:
        sampling = sampling or VideoSampling(temporal_patch_size=processor.temporal_patch_size)
        if sampling.temporal_patch_size != processor.temporal_patch_size:
            raise ValueError(
                f"the video sampling's temporal_patch_size ({sampling.temporal_patch_size}) must be the "
                f"processor's ({processor.temporal_patch_size})"
            )
        if not tokens_per_second > 0:
            raise ValueError(f"tokens_per_second ({tokens_per_second}) must be positive")
        self.processor = processor
        self.image_token_id = image_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.video_token_id = video_token_id
        self.sampling = sampling
        self.tokens_per_second = tokens_per_second

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **options: float) -> Qwen2VLVisionInputs:
        """Built with the token ids of ``tokenizer`` (``<|video_pad|>`` where it has one), the
        :class:`Qwen2VLImageProcessor` ``options`` and the ``video_*`` sampling options (:data:`VIDEO_OPTIONS`).

        Raises:
            ValueError: the tokenizer lacks an image token, or an option is out of range (named).
        """
        video = {k: options.pop(k) for k in VIDEO_OPTIONS if k in options}
        tokens_per_second = video.pop("tokens_per_second", 2.0)
        pixels = {k: video.pop(k) for k in ("video_min_pixels", "video_max_pixels") if k in video}
        processor = Qwen2VLImageProcessor(**options, **pixels)  # type: ignore[arg-type]
        return cls(
            processor,
            **token_ids(tokenizer, cls.tokens, cls.name),
            video_token_id=special_token_id(tokenizer, cls.video_token),
            sampling=video_sampling(processor.temporal_patch_size, **video),
            tokens_per_second=tokens_per_second,
        )

    @property
    def special_token_ids(self) -> dict[str, int]:
        """``image_token_id``, ``vision_start_token_id``, ``vision_end_token_id``, and ``video_token_id`` when the
        tokenizer has one."""
        ids = {name: getattr(self, name) for name in self.tokens}
        return ids if self.video_token_id is None else {**ids, "video_token_id": self.video_token_id}

    def _grid(self, size: tuple[int, int]) -> tuple[int, int, int]:
        width, height = size
        return self.processor.image_grid(height, width)

    def _placeholder(self, token_id: int, grid: tuple[int, int, int]) -> list[int]:
        t, h, w = grid
        count = t * h * w // self.processor.merge_size**2
        return [self.vision_start_token_id, *[token_id] * count, self.vision_end_token_id]

    def placeholder_ids(self, size: tuple[int, int]) -> list[int]:
        """``<|vision_start|>``, one ``<|image_pad|>`` per merged patch, ``<|vision_end|>``."""
        return self._placeholder(self.image_token_id, self._grid(size))

    def num_patches(self, size: tuple[int, int]) -> int:
        """Rows of ``pixel_values`` the image becomes: ``t * h * w``."""
        return math.prod(self._grid(size))

    def video_grid(self, info: VideoInfo) -> tuple[int, int, int]:
        """The ``(t, h, w)`` patch grid of the sampled frames of a video.

        Raises:
            ValueError: the video is too short for the sampling, or its frames have an aspect ratio Qwen2-VL
                refuses.
        """
        return self.processor.video_grid(len(self.sampling.indices(info)), info.height, info.width)

    def video_placeholder_ids(self, info: VideoInfo) -> list[int]:
        """``<|vision_start|>``, one ``<|video_pad|>`` per merged patch of the sampled frames, ``<|vision_end|>``.

        Raises:
            ValueError: the tokenizer has no ``<|video_pad|>``.
        """
        if self.video_token_id is None:
            raise ValueError(f"the tokenizer has no {self.video_token} token for videos")
        return self._placeholder(self.video_token_id, self.video_grid(info))

    def video_num_patches(self, info: VideoInfo) -> int:
        """Rows of ``pixel_values_videos`` the video becomes: ``t * h * w``."""
        return math.prod(self.video_grid(info))

    def process(self, images: Sequence[Image.Image]) -> dict[str, Tensor]:
        """``pixel_values [patches, patch_dim]`` and ``image_grid_thw [images, 3]``."""
        return self.processor.preprocess_images(images)

    def process_videos(self, videos: Sequence[np.ndarray], infos: Sequence[VideoInfo]) -> dict[str, Tensor]:
        """``pixel_values_videos [patches, patch_dim]``, ``video_grid_thw [videos, 3]`` and ``second_per_grid_ts
        [videos]`` (float32, as transformers' processor gives it) of the sampled frames ``videos`` (uint8
        ``[T, H, W, 3]`` each) of videos whose headers said ``infos``."""
        out = self.processor.preprocess_videos(videos)
        seconds = [self.sampling.seconds_per_grid(info) for info in infos]
        return {**out, "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32)}

    def positions(self, input_ids: Tensor, inputs: dict[str, Tensor]) -> Tensor:
        """``[3, n]`` multimodal RoPE positions (:func:`~forge_lightning.modules.vlm.positions.get_rope_index`),
        Qwen2.5-VL's video timing with :attr:`tokens_per_second`."""
        videos = inputs.get("video_grid_thw")
        positions_3BN, _ = get_rope_index(
            input_ids[None],
            image_token_id=self.image_token_id,
            video_token_id=-1
            if self.video_token_id is None
            else self.video_token_id,  # -1: an id no token has
            spatial_merge_size=self.processor.merge_size,
            image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=videos,
            second_per_grid_ts=inputs.get("second_per_grid_ts"),
            tokens_per_second=None if videos is None else self.tokens_per_second,
        )
        return positions_3BN[:, 0]


def video_sampling(
    temporal_patch_size: int,
    *,
    video_fps: float | None = None,
    video_num_frames: int | None = None,
    video_min_frames: int | None = None,
    video_max_frames: int | None = None,
) -> VideoSampling:
    """The :class:`VideoSampling` of the data module's ``video_*`` options (unset ones keep transformers'
    defaults).

    Raises:
        ValueError: both ``video_fps`` and ``video_num_frames``, or a value out of range (named).
    """
    if video_fps is not None and video_num_frames is not None:
        raise ValueError(
            f"video_fps ({video_fps}) and video_num_frames ({video_num_frames}) both choose how many frames are "
            "sampled: set one of them"
        )
    given = {"fps": video_fps, "num_frames": video_num_frames}
    given |= {"min_frames": video_min_frames, "max_frames": video_max_frames}
    try:
        return VideoSampling(
            temporal_patch_size=temporal_patch_size, **{k: v for k, v in given.items() if v is not None}
        )
    except ValueError as error:  # name the data module's options, not the dataclass fields
        raise ValueError(f"{error} (the video_* options)") from None


class FixedResolutionVisionInputs:
    """Images of a fixed-resolution encoder (SigLIP; CLIP as in LLaVA): each resized to ``image_size`` square,
    rescaled to ``[0, 1]``, normalised, and written as ``(image_size // patch_size) ** 2`` image tokens.

    Args:
        image_token_id: the ``<image>`` token.
        image_size: side of the square the encoder takes, in pixels.
        patch_size: side of an encoder patch (one image token per patch).
        image_mean: per-channel mean subtracted after rescaling (SigLIP's 0.5).
        image_std: per-channel standard deviation divided by (SigLIP's 0.5).
        resample: Pillow resampling filter by name.
    """

    name: ClassVar[str] = "fixed"
    options: ClassVar[tuple[str, ...]] = ("image_size", "patch_size")
    tokens: ClassVar[dict[str, str]] = {"image_token_id": "<image>"}
    image_token = "<image>"
    video_token = None
    video_token_id = None
    tokens_per_second = None

    def __init__(
        self,
        *,
        image_token_id: int,
        image_size: int = 384,
        patch_size: int = 14,
        image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
        image_std: tuple[float, float, float] = (0.5, 0.5, 0.5),
        resample: str = "bicubic",
    ) -> None:
        if not 0 < patch_size <= image_size:
            raise ValueError(
                f"patch_size ({patch_size}) must be positive and at most image_size ({image_size})"
            )
        if len(image_mean) != 3 or len(image_std) != 3 or not all(s > 0 for s in image_std):
            raise ValueError(
                f"image_mean ({image_mean}) and image_std ({image_std}) need 3 values, std positive"
            )
        self.image_token_id = image_token_id
        self.image_size = image_size
        self.patch_size = patch_size
        self._filter = Image.Resampling[resample.upper()]
        # uint8 -> normalised float32 per channel, rounded as transformers rounds it (rescale in float64, cast).
        scaled = (np.arange(256, dtype=np.float64) / 255).astype(np.float32)
        mean = np.asarray(image_mean, dtype=np.float32)[:, None]
        std = np.asarray(image_std, dtype=np.float32)[:, None]
        self._table_C256 = (scaled[None, :] - mean) / std

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **options: int) -> FixedResolutionVisionInputs:
        """Built with the ``<image>`` id of ``tokenizer`` and ``image_size`` / ``patch_size`` ``options``."""
        return cls(**token_ids(tokenizer, cls.tokens, cls.name), **options)

    @property
    def special_token_ids(self) -> dict[str, int]:
        """``image_token_id``."""
        return {"image_token_id": self.image_token_id}

    @property
    def tokens_per_image(self) -> int:
        """``(image_size // patch_size) ** 2``."""
        return (self.image_size // self.patch_size) ** 2

    def placeholder_ids(self, size: tuple[int, int]) -> list[int]:
        """:attr:`tokens_per_image` ``<image>`` tokens, whatever the size."""
        return [self.image_token_id] * self.tokens_per_image

    def num_patches(self, size: tuple[int, int]) -> int:
        """:attr:`tokens_per_image`."""
        return self.tokens_per_image

    def process(self, images: Sequence[Image.Image]) -> dict[str, Tensor]:
        """``pixel_values [images, 3, image_size, image_size]`` float32."""
        side = (self.image_size, self.image_size)
        pixels_NHWC = np.stack(
            [np.asarray(i.convert("RGB").resize(side, resample=self._filter)) for i in images]
        )
        pixels_NHWC = self._table_C256[np.arange(3), pixels_NHWC]
        return {"pixel_values": torch.from_numpy(pixels_NHWC).permute(0, 3, 1, 2).contiguous()}

    def positions(self, input_ids: Tensor, inputs: dict[str, Tensor]) -> None:
        """``None``: 1-D positions ``0 .. n-1``, as LLaVA gives its LLM."""
        return None


PROCESSORS: dict[
    str, type[Qwen2VLVisionInputs] | type[FixedResolutionVisionInputs] | type[LlavaOnevisionVisionInputs]
] = {
    "qwen2_vl": Qwen2VLVisionInputs,
    "fixed": FixedResolutionVisionInputs,
    "llava_onevision": LlavaOnevisionVisionInputs,
}
"""The built-in :class:`VisionInputs` by name."""

"""The image side of a vision-language sample: which tokens stand for an image in the text, and its pixel inputs.

A :class:`VisionInputs` renders each image as one :attr:`~VisionInputs.image_token` in the chat text, then the
encoder replaces that token by :meth:`~VisionInputs.placeholder_ids` of the image's size; :meth:`process` makes the
pixel inputs the model takes. Three are built in (:data:`PROCESSORS`):

* ``qwen2_vl``: Qwen2-VL / Qwen2.5-VL dynamic resolution, ``<|vision_start|>`` + N x ``<|image_pad|>`` +
  ``<|vision_end|>`` with N the merged tokens after ``smart_resize``; ``pixel_values [patches, patch_dim]`` and
  ``image_grid_thw [images, 3]``. Videos (a :class:`VideoInputs`) likewise with ``<|video_pad|>``, their frames
  sampled by :class:`~forge_lightning.datamodules.vlm.video.VideoSampling`: ``pixel_values_videos``,
  ``video_grid_thw [videos, 3]`` and ``second_per_grid_ts [videos]``.
* ``qwen3_vl``: Qwen3-VL, images as ``qwen2_vl`` (16-pixel patches, mean / std 0.5); a video is written as text
  and tokens per temporal patch, its time as text instead of ``second_per_grid_ts``::

      <0.3 seconds><|vision_start|><|video_pad|> x N<|vision_end|><1.5 seconds><|vision_start|> ... <|vision_end|>

  with N the merged tokens of one frame; ``pixel_values_videos`` and ``video_grid_thw [videos, 3]``.
* ``fixed``: a fixed-resolution encoder (SigLIP, CLIP as in LLaVA): ``(image_size // patch_size) ** 2`` x
  ``<image>``; ``pixel_values [images, 3, image_size, image_size]``.
* ``llava_onevision``: LLaVA-OneVision's any-resolution tiles and videos
  (:mod:`~forge_lightning.datamodules.vlm.anyres_processor`); an image's tokens depend on whether it is its
  sample's only one (a :class:`SampleImageInputs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from forge_lightning.datamodules.vlm.anyres_processor import LlavaOnevisionVisionInputs
from forge_lightning.datamodules.vlm.image_processor import Qwen2VLImageProcessor, Qwen3VLImageProcessor
from forge_lightning.datamodules.vlm.video import Qwen3VideoSampling, VideoInfo, VideoSampling
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
    videos or write their time as text); the model's config must agree."""

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

    def video_text(self, info: VideoInfo) -> str:
        """How a video whose header says ``info`` is written in the chat text (where its record has ``<video>``):
        the video token, once per item of :meth:`video_placeholders`, with any text between."""
        ...

    def video_placeholders(self, info: VideoInfo) -> list[list[int]]:
        """The token ids that replace each video token of :meth:`video_text`, in order."""
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


SAMPLING_OPTIONS = ("video_fps", "video_num_frames", "video_min_frames", "video_max_frames")
"""The data module's options of :func:`video_sampling`."""


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


class QwenVLVisionInputs:
    """What Qwen2-VL, Qwen2.5-VL and Qwen3-VL share: dynamic resolution, one ``<|image_pad|>`` (``<|video_pad|>``)
    per merged patch between ``<|vision_start|>`` and ``<|vision_end|>``, the patches of an image processor;
    the subclasses say how a video's time enters (:meth:`video_text`, :meth:`process_videos`, :meth:`positions`).

    Args:
        processor: the image processor (its pixel limits decide the token count of each image and video frame).
        image_token_id: ``<|image_pad|>``.
        vision_start_token_id: ``<|vision_start|>``.
        vision_end_token_id: ``<|vision_end|>``.
        video_token_id: ``<|video_pad|>``, or ``None`` for a tokenizer without it (images only).
        sampling: which frames of a video are sampled (its ``temporal_patch_size`` must be the processor's).
    """

    name: ClassVar[str]
    options: ClassVar[tuple[str, ...]] = (
        "min_pixels",
        "max_pixels",
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        "video_min_pixels",
        "video_max_pixels",
        *SAMPLING_OPTIONS,
    )
    processor_class: ClassVar[type[Qwen2VLImageProcessor]] = Qwen2VLImageProcessor
    sampling_class: ClassVar[type[VideoSampling]] = VideoSampling
    tokens: ClassVar[dict[str, str]] = {
        "image_token_id": "<|image_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    tokens_per_second: float | None = None

    def __init__(
        self,
        processor: Qwen2VLImageProcessor,
        *,
        image_token_id: int,
        vision_start_token_id: int,
        vision_end_token_id: int,
        video_token_id: int | None = None,
        sampling: VideoSampling | None = None,
    ) -> None:
        sampling = sampling or self.sampling_class(temporal_patch_size=processor.temporal_patch_size)
        if sampling.temporal_patch_size != processor.temporal_patch_size:
            raise ValueError(
                f"the video sampling's temporal_patch_size ({sampling.temporal_patch_size}) must be the "
                f"processor's ({processor.temporal_patch_size})"
            )
        self.processor = processor
        self.image_token_id = image_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.video_token_id = video_token_id
        self.sampling = sampling

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **options: Any) -> QwenVLVisionInputs:
        """Built with the token ids of ``tokenizer`` (``<|video_pad|>`` where it has one), the
        :attr:`processor_class` ``options``, the ``video_*`` sampling options (:data:`SAMPLING_OPTIONS`) and the
        subclass's own (:meth:`_timing_options`).

        Raises:
            ValueError: the tokenizer lacks an image token, or an option is out of range (named).
        """
        sampling = {k: options.pop(k) for k in SAMPLING_OPTIONS if k in options}
        timing = cls._timing_options(options)
        processor = cls.processor_class(**options)
        return cls(
            processor,
            **token_ids(tokenizer, cls.tokens, cls.name),
            video_token_id=special_token_id(tokenizer, cls.video_token),
            sampling=video_sampling(processor.temporal_patch_size, cls.sampling_class, **sampling),
            **timing,
        )

    @classmethod
    def _timing_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The constructor arguments of the subclass taken out of ``options`` (none here)."""
        return {}

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
            ValueError: the video is too short for the sampling, or its frames have an aspect ratio the processor
                refuses.
        """
        return self.processor.video_grid(len(self.sampling.indices(info)), info.height, info.width)

    def _video_token_id(self) -> int:
        if self.video_token_id is None:
            raise ValueError(f"the tokenizer has no {self.video_token} token for videos")
        return self.video_token_id

    def video_text(self, info: VideoInfo) -> str:
        """The video token, once."""
        return self.video_token

    def video_placeholders(self, info: VideoInfo) -> list[list[int]]:
        """One item: ``<|vision_start|>``, one ``<|video_pad|>`` per merged patch of the sampled frames,
        ``<|vision_end|>``.

        Raises:
            ValueError: the tokenizer has no ``<|video_pad|>``.
        """
        return [self._placeholder(self._video_token_id(), self.video_grid(info))]

    def video_num_patches(self, info: VideoInfo) -> int:
        """Rows of ``pixel_values_videos`` the video becomes: ``t * h * w``."""
        return math.prod(self.video_grid(info))

    def process(self, images: Sequence[Image.Image]) -> dict[str, Tensor]:
        """``pixel_values [patches, patch_dim]`` and ``image_grid_thw [images, 3]``."""
        return self.processor.preprocess_images(images)

    def process_videos(self, videos: Sequence[np.ndarray], infos: Sequence[VideoInfo]) -> dict[str, Tensor]:
        """``pixel_values_videos [patches, patch_dim]`` and ``video_grid_thw [videos, 3]`` of the sampled frames
        ``videos`` (uint8 ``[T, H, W, 3]`` each) of videos whose headers said ``infos``."""
        return self.processor.preprocess_videos(videos)

    def positions(self, input_ids: Tensor, inputs: dict[str, Tensor]) -> Tensor:
        """``[3, n]`` multimodal RoPE positions (:func:`~forge_lightning.modules.vlm.positions.get_rope_index`),
        the videos timed by :meth:`_video_timing`."""
        positions_3BN, _ = get_rope_index(
            input_ids[None],
            image_token_id=self.image_token_id,
            video_token_id=-1
            if self.video_token_id is None
            else self.video_token_id,  # -1: an id no token has
            spatial_merge_size=self.processor.merge_size,
            image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"),
            **self._video_timing(inputs),
        )
        return positions_3BN[:, 0]

    def _video_timing(self, inputs: dict[str, Tensor]) -> dict[str, Any]:
        """The video timing arguments of :func:`get_rope_index` for a sample's ``inputs``."""
        raise NotImplementedError


class Qwen2VLVisionInputs(QwenVLVisionInputs):
    """Qwen2-VL / Qwen2.5-VL images and videos: each video one ``<|vision_start|>`` ... ``<|vision_end|>`` item
    (:class:`QwenVLVisionInputs`), its frames timed by ``second_per_grid_ts`` and ``tokens_per_second``.

    Args:
        tokens_per_second: Qwen2.5-VL's temporal positions per second of video (the model's
            ``vision_config.tokens_per_second``), for the positions of packed rows.
        Other arguments: as :class:`QwenVLVisionInputs`.
    """

    name: ClassVar[str] = "qwen2_vl"
    options: ClassVar[tuple[str, ...]] = (*QwenVLVisionInputs.options, "tokens_per_second")

    def __init__(
        self, processor: Qwen2VLImageProcessor, *, tokens_per_second: float = 2.0, **ids: Any
    ) -> None:
        super().__init__(processor, **ids)
        if not tokens_per_second > 0:
            raise ValueError(f"tokens_per_second ({tokens_per_second}) must be positive")
        self.tokens_per_second = tokens_per_second

    @classmethod
    def _timing_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        return (
            {"tokens_per_second": options.pop("tokens_per_second")} if "tokens_per_second" in options else {}
        )

    def process_videos(self, videos: Sequence[np.ndarray], infos: Sequence[VideoInfo]) -> dict[str, Tensor]:
        """``pixel_values_videos [patches, patch_dim]``, ``video_grid_thw [videos, 3]`` and ``second_per_grid_ts
        [videos]`` (float32, as transformers' processor gives it) of the sampled frames ``videos`` (uint8
        ``[T, H, W, 3]`` each) of videos whose headers said ``infos``."""
        out = self.processor.preprocess_videos(videos)
        seconds = [self.sampling.seconds_per_grid(info) for info in infos]
        return {**out, "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32)}

    def _video_timing(self, inputs: dict[str, Tensor]) -> dict[str, Any]:
        """Qwen2.5-VL's: ``second_per_grid_ts`` at :attr:`tokens_per_second`."""
        has_videos = inputs.get("video_grid_thw") is not None
        return {
            "second_per_grid_ts": inputs.get("second_per_grid_ts"),
            "tokens_per_second": self.tokens_per_second if has_videos else None,
        }


class Qwen3VLVisionInputs(QwenVLVisionInputs):
    """Qwen3-VL images and videos (transformers' ``Qwen3VLProcessor``): images as Qwen2-VL's with the patches of
    :class:`Qwen3VLImageProcessor`; a video written as one item per temporal patch, each after its time as text
    (``<0.3 seconds>``, :meth:`~forge_lightning.datamodules.vlm.video.Qwen3VideoSampling.timestamps`), its frames
    sampled by :class:`~forge_lightning.datamodules.vlm.video.Qwen3VideoSampling`; no ``second_per_grid_ts``, and
    positions with every frame its own item (``split_video_frames``).

    Args: as :class:`QwenVLVisionInputs` (``sampling`` a :class:`Qwen3VideoSampling`).
    """

    name: ClassVar[str] = "qwen3_vl"
    options: ClassVar[tuple[str, ...]] = (*QwenVLVisionInputs.options, "video_cap_pixels_per_frame")
    processor_class: ClassVar[type[Qwen2VLImageProcessor]] = Qwen3VLImageProcessor
    sampling_class: ClassVar[type[VideoSampling]] = Qwen3VideoSampling

    def __init__(self, processor: Qwen2VLImageProcessor, **ids: Any) -> None:
        super().__init__(processor, **ids)
        if not isinstance(self.sampling, Qwen3VideoSampling):
            raise TypeError(
                f"Qwen3-VL samples frames with a Qwen3VideoSampling, got a {type(self.sampling).__name__}"
            )

    def video_text(self, info: VideoInfo) -> str:
        """``<t seconds>`` (one decimal) and the video token for each temporal patch."""
        sampling = cast(Qwen3VideoSampling, self.sampling)
        return "".join(f"<{t:.1f} seconds>{self.video_token}" for t in sampling.timestamps(info))

    def video_placeholders(self, info: VideoInfo) -> list[list[int]]:
        """One item per temporal patch: ``<|vision_start|>``, one ``<|video_pad|>`` per merged patch of a frame,
        ``<|vision_end|>``.

        Raises:
            ValueError: the tokenizer has no ``<|video_pad|>``.
        """
        t, h, w = self.video_grid(info)
        return [self._placeholder(self._video_token_id(), (1, h, w))] * t

    def _video_timing(self, inputs: dict[str, Tensor]) -> dict[str, Any]:
        """Every frame its own item: time advances through the timestamp text."""
        return {"split_video_frames": True}


def video_sampling(
    temporal_patch_size: int,
    sampling_class: type[VideoSampling] = VideoSampling,
    *,
    video_fps: float | None = None,
    video_num_frames: int | None = None,
    video_min_frames: int | None = None,
    video_max_frames: int | None = None,
) -> VideoSampling:
    """The ``sampling_class`` of the data module's ``video_*`` options (unset ones keep transformers' defaults).

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
        return sampling_class(
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
    str, type[QwenVLVisionInputs] | type[FixedResolutionVisionInputs] | type[LlavaOnevisionVisionInputs]
] = {
    "qwen2_vl": Qwen2VLVisionInputs,
    "qwen3_vl": Qwen3VLVisionInputs,
    "fixed": FixedResolutionVisionInputs,
    "llava_onevision": LlavaOnevisionVisionInputs,
}
"""The built-in :class:`VisionInputs` by name."""

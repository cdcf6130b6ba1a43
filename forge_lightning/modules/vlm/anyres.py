"""Any-resolution tiling of LLaVA-OneVision (Li et al. 2024, arXiv:2408.03326; LLaVA-NeXT's "anyres"): each image
is a base tile (the whole image resized to ``image_size``) followed by the tiles of its best-fitting grid from
``image_grid_pinpoints``, all encoded by the same SigLIP tower. After the projector the features of one image are
packed into one run of ``<image>`` tokens::

    tiles [1 + rows * cols, T, D] (T = side * side tokens per tile)
      base ─────────────────────────────────────────────────────────────────────────────┐
      tiles ─ one [D, rows * side, cols * side] map ─ crop the padding (unpad) ─ shrink bilinearly when over
              vision_aspect_ratio's max tiles ─ image_newline after every row ─ flatten ─ ┴─ [L, D]

The geometry follows transformers' ``LlavaOnevisionModel.pack_image_features`` and its processor's token count
(:func:`num_image_tokens`) exactly, rounding included. The images of a multi-image sample (``batch_num_images``
above 1) are not tiled: each is its base tile followed by one ``image_newline``.

A video ``[frames, 3, S, S]`` runs through the same tower and projector frame by frame; each frame's
``side x side`` features are pooled bilinearly to ``ceil(side / 2)`` a side (:func:`pool_frames`), the frames
follow one another and one ``image_newline`` ends the video (:func:`pack_video`, transformers'
``get_video_features``)::

    frames [F, T, D] ─ [F, D, side, side] ─ bilinear to ceil(side / 2) a side ─ [F * ceil(side / 2) ** 2, D]
                     ─ image_newline ─ [F * ceil(side / 2) ** 2 + 1, D]
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from forge_lightning.modules.vlm.siglip import SiglipVisionConfig

_ASPECT_RATIO = re.compile(r"anyres_max_(\d+)")
_DEFAULT_GRID = range(1, 7)  # transformers' default pinpoints: 1 to 6 tiles a side


def grid_pinpoints(
    pinpoints: Sequence[Sequence[int]] | None, image_size: int, *, prefix: str = ""
) -> list[list[int]]:
    """The ``[height, width]`` resolutions an image may be tiled at: ``pinpoints`` checked, or transformers'
    default (1 to 6 tiles a side) for ``None``.

    Raises:
        ValueError: an empty list, or a pair that is not two positive multiples of ``image_size`` (named, with the
            option's ``prefix``).
    """
    S = image_size
    if pinpoints is None:
        return [[r * S, c * S] for r in _DEFAULT_GRID for c in _DEFAULT_GRID]
    pairs = [list(p) for p in pinpoints]
    bad = [p for p in pairs if len(p) != 2 or not all(isinstance(x, int) and x > 0 and x % S == 0 for x in p)]
    if not pairs or bad:
        raise ValueError(
            f"{prefix}image_grid_pinpoints must be [height, width] pairs of positive multiples of "
            f"{prefix}image_size ({S}); these are not: {bad or '[] (empty)'}"
        )
    return pairs


def check_aspect_ratio(vision_aspect_ratio: str, *, prefix: str = "") -> int:
    """``N`` of ``anyres_max_N``: the most tiles' worth of features an image keeps.

    Raises:
        ValueError: another form, or ``N`` < 1.
    """
    match = _ASPECT_RATIO.fullmatch(vision_aspect_ratio)
    if not match or int(match.group(1)) < 1:
        raise ValueError(
            f"{prefix}vision_aspect_ratio ({vision_aspect_ratio!r}) must be 'anyres_max_N' with N >= 1 "
            "(e.g. 'anyres_max_9')"
        )
    return int(match.group(1))


@dataclass(kw_only=True)
class AnyResVisionConfig(SiglipVisionConfig):
    """The SigLIP tower of LLaVA-OneVision with its tiling (``vision.type: siglip_anyres``).

    The fields are :class:`~forge_lightning.modules.vlm.siglip.SiglipVisionConfig`'s, plus:

    Args:
        image_grid_pinpoints: the ``[height, width]`` resolutions an image may be tiled at, each a multiple of
            ``image_size`` (default: 1 to 6 tiles a side, as transformers).
        vision_aspect_ratio: ``anyres_max_N``: an image's tile features are shrunk to about ``N`` tiles' worth.
    """

    image_grid_pinpoints: list[list[int]] | None = None
    vision_aspect_ratio: str = "anyres_max_9"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.feature_select_strategy != "full":
            raise ValueError(
                f"vision.feature_select_strategy ({self.feature_select_strategy!r}) must be 'full' for "
                "siglip_anyres: every tile keeps its whole grid of features"
            )
        self.image_grid_pinpoints = grid_pinpoints(
            self.image_grid_pinpoints, self.image_size, prefix="vision."
        )
        check_aspect_ratio(self.vision_aspect_ratio, prefix="vision.")

    @property
    def max_tiles(self) -> int:
        """``N`` of :attr:`vision_aspect_ratio`."""
        return check_aspect_ratio(self.vision_aspect_ratio)

    @property
    def grid_side(self) -> int:
        """Features a side of one tile."""
        return self.image_size // self.patch_size


class AnyResGrid(Protocol):
    """What the tiling geometry reads of a config: :class:`AnyResVisionConfig` has it, and so does the data
    module's processor (``datamodules/vlm/anyres_processor.py``), so both count tokens with the same functions."""

    @property
    def image_size(self) -> int:
        """Side of a tile in pixels."""
        ...

    @property
    def grid_side(self) -> int:
        """Features a side of one tile."""
        ...

    @property
    def image_grid_pinpoints(self) -> list[list[int]]:
        """The ``[height, width]`` resolutions an image may be tiled at."""
        ...

    @property
    def max_tiles(self) -> int:
        """``N`` of ``anyres_max_N``."""
        ...


def best_resolution(size_hw: Sequence[int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The pinpoint ``(height, width)`` an image of ``size_hw`` is tiled at: the one that keeps the most of its pixels
    when it is scaled to fit, and of those the one that wastes the least area."""
    h, w = size_hw
    best, best_kept, best_waste = None, 0, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        waste = ph * pw - kept
        if kept > best_kept or (kept == best_kept and waste < best_waste):
            best, best_kept, best_waste = (ph, pw), kept, waste
    return best


def tile_grid(config: AnyResGrid, size_hw: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of tiles of an image of ``size_hw`` (beside its base tile)."""
    ph, pw = best_resolution(size_hw, config.image_grid_pinpoints)
    return ph // config.image_size, pw // config.image_size


def num_tiles(config: AnyResGrid, size_hw: Sequence[int], tiled: bool = True) -> int:
    """The image's tiles in ``pixel_values``: its base tile and ``rows * cols`` grid tiles (the base tile alone
    when not ``tiled``: an image of a multi-image sample)."""
    if not tiled:
        return 1
    rows, cols = tile_grid(config, size_hw)
    return 1 + rows * cols


class _Layout(NamedTuple):
    """Where an image's tile features go: the crop of the ``[rows * side, cols * side]`` map, its size after
    shrinking (the crop's own size when ``shrink`` is false)."""

    rows: slice
    cols: slice
    out_hw: tuple[int, int]
    shrink: bool


def _layout(config: AnyResGrid, size_hw: Sequence[int]) -> _Layout:
    rows, cols = tile_grid(config, size_hw)
    side = config.grid_side
    H, W = rows * side, cols * side
    h, w = size_hw
    if w / h > W / H:  # wider than the grid: padding above and below
        pad = (H - int(round(h * (W / w), 7))) // 2
        crop = (slice(pad, H - pad), slice(0, W))
    else:
        pad = (W - int(round(w * (H / h), 7))) // 2
        crop = (slice(0, H), slice(pad, W - pad))
    h_crop, w_crop = (c.stop - c.start for c in crop)
    ratio = math.sqrt(h_crop * w_crop / (config.max_tiles * side**2))
    out_hw = (int(h_crop // ratio), int(w_crop // ratio)) if ratio > 1.1 else (h_crop, w_crop)
    return _Layout(*crop, out_hw, ratio > 1.1)


def num_image_tokens(config: AnyResGrid, size_hw: Sequence[int], tiled: bool = True) -> int:
    """``<image>`` tokens of one image of ``size_hw`` (height, width): the base tile's features, then each row of
    the unpadded (and maybe shrunk) tile features and its newline; the base tile's features and one newline when
    not ``tiled`` (an image of a multi-image sample)."""
    if not tiled:
        return config.grid_side**2 + 1
    h, w = _layout(config, size_hw).out_hw
    return config.grid_side**2 + h * (w + 1)


def pack_image(
    config: AnyResGrid, features_NTD: Tensor, size_hw: Sequence[int], newline_D: Tensor, tiled: bool = True
) -> Tensor:
    """One image's projected features ``[L, D]`` (``L`` = :func:`num_image_tokens`) from those of its tiles
    ``[1 + rows * cols, T, D]``, base tile first (``[1, T, D]`` when not ``tiled``)."""
    if not tiled:
        return torch.cat([features_NTD[0], newline_D.to(features_NTD.dtype)[None]])
    rows, cols = tile_grid(config, size_hw)
    side = config.grid_side
    base_TD, tiles_NTD = features_NTD[0], features_NTD[1:]
    D = features_NTD.shape[-1]
    # [rows, cols, side, side, D] -> [D, rows, side, cols, side] -> one [D, rows * side, cols * side] map
    map_DHW = (
        tiles_NTD.view(rows, cols, side, side, D).permute(4, 0, 2, 1, 3).reshape(D, rows * side, cols * side)
    )
    layout = _layout(config, size_hw)
    map_DHW = map_DHW[:, layout.rows, layout.cols]
    if layout.shrink:
        map_DHW = F.interpolate(map_DHW[None], list(layout.out_hw), mode="bilinear")[0]
    h, w = map_DHW.shape[1:]
    newline_DH1 = newline_D.to(map_DHW.dtype)[:, None, None].expand(D, h, 1)
    rows_LD = torch.cat([map_DHW, newline_DH1], dim=-1).flatten(1).T  # row by row, each ending in a newline
    return torch.cat([base_TD, rows_LD])


class ImageLayout(NamedTuple):
    """The images of a batch: each one's ``(height, width)`` before tiling and whether it is tiled (the images of
    multi-image samples are not)."""

    sizes: list[tuple[int, int]]
    tiled: list[bool]


def image_layout(
    image_sizes: Tensor | Sequence[Sequence[int]] | None,
    batch_num_images: Tensor | Sequence[int] | None = None,
) -> ImageLayout:
    """The :class:`ImageLayout` of ``image_sizes`` (``[num_images, 2]``, height and width) and ``batch_num_images``
    (images per sample, in order; samples without images may be left out or given as 0), as transformers reads
    them: without ``batch_num_images`` every image is tiled.

    Raises:
        ValueError: ``image_sizes`` is missing or not positive ``(height, width)`` pairs, or ``batch_num_images``
            does not add up to the number of images.
    """
    if image_sizes is None:
        raise ValueError(
            "vision.type 'siglip_anyres' (LLaVA-OneVision) needs image_sizes ([num_images, 2]: each image's height "
            "and width before tiling) with pixel_values"
        )
    sizes = image_sizes.tolist() if isinstance(image_sizes, Tensor) else [list(s) for s in image_sizes]
    if any(len(s) != 2 or min(s) <= 0 for s in sizes):
        raise ValueError(f"image_sizes must be [num_images, 2] positive (height, width) pairs, got {sizes}")
    if batch_num_images is None:
        tiled = [True] * len(sizes)
    else:
        counts = batch_num_images.tolist() if isinstance(batch_num_images, Tensor) else list(batch_num_images)
        if any(n < 0 for n in counts) or sum(counts) != len(sizes):
            raise ValueError(
                f"batch_num_images ({counts}: images per sample) must be non-negative and add up to the "
                f"{len(sizes)} images of image_sizes"
            )
        tiled = [n == 1 for n in counts for _ in range(n)]
    return ImageLayout([(int(h), int(w)) for h, w in sizes], tiled)


def tile_counts(config: AnyResGrid, layout: ImageLayout) -> list[int]:
    """The tiles of each image of ``layout`` (:func:`num_tiles`)."""
    return [num_tiles(config, s, t) for s, t in zip(layout.sizes, layout.tiled)]


def stack_tiles(config: AnyResGrid, pixels: Tensor, layout: ImageLayout) -> Tensor:
    """The tiles of every image in order, ``[num_tiles, C, S, S]``, from ``pixels`` given that way or as a
    processor pads them, ``[num_images, max_tiles, C, S, S]``.

    Raises:
        ValueError: the number of tiles or images differs from what ``layout`` gives.
    """
    counts = tile_counts(config, layout)
    if pixels.ndim == 5:
        if pixels.shape[0] != len(counts) or pixels.shape[1] < max(counts, default=0):
            raise ValueError(
                f"pixel_values [num_images, max_tiles, ...] has shape {list(pixels.shape)}, but image_sizes give "
                f"{len(counts)} images of {counts} tiles"
            )
        return torch.cat([p[:n] for p, n in zip(pixels, counts)])
    if pixels.ndim == 4 and pixels.shape[0] != sum(counts):
        raise ValueError(
            f"pixel_values hold {pixels.shape[0]} tiles, but image_sizes give {sum(counts)} ({counts} per image: "
            "the base tile and the tiles of the best image_grid_pinpoints grid; the base tile alone for the images "
            "of samples with several, batch_num_images)"
        )
    return pixels


def pooled_side(config: AnyResGrid) -> int:
    """Features a side of one video frame after pooling: ``ceil(grid_side / 2)``."""
    return math.ceil(config.grid_side / 2)


def num_video_tokens(config: AnyResGrid, num_frames: int) -> int:
    """``<video>`` tokens of a video of ``num_frames`` frames: each frame's pooled features and one newline."""
    return num_frames * pooled_side(config) ** 2 + 1


def pool_frames(config: AnyResGrid, features_NTD: Tensor) -> Tensor:
    """Each frame's ``side x side`` features shrunk bilinearly to :func:`pooled_side` a side:
    ``[N, T, D] -> [N, pooled ** 2, D]`` (transformers' ``apply_pooling``)."""
    N, T, D = features_NTD.shape
    side, pooled = config.grid_side, pooled_side(config)
    if side * side != T:
        raise ValueError(
            f"a video frame has {T} features, expected (image_size // patch_size) ** 2 = {side**2}"
        )
    maps_NDHW = features_NTD.view(N, side, side, D).permute(0, 3, 1, 2)
    pooled_NDHW = F.interpolate(maps_NDHW, size=[pooled, pooled], mode="bilinear")
    return pooled_NDHW.permute(0, 2, 3, 1).reshape(N, pooled * pooled, D)


def pack_video(config: AnyResGrid, features_FTD: Tensor, newline_D: Tensor) -> Tensor:
    """One video's projected features ``[L, D]`` (``L`` = :func:`num_video_tokens`) from those of its frames
    ``[F, T, D]``: the pooled frames in order, then ``image_newline``."""
    frames_LD = pool_frames(config, features_FTD).flatten(0, 1)
    return torch.cat([frames_LD, newline_D.to(frames_LD.dtype)[None]])

"""Camera frames on the batch's device: an optional resize and train-time augmentation (lerobot's
``ImageTransforms``, batched, in plain torch).

``LeRobotDataModule.on_after_batch_transfer`` applies both after the host-to-device copy, so the work runs on
the GPU, batched, instead of per frame in the DataLoader workers::

    camera [B, (T,) 3, H, W] ─ resize (every stage) ─ training only: per sample, draw k of the enabled
    transforms (by weight, without replacement) and a parameter for each ─ apply them in order ─> same dtype

As in lerobot, a sample gets ``min(max_num_transforms, enabled)`` transforms drawn by ``weight``, applied in the
configuration's order (or a random one per sample), each with a parameter drawn uniformly from its range; the
frames of a sample's time stack share them, and every camera draws its own. The photometric transforms follow
torchvision's ``adjust_*`` definitions (the ones lerobot uses); ``affine`` and ``crop`` resample bilinearly
(torchvision's ``RandomAffine``, which lerobot uses, shifts by whole pixels and reads the nearest pixel).
Frames keep their dtype and range: floating point in ``[0, 1]`` or uint8 in ``[0, 255]``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

_GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # ITU-R 601-2 luma, as torchvision's rgb_to_grayscale


# ----- config -----------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TransformConfig:
    """What every transform has: whether a sample may draw it, and how likely it is drawn.

    Args:
        enable: include it among the transforms a sample draws from.
        weight: relative probability of drawing it (lerobot's ``weight``).
    """

    enable: bool = True
    weight: float = 1.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # YAML lists as tuples, so equal configs compare equal
            if isinstance(getattr(self, f.name), list):
                setattr(self, f.name, tuple(getattr(self, f.name)))

    def check(self, name: str) -> None:
        """Raises ``ValueError`` naming ``name`` when an option is invalid."""
        if not self.weight > 0:
            raise ValueError(f"{name}.weight ({self.weight}) must be positive")


@dataclass(kw_only=True)
class JitterConfig(TransformConfig):
    """A photometric transform whose factor is drawn per sample, uniformly from ``range``.

    Args:
        range: ``[low, high]`` of the factor.
    """

    range: tuple[float, float] = (1.0, 1.0)

    def check(self, name: str, bounds: tuple[float, float] = (0.0, math.inf)) -> None:
        """Raises ``ValueError`` naming ``name`` when the weight or ``range`` (within ``bounds``) is invalid."""
        super().check(name)
        _check_range(f"{name}.range", self.range, bounds)


@dataclass(kw_only=True)
class AffineConfig(TransformConfig):
    """Random rotation, translation and scale about the image centre (lerobot's ``RandomAffine``); the area
    uncovered is black.

    Args:
        degrees: ``[low, high]`` rotation angle (counter-clockwise).
        translate: maximal shift as fractions of ``[width, height]``; each shift is drawn from ``[-max, max]``.
        scale: ``[low, high]`` zoom factor (1: none).
    """

    degrees: tuple[float, float] = (-5.0, 5.0)
    translate: tuple[float, float] = (0.05, 0.05)
    scale: tuple[float, float] = (1.0, 1.0)

    def check(self, name: str) -> None:
        """Raises ``ValueError`` naming ``name`` when an option is invalid."""
        super().check(name)
        _check_range(f"{name}.degrees", self.degrees, (-180.0, 180.0))
        for axis, value in zip(("width", "height"), _pair(f"{name}.translate", self.translate)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name}.translate ({axis}: {value}) must be in [0, 1]")
        _check_range(f"{name}.scale", self.scale, (0.0, math.inf), open_low=True)


@dataclass(kw_only=True)
class CropConfig(TransformConfig):
    """A random crop resized back to the frame's size (openpi's 95% crop); the crop keeps the aspect ratio.

    Args:
        scale: ``[low, high]`` side of the crop as a fraction of the frame's side; its position is uniform.
    """

    enable: bool = False
    scale: tuple[float, float] = (0.95, 0.95)

    def check(self, name: str) -> None:
        """Raises ``ValueError`` naming ``name`` when an option is invalid."""
        super().check(name)
        _check_range(f"{name}.scale", self.scale, (0.0, 1.0), open_low=True)


@dataclass(kw_only=True)
class ImageAugmentConfig:
    """Train-time augmentation of camera frames (off by default); ``enable: true`` gives lerobot's defaults.

    Args:
        enable: augment training batches.
        max_num_transforms: transforms per sample, drawn from the enabled ones (lerobot's ``max_num_transforms``).
        random_order: apply a sample's transforms in a random order instead of the order listed here.
        cameras: camera keys to augment (default: every camera).
        seed: seed of the augmentation generator (default: the data module's seed), offset by the
            data-parallel rank.
        brightness: factor ``f``: ``x * f``.
        contrast: factor ``f``: blend with the mean grey level, ``f * x + (1 - f) * mean(gray(x))``.
        saturation: factor ``f``: blend with the grey image, ``f * x + (1 - f) * gray(x)`` (0: grey).
        hue: shift of the hue, in turns (``[-0.5, 0.5]``; 0: none).
        sharpness: factor ``f``: blend with a 3x3-smoothed image (0: smoothed, 1: original, 2: sharper).
        affine: random rotation / translation / scale.
        crop: random crop resized back (off by default; not one of lerobot's transforms).
    """

    enable: bool = False
    max_num_transforms: int = 3
    random_order: bool = False
    cameras: list[str] | None = None
    seed: int | None = None
    brightness: JitterConfig = field(default_factory=lambda: JitterConfig(range=(0.8, 1.2)))
    contrast: JitterConfig = field(default_factory=lambda: JitterConfig(range=(0.8, 1.2)))
    saturation: JitterConfig = field(default_factory=lambda: JitterConfig(range=(0.5, 1.5)))
    hue: JitterConfig = field(default_factory=lambda: JitterConfig(range=(-0.05, 0.05)))
    sharpness: JitterConfig = field(default_factory=lambda: JitterConfig(range=(0.5, 1.5)))
    affine: AffineConfig = field(default_factory=AffineConfig)
    crop: CropConfig = field(default_factory=CropConfig)

    def __post_init__(self) -> None:
        defaults = ImageAugmentConfig.__dataclass_fields__
        for name in TRANSFORMS:
            value = getattr(self, name)
            if isinstance(value, Mapping):  # a partial dict overrides this field's defaults
                setattr(self, name, _replace(defaults[name].default_factory(), value, f"augment.{name}"))
        for name, (_, bounds) in _JITTERS.items():
            getattr(self, name).check(f"augment.{name}", bounds)
        self.affine.check("augment.affine")
        self.crop.check("augment.crop")
        if self.max_num_transforms < 1:
            raise ValueError(f"augment.max_num_transforms ({self.max_num_transforms}) must be positive")
        if self.enable and not self.transform_names():
            raise ValueError("augment.enable is true but every transform is disabled: enable at least one")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ImageAugmentConfig:
        """The config from YAML-style values; an unknown option raises ``ValueError`` naming the known ones."""
        return _replace(cls(), values, "augment")

    def transform_names(self) -> list[str]:
        """Enabled transforms, in the order they are applied (unless ``random_order``)."""
        return [name for name in TRANSFORMS if getattr(self, name).enable]


def _replace(config: Any, values: Mapping[str, Any], where: str) -> Any:
    names = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{where} has no option(s) {unknown}; options: {', '.join(names)}")
    return dataclasses.replace(config, **values)


def _pair(option: str, value: Sequence[float]) -> tuple[float, float]:
    if len(value) != 2:
        raise ValueError(f"{option} ({list(value)}) must have two values")
    return float(value[0]), float(value[1])


def _check_range(
    option: str, value: Sequence[float], bounds: tuple[float, float], open_low: bool = False
) -> None:
    low, high = _pair(option, value)
    if not (bounds[0] < low if open_low else bounds[0] <= low) or not low <= high <= bounds[1]:
        interval = f"{'(' if open_low else '['}{bounds[0]}, {bounds[1]}]"
        raise ValueError(f"{option} ({list(value)}) must be [low, high] with low <= high, both in {interval}")


# ----- transforms on [B, N, C, H, W] float frames in [0, 1], one parameter per sample ----------------------------
def _per_sample(factor_B: Tensor, x: Tensor) -> Tensor:
    return factor_B.to(x.dtype).view(-1, *[1] * (x.ndim - 1))


def _blend(x: Tensor, other: Tensor, factor_B: Tensor) -> Tensor:
    factor = _per_sample(factor_B, x)
    return (factor * x + (1 - factor) * other).clamp(0, 1)


def grayscale(x: Tensor) -> Tensor:
    """Luma of RGB frames ``[..., 3, H, W]`` as ``[..., 1, H, W]``."""
    r, g, b = x.unbind(-3)
    return (_GRAY_WEIGHTS[0] * r + _GRAY_WEIGHTS[1] * g + _GRAY_WEIGHTS[2] * b).unsqueeze(-3)


def adjust_brightness(x: Tensor, factor_B: Tensor) -> Tensor:
    """``x * f``, clamped to ``[0, 1]`` (a blend with black)."""
    return (x * _per_sample(factor_B, x)).clamp(0, 1)


def adjust_contrast(x: Tensor, factor_B: Tensor) -> Tensor:
    """Blend with each frame's mean grey level."""
    return _blend(x, grayscale(x).mean(dim=(-3, -2, -1), keepdim=True), factor_B)


def adjust_saturation(x: Tensor, factor_B: Tensor) -> Tensor:
    """Blend with the grey image (0: grey, 1: unchanged)."""
    return _blend(x, grayscale(x), factor_B)


def adjust_sharpness(x: Tensor, factor_B: Tensor) -> Tensor:
    """Blend with the frame smoothed by ``[[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13`` (border pixels kept)."""
    height, width = x.shape[-2:]
    if height <= 2 or width <= 2:
        return x
    kernel = torch.ones(3, 3, dtype=x.dtype, device=x.device)
    kernel[1, 1] = 5
    smoothed = F.conv2d(x.reshape(-1, 1, height, width), (kernel / kernel.sum())[None, None])
    degenerate = x.clone()
    degenerate[..., 1:-1, 1:-1] = smoothed.view(*x.shape[:-2], height - 2, width - 2)
    return _blend(x, degenerate, factor_B)


def adjust_hue(x: Tensor, shift_B: Tensor) -> Tensor:
    """Rotates the hue by ``shift`` turns (RGB -> HSV, ``h + shift mod 1``, -> RGB)."""
    r, g, b = x.unbind(-3)
    value, low = x.amax(dim=-3), x.amin(dim=-3)
    chroma = value - low
    saturation = chroma / torch.where(value > 0, value, torch.ones_like(value))
    divisor = torch.where(chroma > 0, chroma, torch.ones_like(chroma))
    sector = torch.where(
        value == r, (g - b) / divisor, torch.where(value == g, 2 + (b - r) / divisor, 4 + (r - g) / divisor)
    )
    hue = torch.remainder(sector / 6 + _per_sample(shift_B, sector), 1.0)
    # HSV -> RGB: channel n in (5, 3, 1) is v - v s clamp(min(k, 4 - k), 0, 1) with k = (n + 6 h) mod 6
    k = torch.remainder(
        torch.tensor([5.0, 3.0, 1.0], dtype=x.dtype, device=x.device).view(3, 1, 1) + 6 * hue.unsqueeze(-3), 6
    )
    ramp = torch.minimum(k, 4 - k).clamp(0, 1)
    return (value.unsqueeze(-3) * (1 - saturation.unsqueeze(-3) * ramp)).clamp(0, 1)


def warp(x: Tensor, theta_B23: Tensor, *, padding_mode: str = "zeros") -> Tensor:
    """Resamples frames bilinearly: output pixel ``p`` (normalised, ``align_corners=False``) reads the input at
    ``theta @ [p, 1]``; every frame of a sample's stack uses the sample's ``theta``."""
    batch, stack = x.shape[:2]
    flat = x.reshape(batch * stack, *x.shape[2:])  # [B*N, C, H, W]
    theta = theta_B23.to(x.dtype).repeat_interleave(stack, dim=0)
    grid = F.affine_grid(theta, list(flat.shape), align_corners=False)
    out = F.grid_sample(flat, grid, mode="bilinear", padding_mode=padding_mode, align_corners=False)
    return out.view(x.shape)


def affine_theta(angle_B: Tensor, shift_B2: Tensor, scale_B: Tensor, height: int, width: int) -> Tensor:
    """``warp`` matrices that rotate by ``angle`` (radians, counter-clockwise), shift by ``shift`` (pixels,
    ``[x, y]``, right and down) and zoom by ``scale`` about the centre: the inverse of
    ``p_out = scale * R(angle) p_in + shift`` in pixel units, expressed in normalised coordinates."""
    cos, sin = torch.cos(angle_B) / scale_B, torch.sin(angle_B) / scale_B
    tx, ty = shift_B2.unbind(-1)
    row_x = torch.stack([cos, -sin * height / width, -2 / width * (cos * tx - sin * ty)], dim=-1)
    row_y = torch.stack([sin * width / height, cos, -2 / height * (sin * tx + cos * ty)], dim=-1)
    return torch.stack([row_x, row_y], dim=-2)


def crop_theta(side_B: Tensor, center_B2: Tensor) -> Tensor:
    """``warp`` matrices that read a crop of ``side`` (fraction of each side) centred at ``center`` (normalised
    ``[x, y]``)."""
    zero = torch.zeros_like(side_B)
    row_x = torch.stack([side_B, zero, center_B2[:, 0]], dim=-1)
    row_y = torch.stack([zero, side_B, center_B2[:, 1]], dim=-1)
    return torch.stack([row_x, row_y], dim=-2)


def resize_frames(frames: Tensor, size: Sequence[int]) -> Tensor:
    """Frames ``[B, (T,) C, H, W]`` resized to ``size = [height, width]`` (bilinear, antialiased), same dtype."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    x = _to_unit(frames)
    flat = x.reshape(-1, *x.shape[-3:])
    out = F.interpolate(flat, size=tuple(size), mode="bilinear", antialias=True, align_corners=False)
    return _from_unit(out.view(*x.shape[:-2], *size), frames.dtype)


def _to_unit(frames: Tensor) -> Tensor:
    if frames.dtype == torch.uint8:
        return frames.float() / 255
    if not frames.is_floating_point():
        raise TypeError(f"camera frames must be uint8 or floating point, got {frames.dtype}")
    return frames if frames.dtype in (torch.float32, torch.float64) else frames.float()


def _from_unit(x: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype == torch.uint8:
        return (x * 255).round().clamp(0, 255).to(torch.uint8)
    return x.to(dtype)


# ----- sampling and application -----------------------------------------------------------------------------
class _Transform(NamedTuple):
    weight: float
    draw: Callable[[int, int, int, torch.Generator], Tensor]  # (batch, height, width, generator) -> parameter
    apply: Callable[[Tensor, Tensor], Tensor]  # (frames [B, N, C, H, W], parameter) -> frames


def _uniform(batch: int, bounds: Sequence[float], generator: torch.Generator, *shape: int) -> Tensor:
    low, high = bounds
    return low + (high - low) * torch.rand(batch, *shape, generator=generator, device=generator.device)


_JITTERS: dict[str, tuple[Callable[[Tensor, Tensor], Tensor], tuple[float, float]]] = {
    # name: (function, allowed factors)
    "brightness": (adjust_brightness, (0.0, math.inf)),
    "contrast": (adjust_contrast, (0.0, math.inf)),
    "saturation": (adjust_saturation, (0.0, math.inf)),
    "hue": (adjust_hue, (-0.5, 0.5)),
    "sharpness": (adjust_sharpness, (0.0, math.inf)),
}
TRANSFORMS = (*_JITTERS, "affine", "crop")
"""Transform names in their default order of application (torchvision's colour order, then spatial)."""


def _build(config: ImageAugmentConfig, name: str) -> _Transform:
    option = getattr(config, name)
    if name in _JITTERS:
        return _Transform(option.weight, lambda b, h, w, g: _uniform(b, option.range, g), _JITTERS[name][0])
    if name == "affine":

        def draw_affine(batch: int, height: int, width: int, generator: torch.Generator) -> Tensor:
            angle = _uniform(batch, option.degrees, generator) * (math.pi / 180)
            limit = torch.tensor(
                [option.translate[0] * width, option.translate[1] * height], device=generator.device
            )
            shift = _uniform(batch, (-1.0, 1.0), generator, 2) * limit  # [x, y] pixels
            return affine_theta(angle, shift, _uniform(batch, option.scale, generator), height, width)

        return _Transform(option.weight, draw_affine, warp)

    def draw_crop(batch: int, height: int, width: int, generator: torch.Generator) -> Tensor:
        side = _uniform(batch, option.scale, generator)
        room = (1 - side)[:, None]  # the crop stays inside the frame
        center = _uniform(batch, (-1.0, 1.0), generator, 2) * room
        return crop_theta(side, center)

    return _Transform(option.weight, draw_crop, lambda x, theta: warp(x, theta, padding_mode="border"))


class ImageAugment:
    """Applies an :class:`ImageAugmentConfig` to camera batches with its own seeded generator.

    The generator lives on the device of the first batch it sees and its state is part of
    :meth:`state_dict`, so a resumed run draws the parameters the uninterrupted one would have drawn.

    Args:
        config: the transforms (``config.enable`` is not consulted: the caller decides when to augment).
        seed: generator seed.
    """

    def __init__(self, config: ImageAugmentConfig, *, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.names = config.transform_names()
        self.transforms = [_build(config, name) for name in self.names]
        self.generator: torch.Generator | None = None
        self._saved: dict[str, Any] | None = None  # a loaded state, applied when the generator is created

    def _generator_on(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
            saved, self._saved = self._saved, None
            if saved and saved["device"] == device.type:
                self.generator.set_state(saved["generator"])
            elif saved:
                rank_zero_warn(
                    f"augmentation generator state was saved on {saved['device']}, frames are on {device.type}: "
                    f"reseeded with {self.seed}, so the augmentations differ from the uninterrupted run's"
                )
        return self.generator

    def __call__(self, frames: Tensor) -> Tensor:
        """Augments ``frames`` ``[B, (T,) C, H, W]`` (float in ``[0, 1]`` or uint8), returning the same dtype."""
        if not self.transforms:
            return frames
        generator = self._generator_on(frames.device)
        batch, (height, width) = frames.shape[0], frames.shape[-2:]
        x = _to_unit(frames).reshape(batch, -1, *frames.shape[-3:])  # [B, N, C, H, W]
        chosen_BK = self.choose(batch, generator)
        params = [t.draw(batch, height, width, generator) for t in self.transforms]
        for index, selected_B in self._steps(chosen_BK):
            out = self.transforms[index].apply(x, params[index])
            x = torch.where(selected_B.view(-1, 1, 1, 1, 1), out, x)
        return _from_unit(x.reshape(frames.shape), frames.dtype)

    def choose(self, batch: int, generator: torch.Generator) -> Tensor:
        """``[B, k]`` indices into :attr:`names`: each sample's transforms, in the order they are applied."""
        weights = torch.tensor([t.weight for t in self.transforms], device=generator.device)
        count = min(self.config.max_num_transforms, len(self.transforms))
        chosen = torch.multinomial(weights.expand(batch, -1), count, replacement=False, generator=generator)
        return chosen if self.config.random_order else chosen.sort(dim=1).values

    def _steps(self, chosen_BK: Tensor) -> list[tuple[int, Tensor]]:
        """(transform, samples it applies to) in application order; every sample sees each transform once."""
        if not self.config.random_order:  # sorted: transform order is the config's, one pass per transform
            return [(i, (chosen_BK == i).any(dim=1)) for i in range(len(self.transforms))]
        return [
            (i, chosen_BK[:, slot] == i)
            for slot in range(chosen_BK.shape[1])
            for i in range(len(self.transforms))
        ]

    def state_dict(self) -> dict[str, Any]:
        """The generator's state (once it exists) and the device type it belongs to."""
        if self.generator is None:
            return {}
        return {"device": self.generator.device.type, "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the generator state at the next batch (on a device of the saved type; else reseeds)."""
        if state:
            self.generator, self._saved = None, dict(state)


def rank_seed(seed: int, rank: int) -> int:
    """A seed for data-parallel ``rank`` derived from ``seed`` (independent streams per rank)."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)

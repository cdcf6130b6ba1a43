"""A synthetic text-to-video task for the diffusion quick start: one coloured shape moving across a black frame.

A caption names the shape, its colour and its direction ("a red square moving left"): 2 shapes x 4 colours x 4
directions = 32 captions, each drawn at start positions a few pixels apart. Four (shape, colour, direction) combinations are held
out in a Latin square, so every shape, colour and direction (and every colour-direction pair) is still seen in
training and a model must compose them. :func:`read_clip` reads the three attributes back from a clip (a generated
one included) for the prompt-adherence score.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 230),
    "yellow": (230, 210, 40),
}
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
SHAPES = ("square", "triangle")
HELD_OUT = (
    ("square", "red", "left"),
    ("square", "green", "right"),
    ("triangle", "blue", "up"),
    ("triangle", "yellow", "down"),
)
"""Held-out combinations: one per colour and per direction, two per shape."""

# A pixel belongs to the shape when its brightest channel exceeds this (in [0, 1]; the background is black).
_FOREGROUND = 0.35
# Fill ratio (shape pixels / bounding box) between a square's (1) and a triangle's (about 0.5).
_SQUARE_FILL = 0.75


@dataclass(frozen=True)
class Clip:
    """What a caption says about its clip: ``shape``, ``colour`` and ``direction`` (``None``: not readable)."""

    shape: str | None
    colour: str | None
    direction: str | None

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.direction}"


def all_clips() -> list[Clip]:
    """The 32 combinations, in a fixed order."""
    return [Clip(s, c, d) for s, c, d in itertools.product(SHAPES, COLOURS, DIRECTIONS)]


def split_clips() -> tuple[list[Clip], list[Clip]]:
    """(train, held-out) combinations."""
    held_out = [Clip(*combination) for combination in HELD_OUT]
    return [c for c in all_clips() if c not in held_out], held_out


def vocabulary() -> list[str]:
    """The words of every caption."""
    return ["a", "moving", *SHAPES, *COLOURS, *DIRECTIONS]


def _shape_mask(shape: str, size: int) -> np.ndarray:
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "triangle":  # apex up: row r spans the middle (r + 1) / size of the base
        rows, cols = np.mgrid[0:size, 0:size]
        return np.abs(cols - (size - 1) / 2) <= (rows + 1) / 2
    raise ValueError(f"shape ({shape!r}) must be one of {', '.join(SHAPES)}")


def render_clip(
    clip: Clip,
    start: tuple[int, int],
    *,
    num_frames: int = 5,
    side: int = 32,
    size: int = 12,
    speed: int = 3,
) -> np.ndarray:
    """The clip's frames ``[F, side, side, 3]`` uint8: the shape moves ``speed`` pixels per frame from ``start``.

    Args:
        clip: shape, colour and direction.
        start: the shape's top-left corner ``(x, y)`` in the first frame.
        num_frames: frames.
        side: frame width and height.
        size: the shape's bounding-box side.
        speed: pixels per frame.
    """
    if clip.colour not in COLOURS or clip.direction not in DIRECTIONS:
        raise ValueError(f"colour ({clip.colour!r}) or direction ({clip.direction!r}) is not a known one")
    mask = _shape_mask(str(clip.shape), size)
    (dx, dy), (x0, y0) = DIRECTIONS[clip.direction], start
    frames = np.zeros((num_frames, side, side, 3), dtype=np.uint8)
    for f in range(num_frames):
        x, y = x0 + dx * speed * f, y0 + dy * speed * f
        if min(x, y) < 0 or max(x, y) + size > side:
            raise ValueError(f"start {start} takes the {size}-pixel shape out of the {side}-pixel frame")
        frames[f, y : y + size, x : x + size][mask] = COLOURS[clip.colour]
    return frames


def random_start(
    clip: Clip,
    rng: random.Random,
    *,
    num_frames: int = 5,
    side: int = 32,
    size: int = 12,
    speed: int = 3,
    jitter: int = 3,
) -> tuple[int, int]:
    """A start position within ``jitter`` pixels (per axis) of the middle of those that keep the whole path inside
    the frame: the shape crosses the frame's middle, so a caption's clips differ by a few pixels of position (a
    narrow distribution a tiny model learns in minutes)."""
    travel = speed * (num_frames - 1)
    dx, dy = DIRECTIONS[str(clip.direction)]
    low = [travel if d < 0 else 0 for d in (dx, dy)]
    high = [side - size - (travel if d > 0 else 0) for d in (dx, dy)]
    if min(h - lo for lo, h in zip(low, high)) < 0:
        raise ValueError(f"a {size}-pixel shape moving {travel} pixels does not fit a {side}-pixel frame")
    middle = [(lo + h) // 2 for lo, h in zip(low, high)]
    x, y = (rng.randint(max(lo, m - jitter), min(h, m + jitter)) for lo, h, m in zip(low, high, middle))
    return x, y


def read_clip(video_CFHW: Tensor) -> Clip:
    """Read shape, colour and direction back from a clip ``[3, F, H, W]`` in ``[-1, 1]``.

    The colour is the mean colour of the shape's pixels (those brighter than the black background) snapped to the
    nearest palette colour; the direction is the shape's centroid displacement from the first to the last frame
    snapped to the nearest of the four (``None`` below one pixel); the shape is the square when the pixels fill at
    least 3/4 of their bounding box (median over frames), else the triangle. An attribute is ``None`` when a frame
    holds no shape pixel.
    """
    rgb_FHWC = ((video_CFHW.float().clamp(-1, 1) + 1) / 2).permute(1, 2, 3, 0)
    mask_FHW = rgb_FHWC.amax(-1) > _FOREGROUND
    if not bool(mask_FHW.flatten(1).any(1).all()):
        return Clip(None, None, None)
    mean = rgb_FHWC[mask_FHW].mean(0) * 255
    palette = torch.tensor(list(COLOURS.values()), dtype=mean.dtype)
    colour = list(COLOURS)[int((palette - mean).norm(dim=1).argmin())]
    centroids = []
    fills = []
    for mask_HW in mask_FHW:
        ys, xs = torch.nonzero(mask_HW, as_tuple=True)
        centroids.append(torch.stack([xs.float().mean(), ys.float().mean()]))
        box = (xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)
        fills.append(len(xs) / float(box))
    dx, dy = (centroids[-1] - centroids[0]).tolist()
    direction = None
    if max(abs(dx), abs(dy)) >= 1:
        step = (int(np.sign(dx)), 0) if abs(dx) >= abs(dy) else (0, int(np.sign(dy)))
        direction = next(name for name, d in DIRECTIONS.items() if d == step)
    shape = "square" if float(np.median(fills)) >= _SQUARE_FILL else "triangle"
    return Clip(shape, colour, direction)


def write_moving_shapes(
    output: str | Path,
    *,
    clips_per_caption: int = 40,
    num_frames: int = 5,
    side: int = 32,
    fps: int = 8,
    seed: int = 0,
) -> dict:
    """Write the training clips (``clips/*.mp4``) and their captions (``train.jsonl``, the video-caption JSON lines of
    :class:`~forge_lightning.datamodules.diffusion.VideoCaptionConfig`) of the 28 training combinations, and
    ``prompts.jsonl``: every caption with its ``split`` (``train`` or ``held_out``) for the prompt-adherence score.

    Args:
        output: the folder.
        clips_per_caption: clips of each training caption (random start positions).
        num_frames: frames per clip.
        side: frame width and height.
        fps: the clips' frame rate.
        seed: seeds the start positions.

    Returns:
        Counts of what was written.
    """
    from forge_lightning.sim.video import write_video

    output = Path(output)
    rng = random.Random(seed)
    train, held_out = split_clips()
    records = []
    for k, clip in enumerate(train):
        for n in range(clips_per_caption):
            start = random_start(clip, rng, num_frames=num_frames, side=side)
            name = f"clips/{k:02d}_{n:03d}.mp4"
            write_video(
                output / name,
                list(render_clip(clip, start, num_frames=num_frames, side=side)),
                fps,
                min_size=1,
            )
            records.append({"video": name, "caption": clip.caption})
    (output / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    prompts = [{"caption": c.caption, "split": "train"} for c in train]
    prompts += [{"caption": c.caption, "split": "held_out"} for c in held_out]
    (output / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    return {"clips": len(records), "train_captions": len(train), "held_out_captions": len(held_out)}


def read_caption(caption: str) -> Clip:
    """The attributes a caption of this task names ("a red square moving left")."""
    words = caption.split()
    if len(words) != 5 or words[0] != "a" or words[3] != "moving":
        raise ValueError(f"caption ({caption!r}) is not of the form 'a <colour> <shape> moving <direction>'")
    clip = Clip(shape=words[2], colour=words[1], direction=words[4])
    if clip.shape not in SHAPES or clip.colour not in COLOURS or clip.direction not in DIRECTIONS:
        raise ValueError(f"caption ({caption!r}) names an unknown shape, colour or direction")
    return clip

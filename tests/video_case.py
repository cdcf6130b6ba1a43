"""Shared data of the VLM video tests: a small mp4 written with PyAV beside two PNG images, LLaVA records, and the
frames PyAV itself decodes (the reference of the sampled frames)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from forge_lightning.sim.video import write_video

FRAMES, FPS, HEIGHT, WIDTH = 13, 5, 40, 56
"""The clip: 13 frames of 40 x 56 (height x width) at 5 fps."""


def write_clip(
    path: Path, num_frames: int = FRAMES, seed: int = 0, height: int = HEIGHT, width: int = WIDTH
) -> Path:
    """A seeded mp4 of ``num_frames`` noisy ramps at :data:`FPS`."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 150, width)[None, :, None] + np.linspace(0, 60, height)[:, None, None]
    frames = [
        (ramp + rng.integers(0, 100, (height, width, 3))).clip(0, 255).astype(np.uint8)
        for _ in range(num_frames)
    ]
    return write_video(path, frames, fps=FPS, min_size=1)


def write_media(directory: Path) -> Path:
    """``a.png`` (60 x 45), ``b.png`` (24 x 24) and ``clip.mp4`` (:func:`write_clip`) in ``directory``."""
    rng = np.random.default_rng(1)
    for name, (width, height) in {"a.png": (60, 45), "b.png": (24, 24)}.items():
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(directory / name)
    write_clip(directory / "clip.mp4")
    return directory


def write_jsonl(path: Path, records: list) -> Path:
    """``records`` as JSON lines (a ``str`` record is written as it is: a malformed line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def llava_record(question: str, answer: str, **media) -> dict:
    """A LLaVA record of one question and its answer, with its ``image`` / ``video`` fields."""
    return {
        **media,
        "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
    }


def decoded_frames(path: Path, indices: Sequence[int]) -> list[Image.Image]:
    """The frames ``indices`` of ``path`` as PyAV decodes the whole stream."""
    import av

    with av.open(str(path)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return [Image.fromarray(decoded[i]) for i in indices]

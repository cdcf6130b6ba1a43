"""Rollout videos: frames to an H.264 mp4 with PyAV (the ``embodied`` extra's FFmpeg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def write_video(
    path: str | Path, frames: Sequence[np.ndarray], fps: int, *, min_size: int = 256, codec: str = "libx264"
) -> Path:
    """Writes frames ``(H, W, 3)`` uint8 as an mp4; small frames are enlarged (nearest pixel) to ``min_size``.

    Args:
        path: the ``.mp4`` file to write (its folder is created).
        frames: the episode's camera frames.
        fps: frames per second.
        min_size: frames whose shorter side is below this are repeated by an integer factor to reach it.
        codec: FFmpeg encoder.

    Returns:
        The written path.
    """
    import av

    if not frames:
        raise ValueError("no frames to write")
    stack = np.stack([np.asarray(f, dtype=np.uint8) for f in frames])  # [T, H, W, 3]
    scale = max(1, -(-min_size // min(stack.shape[1:3])))
    stack = stack.repeat(scale, axis=1).repeat(scale, axis=2)
    # yuv420p needs even sides
    stack = np.pad(stack, ((0, 0), (0, stack.shape[1] % 2), (0, stack.shape[2] % 2), (0, 0)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = stack.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for image in stack:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return path

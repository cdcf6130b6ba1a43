"""Generated videos to files and to the run's dashboards.

* ``mp4``: H.264 with PyAV (the ``diffusion`` extra's ``av``), through the project's
  :func:`~forge_lightning.sim.video.write_video`.
* TensorBoard: an image summary holding an animated GIF (Pillow), which is what ``SummaryWriter.add_video``
  writes; ``add_video`` itself needs moviepy, which the project does not depend on.
* W&B: ``WandbLogger.log_video`` with the mp4 file (``wandb.Video`` of a path needs no encoder of its own).

Other loggers (CSV) are skipped.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from torch import Tensor

from forge_lightning.sim.video import write_video


def video_frames(video_3FHW: Tensor) -> np.ndarray:
    """The frames ``[F, H, W, 3]`` uint8 of one RGB video ``[3, F, H, W]`` in ``[-1, 1]`` (clamped)."""
    if video_3FHW.ndim != 4 or video_3FHW.shape[0] != 3:
        raise ValueError(f"a video is [3, F, H, W] in [-1, 1], got shape {tuple(video_3FHW.shape)}")
    pixels = ((video_3FHW.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).byte()
    return pixels.permute(1, 2, 3, 0).numpy()


def write_mp4(path: str | Path, frames: np.ndarray, fps: int) -> Path:
    """Write frames ``[F, H, W, 3]`` uint8 as an H.264 mp4 at their size (odd sides padded by one pixel)."""
    return write_video(path, list(frames), fps=fps, min_size=1)


def gif_bytes(frames: np.ndarray, fps: int) -> bytes:
    """An animated GIF (looping) of frames ``[F, H, W, 3]`` uint8."""
    from PIL import Image

    images = [Image.fromarray(frame) for frame in frames]
    buffer = io.BytesIO()
    duration = max(1, round(1000 / fps))
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=duration, loop=0)
    return buffer.getvalue()


def _tensorboard(logger: TensorBoardLogger, tag: str, frames: np.ndarray, fps: int, step: int) -> None:
    from tensorboard.compat.proto.summary_pb2 import Summary

    F, H, W, C = frames.shape
    image = Summary.Image(height=H, width=W, colorspace=C, encoded_image_string=gif_bytes(frames, fps))
    # The writer's own add_video builds this summary too, after encoding with moviepy; the file writer is the
    # one both SummaryWriter implementations (torch's, tensorboardX) write their summaries through.
    logger.experiment._get_file_writer().add_summary(
        Summary(value=[Summary.Value(tag=tag, image=image)]), step
    )


def log_video(
    loggers: Iterable[Logger],
    tag: str,
    *,
    frames: np.ndarray,
    mp4: Path,
    fps: int,
    step: int,
    caption: str,
) -> list[str]:
    """Log one video to every TensorBoard and W&B logger of a run (call on global rank 0).

    Args:
        loggers: the trainer's loggers.
        tag: the dashboard key (``samples/video_0``).
        frames: the video's frames ``[F, H, W, 3]`` uint8 (TensorBoard's GIF).
        mp4: the video's mp4 file (W&B uploads it).
        fps: frames per second.
        step: the global step.
        caption: shown with the video in W&B (the prompt).

    Returns:
        The names of the logger classes that received it.
    """
    received = []
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            _tensorboard(logger, tag, frames, fps, step)
        elif isinstance(logger, WandbLogger):
            logger.log_video(tag, [str(mp4)], step=step, caption=[caption], format=["mp4"])
        else:
            continue
        received.append(type(logger).__name__)
    return received

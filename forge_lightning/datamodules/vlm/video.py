"""Video files as Qwen2-VL / Qwen3-VL frames: which frames to sample (transformers' ``Qwen2VLVideoProcessor`` /
``Qwen3VLVideoProcessor.sample_frames``) and their decoding with the project's PyAV frame reader
(``datamodules/lerobot/video.py``)::

    video file ─ header: frame count, frame rate, size ─ sample_indices (fps or num_frames, a multiple of
      temporal_patch_size) ─ VideoFrames (seek to the key frame, decode forward, rgb24) ─ uint8 [T, H, W, 3]
      ─ Qwen2VLImageProcessor.preprocess_videos (smart_resize at the video pixel limits, temporal patches)

``second_per_grid_ts`` (seconds one temporal patch spans, for Qwen2.5-VL's M-RoPE) is ``temporal_patch_size`` over
the rate the frames were sampled at, as transformers' Qwen2.5-VL processor writes it. Qwen3-VL writes the time as
text instead: ``Qwen3VideoSampling.timestamps`` are the seconds of each temporal patch, the mean of its first and
last frame's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forge_lightning.datamodules.lerobot.video import VideoFrames


@dataclass(frozen=True)
class VideoInfo:
    """What the header of a video file says.

    Args:
        num_frames: frames in the first video stream.
        fps: its average frame rate.
        width: frame width in pixels.
        height: frame height in pixels.
    """

    num_frames: int
    fps: float
    width: int
    height: int


@dataclass(frozen=True, kw_only=True)
class VideoSampling:
    """Which frames of a video become model input, as transformers' ``Qwen2VLVideoProcessor.sample_frames``.

    Args:
        fps: frames sampled per second of video (transformers' ``fps``), unless ``num_frames`` is set.
        num_frames: a fixed frame count instead (rounded to a multiple of ``temporal_patch_size``).
        min_frames: the least frames sampled at ``fps``.
        max_frames: the most frames sampled at ``fps``.
        temporal_patch_size: the sampled count is a multiple of it.
    """

    fps: float = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2

    def __post_init__(self) -> None:
        if self.fps <= 0:
            raise ValueError(f"video fps ({self.fps}) must be positive")
        if self.num_frames is not None and self.num_frames < self.temporal_patch_size:
            raise ValueError(
                f"video num_frames ({self.num_frames}) must be at least temporal_patch_size ({self.temporal_patch_size})"
            )
        if not 0 < self.min_frames <= self.max_frames:
            raise ValueError(
                f"min_frames ({self.min_frames}) must be positive and at most max_frames ({self.max_frames})"
            )

    def indices(self, info: VideoInfo) -> list[int]:
        """The frame indices to decode, evenly spread over the video.

        Raises:
            ValueError: the video has fewer frames than one temporal patch, or than ``num_frames``.
        """
        total, tps = info.num_frames, self.temporal_patch_size
        if self.num_frames is not None:
            count = round(self.num_frames / tps) * tps
        else:
            longest = math.floor(min(self.max_frames, total) / tps) * tps
            count = min(max(total / info.fps * self.fps, self.min_frames), longest, total)
            count = math.floor(count / tps) * tps
        if count < tps or count > total:
            raise ValueError(
                f"a video of {total} frames cannot give {max(count, tps)} sampled frames (fps {self.fps}, "
                f"num_frames {self.num_frames}, temporal_patch_size {tps}): use a longer video or fewer frames"
            )
        # transformers: torch.arange(0, total, total / count).int(), in float32 steps
        return (
            np.arange(0, total, np.float32(total / count), dtype=np.float32).astype(np.int64)[:count].tolist()
        )

    def seconds_per_grid(self, info: VideoInfo) -> float:
        """Seconds of video one temporal patch spans: ``temporal_patch_size`` over the rate the frames were
        sampled at (``sampled / num_frames * fps``: transformers' ``VideoMetadata.sampled_fps``, which differs from
        ``fps`` where the count was rounded or bounded)."""
        rate = len(self.indices(info)) * info.fps / info.num_frames
        return self.temporal_patch_size / rate


@dataclass(frozen=True, kw_only=True)
class Qwen3VideoSampling(VideoSampling):
    """Qwen3-VL's frames (transformers' ``Qwen3VLVideoProcessor.sample_frames``), which differ from Qwen2-VL's:
    at ``fps`` the count is ``int(frames / video fps * fps)`` bounded by ``min_frames``, ``max_frames`` and the
    frame count, and ``num_frames`` is taken as it is, neither rounded to a multiple of ``temporal_patch_size``
    (the processor repeats the last frame to fill the last temporal patch) nor bounded by the video (indices then
    repeat); the indices are ``linspace(0, frames - 1, count)`` rounded, so the last frame is always sampled.

    Args: as :class:`VideoSampling`.
    """

    def indices(self, info: VideoInfo) -> list[int]:
        """The frame indices to decode, evenly spread over the video from its first to its last frame.

        Raises:
            ValueError: fewer sampled frames than one temporal patch.
        """
        total, tps = info.num_frames, self.temporal_patch_size
        count = self.num_frames
        if count is None:
            count = min(max(int(total / info.fps * self.fps), self.min_frames), self.max_frames, total)
        if count < tps:
            raise ValueError(
                f"a video of {total} frames gives {count} sampled frame(s) (fps {self.fps}, num_frames "
                f"{self.num_frames}), fewer than one temporal patch ({tps}): use a longer video"
            )
        return np.linspace(0, total - 1, count).round().astype(np.int64).tolist()

    def timestamps(self, info: VideoInfo) -> list[float]:
        """The time in seconds of each temporal patch of the sampled frames: the mean of its first and last frame's
        ``index / fps``, the last patch filled up with the last frame (transformers'
        ``Qwen3VLProcessor._calculate_timestamps``)."""
        indices, tps = self.indices(info), self.temporal_patch_size
        indices += indices[-1:] * (-len(indices) % tps)
        return [
            (indices[k] / info.fps + indices[k + tps - 1] / info.fps) / 2 for k in range(0, len(indices), tps)
        ]


@dataclass(frozen=True)
class VideoFile:
    """A video of a record, as the scan found it.

    Args:
        ref: the reference as the record writes it, for messages.
        path: the resolved file.
        info: what its header said at the scan.
    """

    ref: str
    path: Path
    info: VideoInfo


def probe_video(path: str | Path) -> VideoInfo:
    """The frame count, rate and size of the first video stream of ``path`` (from the container, no decode).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a video PyAV can open, or one without a frame count.
    """
    import av

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError(f"{path} has no video stream")
            stream = container.streams.video[0]
            frames, rate = stream.frames, stream.average_rate
            width, height = stream.codec_context.width, stream.codec_context.height
    except av.FFmpegError as error:
        raise ValueError(f"{path} cannot be opened as a video ({error})") from None
    if not frames or not rate:
        raise ValueError(
            f"{path}: the container gives no frame count or rate; remux it (ffmpeg -c copy) to mp4"
        )
    return VideoInfo(int(frames), float(rate), int(width), int(height))


def read_video(path: str | Path, sampling: VideoSampling, frames: VideoFrames | None = None) -> np.ndarray:
    """The sampled frames of ``path``: uint8 ``[T, H, W, 3]``.

    Args:
        path: the video file.
        sampling: which frames.
        frames: the decoder cache to use (one per process, kept open); by default a new one, closed on return.
    """
    info = probe_video(path)
    decoder = frames or VideoFrames("pyav")
    try:
        frames_T3HW = decoder.frames(path, sampling.indices(info), info.fps)
    finally:
        # A PyAV container is in a reference cycle, so only the garbage collector would free one left open: in a
        # forked loader worker that collection waits forever on the parent's decoding threads. Close it here.
        if frames is None:
            decoder.close()
    return frames_T3HW.permute(0, 2, 3, 1).numpy()

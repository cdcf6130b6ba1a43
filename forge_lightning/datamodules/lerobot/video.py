"""Frame access in LeRobot mp4 files, with decoders cached per process and never shared across fork.

A frame is addressed by its index in the file, ``round(timestamp * fps)`` (LeRobot picks the decoded frame
nearest to the timestamp, which is the same frame when timestamps are multiples of ``1 / fps``). The PyAV path
seeks to the key frame at or before the first wanted frame and decodes forward, as LeRobot's PyAV path does,
converting with FFmpeg's ``rgb24`` conversion; torchcodec is used instead when asked for and importable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forge_lightning.datamodules.lerobot.meta import LeRobotFormatError

VIDEO_BACKENDS = ("pyav", "torchcodec")


class VideoFrames:
    """Decodes frames by index from mp4 files, keeping one open decoder per file in the current process.

    Open decoders hold FFmpeg state that must not cross ``fork``: the cache is keyed by process id (a forked
    DataLoader worker starts with an empty one and never touches its parent's decoders) and pickling drops it
    (spawned workers open their own). Decoders open lazily, on the first frame a process asks for.

    Args:
        backend: ``"pyav"`` or ``"torchcodec"``.
    """

    def __init__(self, backend: str = "pyav") -> None:
        if backend not in VIDEO_BACKENDS:
            raise ValueError(f"video_backend ({backend!r}) must be one of {VIDEO_BACKENDS}")
        if backend == "torchcodec":
            try:
                import torchcodec.decoders  # noqa: F401
            except Exception as error:  # torchcodec raises RuntimeError when FFmpeg libraries are missing
                raise ValueError(f"video_backend 'torchcodec' is not usable here: {error}") from None
        self.backend = backend
        self._pid = os.getpid()
        self._decoders: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"backend": self.backend}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["backend"])  # type: ignore[misc]

    @property
    def num_open(self) -> int:
        """Decoders open in this process."""
        return len(self._decoders) if self._pid == os.getpid() else 0

    def _decoder(self, path: str) -> Any:
        if self._pid != os.getpid():  # forked: forget (never close) the parent's decoders
            self._pid, self._decoders = os.getpid(), {}
        if path not in self._decoders:
            if not Path(path).exists():
                raise LeRobotFormatError(f"video file {path} is missing")
            if self.backend == "torchcodec":
                from torchcodec.decoders import VideoDecoder

                self._decoders[path] = VideoDecoder(path)
            else:
                import av

                try:
                    self._decoders[path] = av.open(path)
                except av.FFmpegError as error:
                    raise LeRobotFormatError(f"video file {path} cannot be opened: {error}") from None
        return self._decoders[path]

    def close(self) -> None:
        """Closes this process's decoders."""
        if self._pid == os.getpid():
            for decoder in self._decoders.values():
                if hasattr(decoder, "close"):
                    decoder.close()
        self._pid, self._decoders = os.getpid(), {}

    def frames(self, path: str | Path, indices: list[int], fps: int) -> torch.Tensor:
        """Frames ``indices`` of the file as uint8 ``(len(indices), 3, height, width)``.

        Raises:
            LeRobotFormatError: If the file is missing or lacks a wanted frame.
        """
        path = str(path)
        decoder = self._decoder(path)
        if self.backend == "torchcodec":
            seconds = [i / fps for i in indices]
            return decoder.get_frames_played_at(seconds=seconds).data
        wanted = sorted(set(indices))
        found = _decode_pyav(decoder, wanted, fps)
        missing = [i for i in wanted if i not in found]
        if missing:
            raise LeRobotFormatError(f"video file {path} has no frames {missing} (fps {fps})")
        return torch.from_numpy(np.stack([found[i] for i in indices])).permute(0, 3, 1, 2)


def _decode_pyav(container: Any, wanted: list[int], fps: int) -> dict[int, np.ndarray]:
    """Decodes forward from the key frame at or before ``wanted[0] / fps`` up to ``wanted[-1]``."""
    stream = container.streams.video[0]
    first = wanted[0] / fps
    container.seek(int(first / stream.time_base), stream=stream, backward=True, any_frame=False)
    found: dict[int, np.ndarray] = {}
    targets = set(wanted)
    for frame in container.decode(stream):
        index = round(frame.time * fps)
        if index in targets:
            found[index] = frame.to_ndarray(format="rgb24")  # (H, W, 3) uint8
        if index >= wanted[-1]:
            break
    return found

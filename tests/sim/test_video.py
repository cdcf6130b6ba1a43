"""Rollout videos: mp4 files that decode back to the episode's frames (enlarged)."""

from __future__ import annotations

import av
import numpy as np

from forge_lightning.sim.video import write_video


def test_video_decodes_to_the_enlarged_frames(tmp_path):
    frames = []
    for t in range(12):
        frame = np.full((32, 32, 3), 128, dtype=np.uint8)
        frame[4 + t : 12 + t, 8:16] = (230, 40, 40)  # a red square moving down
        frames.append(frame)
    path = write_video(tmp_path / "videos" / "episode.mp4", frames, fps=10)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 10
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(decoded) == 12
    assert decoded[0].shape == (256, 256, 3)  # 32 px enlarged 8x to the 256-pixel minimum
    for t in (0, 11):
        small = decoded[t].reshape(32, 8, 32, 8, 3).mean(axis=(1, 3))
        assert np.abs(small - frames[t]).mean() < 6


def test_odd_sizes_are_padded_to_even(tmp_path):
    frames = [np.zeros((15, 21, 3), dtype=np.uint8)] * 3
    path = write_video(tmp_path / "odd.mp4", frames, fps=5, min_size=1)
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
    assert (frame.height, frame.width) == (16, 22)

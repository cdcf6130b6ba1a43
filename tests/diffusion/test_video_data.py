"""Video-caption data of the video-diffusion family: mp4 files written with PyAV, scanned into buckets (the
nearest aspect ratio whose ``4k + 1`` frame count the video fills at the target fps), decoded into ``[3, F, H, W]``
in ``[-1, 1]`` (the sampled frames equal a plain PyAV decode; the resize equals PIL's antialiased bilinear within
rounding), from a folder + JSONL and from WebDataset shards (the same samples); bad records named, skipped and
counted or raised; batches of one bucket each, resumable, the same samples on 1 or 2 ranks."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from forge_lightning.datamodules.diffusion import (
    ClipSampling,
    GroupedStepLoader,
    VideoBucket,
    VideoCaptionDataset,
    choose_bucket,
    parse_buckets,
    resize_crop,
    scan_video_captions,
    video_caption_collate,
)
from forge_lightning.datamodules.vlm import BadSampleError
from forge_lightning.datamodules.vlm.video import VideoInfo
from forge_lightning.sim.video import write_video

BUCKETS = parse_buckets([[5, 32, 48], [9, 32, 48], [5, 48, 32]])
FPS = 8


def write_clip(path: Path, num_frames: int, height: int, width: int, fps: int = 16, seed: int = 0) -> Path:
    """A clip of smooth ramps plus noise (H.264 keeps it close to the frames written)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 150, width)[None, :, None] + np.linspace(0, 60, height)[:, None, None]
    frames = [
        (ramp + 5 * t + rng.integers(0, 60, (height, width, 3))).clip(0, 255).astype(np.uint8)
        for t in range(num_frames)
    ]
    return write_video(path, frames, fps=fps, min_size=1)


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """``wide.mp4`` (17 frames of 40 x 64 at 16 fps), ``tall.mp4`` (9 frames of 64 x 40), ``short.mp4`` (3 frames),
    ``corrupt.mp4`` (not a video) and ``captions.jsonl`` naming them and a missing one."""
    root = tmp_path_factory.mktemp("videos")
    write_clip(root / "wide.mp4", 17, 40, 64)
    write_clip(root / "tall.mp4", 9, 64, 40, seed=1)
    write_clip(root / "wide2.mp4", 13, 36, 60, seed=2)
    write_clip(root / "short.mp4", 3, 40, 64, seed=3)
    (root / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    records = [
        {"video": "wide.mp4", "caption": "a wide clip"},
        {"video": "tall.mp4", "caption": "a tall clip"},
        "{not json",
        {"video": "missing.mp4", "caption": "gone"},
        {"video": "corrupt.mp4", "caption": "broken"},
        {"video": "short.mp4", "caption": "too short"},
        {"video": "wide2.mp4", "caption": ""},
        {"video": "wide2.mp4", "caption": "another wide clip"},
    ]
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_buckets_are_validated():
    assert parse_buckets([[17, 480, 832]]) == [VideoBucket(17, 480, 832)]
    with pytest.raises(ValueError, match=r"frames \(16\) must be 4k \+ 1.*e\.g\. 13"):
        parse_buckets([[16, 480, 832]])
    with pytest.raises(ValueError, match="multiples of 16"):
        parse_buckets([[17, 480, 830]])
    with pytest.raises(ValueError, match="three positive integers"):
        parse_buckets([[17, 480]])


def test_bucket_choice_and_frame_indices():
    wide = VideoInfo(num_frames=17, fps=16.0, width=64, height=40)
    # 9 frames at 8 fps: the nearest aspect ratio (1.5), the most frames of it
    assert choose_bucket(wide, BUCKETS, FPS) == VideoBucket(9, 32, 48)
    assert ClipSampling(fps=FPS, num_frames=9).indices(wide) == [0, 2, 4, 6, 8, 10, 12, 14, 16]
    # 13 frames give 7 at 8 fps: only the 5-frame bucket of the same aspect ratio fits
    assert choose_bucket(VideoInfo(13, 16.0, 60, 36), BUCKETS, FPS) == VideoBucket(5, 32, 48)
    assert choose_bucket(VideoInfo(9, 16.0, 40, 64), BUCKETS, FPS) == VideoBucket(5, 48, 32)
    # 30 fps to 8 fps: frame floor(k * 3.75)
    assert ClipSampling(fps=FPS, num_frames=5).indices(VideoInfo(16, 30.0, 64, 40)) == [0, 3, 7, 11, 15]
    assert choose_bucket(VideoInfo(3, 16.0, 64, 40), BUCKETS, FPS) is None
    with pytest.raises(ValueError, match="fewer than 9"):
        ClipSampling(fps=FPS, num_frames=9).indices(VideoInfo(13, 16.0, 60, 36))


def _pyav_frames(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _pil_resize_crop(frames: np.ndarray, bucket: VideoBucket) -> np.ndarray:
    """PIL's antialiased bilinear resize to cover the bucket, then the centre crop: [3, T, H, W] in [-1, 1]."""
    height, width = frames.shape[1:3]
    scale = max(bucket.height / height, bucket.width / width)
    size = (max(bucket.width, round(width * scale)), max(bucket.height, round(height * scale)))
    left, top = (size[0] - bucket.width) // 2, (size[1] - bucket.height) // 2
    out = [
        np.asarray(Image.fromarray(f).resize(size, Image.BILINEAR))[
            top : top + bucket.height, left : left + bucket.width
        ]
        for f in frames
    ]
    return np.stack(out).transpose(3, 0, 1, 2).astype(np.float32) / 127.5 - 1


def test_folder_samples_decode_and_resize(videos):
    samples, report = scan_video_captions([videos / "captions.jsonl"], BUCKETS, fps=FPS)
    assert [s.source.rsplit("/", 1)[-1] for s in samples] == [
        "captions.jsonl:1",
        "captions.jsonl:2",
        "captions.jsonl:8",
    ]
    assert [s.bucket for s in samples] == [
        VideoBucket(9, 32, 48),
        VideoBucket(5, 48, 32),
        VideoBucket(5, 32, 48),
    ]
    dataset = VideoCaptionDataset(samples, fps=FPS)
    item = dataset[0]
    assert item["caption"] == "a wide clip"
    assert item["video"].shape == (3, 9, 32, 48) and item["video"].dtype == torch.float32
    assert item["video"].min() >= -1 and item["video"].max() <= 1
    # the sampled frames are a plain PyAV decode's frames 0, 2, .., 16; the resize is PIL's within rounding
    frames = _pyav_frames(videos / "wide.mp4")[::2]
    assert torch.equal(
        resize_crop(frames, VideoBucket(9, 40, 64)), torch.from_numpy(frames).permute(3, 0, 1, 2) / 127.5 - 1
    )
    reference = _pil_resize_crop(frames, VideoBucket(9, 32, 48))
    assert np.abs(item["video"].numpy() - reference).max() <= 1.5 / 127.5
    tall = dataset[1]["video"]
    assert (
        np.abs(
            tall.numpy() - _pil_resize_crop(_pyav_frames(videos / "tall.mp4")[:9:2], VideoBucket(5, 48, 32))
        ).max()
        <= 1.5 / 127.5
    )


def test_bad_records_are_named_skipped_and_counted(videos):
    jsonl = videos / "captions.jsonl"
    _, report = scan_video_captions([jsonl], BUCKETS, fps=FPS)
    assert (report.records, report.kept) == (8, 3)
    assert {reason: len(messages) for reason, messages in report.skipped.items()} == {
        "malformed record": 2,
        "missing video": 1,
        "unreadable video": 1,
        "too short": 1,
    }
    assert report.skipped["malformed record"][0].startswith(f"{jsonl}:3: ")
    assert report.skipped["malformed record"][1] == f"{jsonl}:7: the caption is missing or empty"
    assert report.skipped["missing video"] == [f"{jsonl}:4: video {videos / 'missing.mp4'} not found"]
    assert report.skipped["unreadable video"][0].startswith(f"{jsonl}:5: ")
    assert report.skipped["too short"] == [
        f"{jsonl}:6: 3 frames at 16 fps fill no bucket at 8 fps (the shortest needs 5)"
    ]
    line = report.describe()
    assert "3 of 8 samples kept (1 in 5x32x48, 1 in 5x48x32, 1 in 9x32x48)" in line and "1 too short" in line
    with pytest.raises(BadSampleError, match=rf"{jsonl}:3: "):
        scan_video_captions([jsonl], BUCKETS, fps=FPS, on_bad_sample="error")


def test_a_video_cut_after_its_header_is_found_by_verify_frames(tmp_path):
    path, rng = tmp_path / "faststart.mp4", np.random.default_rng(0)
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:  # the header first
        stream = container.add_stream("libx264", rate=16)
        stream.height, stream.width, stream.pix_fmt = 40, 64, "yuv420p"
        for _ in range(17):
            frame = av.VideoFrame.from_ndarray(
                rng.integers(0, 255, (40, 64, 3), dtype=np.uint8), format="rgb24"
            )
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    data = path.read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 2])
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"video": "cut.mp4", "caption": "cut"}) + "\n")
    samples, _ = scan_video_captions([jsonl], BUCKETS, fps=FPS)  # the header reads
    with pytest.raises(ValueError, match=rf"{jsonl}:1: the video cannot be decoded .*verify_frames"):
        VideoCaptionDataset(samples, fps=FPS)[0]
    samples, report = scan_video_captions([jsonl], BUCKETS, fps=FPS, verify_frames=True)
    assert not samples and report.skipped["corrupt video"][0].startswith(f"{jsonl}:1: ")


def _write_shard(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_webdataset_shards_give_the_folder_samples(videos, tmp_path):
    shard = _write_shard(
        tmp_path / "train-000.tar",
        {
            "a.mp4": (videos / "wide.mp4").read_bytes(),
            "a.txt": b"a wide clip",
            "b.mp4": (videos / "tall.mp4").read_bytes(),
            "b.json": json.dumps({"caption": "a tall clip"}).encode(),
            "c.mp4": (videos / "short.mp4").read_bytes(),
            "c.txt": b"too short",
            "d.txt": b"no video",
        },
    )
    samples, report = scan_video_captions([str(shard)], BUCKETS, fps=FPS)
    assert [s.source for s in samples] == ["train-000.tar:a", "train-000.tar:b"]
    assert report.skipped["too short"][0].startswith("train-000.tar:c: ")
    assert report.skipped["malformed record"] == ["train-000.tar:d: no video member (its members: txt)"]
    folder, _ = scan_video_captions([videos / "captions.jsonl"], BUCKETS, fps=FPS)
    from_shards, from_folder = VideoCaptionDataset(samples, fps=FPS), VideoCaptionDataset(folder, fps=FPS)
    for k in range(2):
        assert from_shards[k]["caption"] == from_folder[k]["caption"]
        assert torch.equal(from_shards[k]["video"], from_folder[k]["video"])


def test_batches_hold_one_bucket_and_resume(videos):
    samples, _ = scan_video_captions([videos / "captions.jsonl"], BUCKETS, fps=FPS)
    dataset = VideoCaptionDataset(samples * 4, fps=FPS)  # 4 samples in each of 3 buckets
    options = dict(batch_size=2, seed=3, collate_fn=video_caption_collate, label_key=None)
    loader = GroupedStepLoader(dataset, **options)
    assert len(loader) == 6
    batches = list(loader)
    assert [tuple(b["video"].shape[2:]) for b in batches].count((9, 32, 48)) == 2
    assert all(len(set(b["caption"])) == 1 for b in batches)  # one bucket: the same clip here
    indices = loader._batch_indices(0, 0)
    assert sorted(i for b in indices for i in b) == list(range(12))
    # two ranks of batch 1 see the samples of one process of batch 2, step by step
    ranks = [
        GroupedStepLoader(dataset, **{**options, "batch_size": 1}, num_replicas=2, rank=r) for r in range(2)
    ]
    assert [a + b for a, b in zip(*(r._batch_indices(0, 0) for r in ranks))] == indices
    # resume after 2 batches: the rest of the epoch, then a new order
    loader.mark_consumed(), loader.mark_consumed()
    resumed = GroupedStepLoader(dataset, **options)
    resumed.load_state_dict(loader.state_dict())
    assert resumed._batch_indices(resumed.epoch, resumed.consumed) == indices[2:]
    assert GroupedStepLoader(dataset, **options)._batch_indices(1, 0) != indices


def test_datamodule_from_yaml_gives_batches_of_one_bucket(videos):
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningDataModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data", required=True)
    section = {
        "class_path": "forge_lightning.datamodules.diffusion.VideoDiffusionDataModule",
        "init_args": {
            "data": {
                "entries": [str(videos / "captions.jsonl")],
                "buckets": [[5, 32, 48], [5, 48, 32]],
                "fps": FPS,
            },
            "batch_size": 1,
            "num_workers": 0,
            "pin_memory": False,
        },
    }
    datamodule = parser.instantiate_classes(parser.parse_object({"data": section})).data
    datamodule.setup("fit")
    batches = list(datamodule.train_dataloader())
    assert sorted(tuple(b["video"].shape) for b in batches) == [(1, 3, 5, 32, 48)] * 2 + [(1, 3, 5, 48, 32)]
    assert "step_tokens" not in batches[0]
    with pytest.raises(ValueError, match="cache and cache_config go together"):
        type(datamodule)(cache="features")

"""Video-caption data: a folder of videos with a JSONL of captions, or WebDataset shards, scanned once at setup
into samples of one bucket each, then decoded into ``video [3, F, H, W]`` in ``[-1, 1]`` and ``caption``::

    entry                         a record is                                  named
    captions.jsonl                {"video": "clip.mp4", "caption": "..."}      captions.jsonl:3
    shards/train-{000..009}.tar   members key.mp4 + key.txt (or key.json       train-000.tar:key
                                  with a "caption")

The scan reads every video's header (no decode; ``verify_frames`` decodes the sampled frames too) and picks its
bucket (:func:`~forge_lightning.datamodules.diffusion.buckets.choose_bucket`). A record that is malformed, whose
video is missing, unreadable or too short for every bucket, is named and skipped and counted, or raised
(``on_bad_sample="error"``). A shard's video is written to a temporary file to decode (PyAV reads files).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from forge_lightning.datamodules.diffusion.buckets import (
    ClipSampling,
    VideoBucket,
    choose_bucket,
    resize_crop,
)
from forge_lightning.datamodules.json_records import MalformedRecord, read_json_records
from forge_lightning.datamodules.lerobot.video import VideoFrames
from forge_lightning.datamodules.vlm.scan import ON_BAD_SAMPLE, BadSampleError, scan_or_skip
from forge_lightning.datamodules.vlm.sources import SHARD_SUFFIXES, TarMember, require
from forge_lightning.datamodules.vlm.video import VideoInfo, probe_video, read_video

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi")

# Reasons a record is left out, in the order the summary lists them.
MALFORMED = "malformed record"
MISSING_VIDEO = "missing video"
UNREADABLE_VIDEO = "unreadable video"
TOO_SHORT = "too short"
CORRUPT_VIDEO = "corrupt video"
REASONS = (MALFORMED, MISSING_VIDEO, UNREADABLE_VIDEO, TOO_SHORT, CORRUPT_VIDEO)


@dataclass(frozen=True)
class VideoRef:
    """Where a sample's video is: a file, or a member of a tar shard.

    Args:
        path: the video file.
        member: the shard member (when ``path`` is ``None``).
    """

    path: Path | None = None
    member: TarMember | None = None

    @contextmanager
    def local_file(self) -> Iterator[Path]:
        """A path PyAV can open: the file itself, or the member's bytes in a temporary file."""
        if self.path is not None:
            yield self.path
            return
        assert self.member is not None
        with _temporary_video(self.member.read(), self.member.extension) as path:
            yield path


@contextmanager
def _temporary_video(data: bytes, extension: str) -> Iterator[Path]:
    fd, name = tempfile.mkstemp(suffix=f".{extension}")
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
        yield Path(name)
    finally:
        os.unlink(name)


@dataclass(frozen=True)
class VideoCaptionSample:
    """A record that passed the scan.

    Args:
        source: ``file:line`` or ``shard.tar:key``.
        caption: its text.
        video: where its video is.
        info: the video's header.
        bucket: the bucket it trains in.
    """

    source: str
    caption: str
    video: VideoRef
    info: VideoInfo
    bucket: VideoBucket


@dataclass
class VideoScanReport:
    """What the scan kept and why it left records out.

    Args:
        entries: the data entries scanned.
        records: records read.
        kept: records kept.
        buckets: kept samples per bucket (``"FxHxW"``).
        skipped: messages of the left-out records, by reason (one of :data:`REASONS`).
    """

    entries: list[str]
    records: int = 0
    kept: int = 0
    buckets: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the log, naming the first record of each reason."""
        per_bucket = ", ".join(f"{n} in {b}" for b, n in sorted(self.buckets.items()))
        line = (
            f"video data {', '.join(self.entries)}: {self.kept} of {self.records} samples kept ({per_bucket})"
        )
        reasons = [r for r in REASONS if self.skipped.get(r)]
        if reasons:
            line += "; skipped " + ", ".join(
                f"{len(self.skipped[r])} {r} ({self.skipped[r][0]})" for r in reasons
            )
        return line


@dataclass(frozen=True)
class _Record:
    source: str
    caption: Any
    video: VideoRef | None
    data: bytes | None = None  # a shard member's bytes, while the scan holds them
    problem: str | None = None


def _caption_records(path: Path, video_root: Path | None) -> Iterator[_Record]:
    root = video_root if video_root is not None else path.parent
    for source, record in read_json_records(path):
        if isinstance(record, MalformedRecord):
            yield _Record(source, None, None, problem=str(record))
        elif not isinstance(record, dict) or not isinstance(record.get("video"), str):
            yield _Record(
                source, None, None, problem=f'{source}: a record needs "video" (a path) and "caption"'
            )
        else:
            yield _Record(source, record.get("caption"), VideoRef(path=root / record["video"]))


def _shard_records(pattern: str) -> Iterator[_Record]:
    wds = require("webdataset", "webdataset", "reading WebDataset shards")
    for shard in wds.shardlists.expand_urls(pattern):
        if not Path(shard).is_file():
            raise FileNotFoundError(f"{pattern}: shard {shard} not found")
        pipeline = wds.DataPipeline(
            wds.SimpleShardList([shard]), wds.tarfile_to_samples(handler=wds.reraise_exception)
        )
        for sample in pipeline:
            source = f"{Path(shard).name}:{sample['__key__']}"
            yield _shard_record(shard, source, sample)


def _shard_record(shard: str, source: str, sample: dict[str, Any]) -> _Record:
    members = ", ".join(sorted(k for k in sample if not k.startswith("__")))
    video = next((ext for ext in VIDEO_EXTENSIONS if ext in sample), None)
    if video is None:
        return _Record(source, None, None, problem=f"{source}: no video member (its members: {members})")
    if "txt" in sample:
        caption: Any = sample["txt"].decode("utf-8", errors="replace")
    elif "json" in sample:
        try:
            caption = json.loads(sample["json"]).get("caption")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
            return _Record(
                source, None, None, problem=f"{source}: the json member is not a JSON object ({error})"
            )
    else:
        return _Record(
            source, None, None, problem=f"{source}: no txt or json caption member (its members: {members})"
        )
    ref = VideoRef(member=TarMember(shard, sample["__key__"], video))
    return _Record(source, caption, ref, data=sample[video])


def _records(entry: str, video_root: Path | None) -> Iterator[_Record]:
    if entry.endswith(SHARD_SUFFIXES) or "{" in entry:
        return _shard_records(entry)
    if entry.endswith((".jsonl", ".json")):
        return _caption_records(Path(entry), video_root)
    raise ValueError(
        f"{entry}: a video data entry must be a .jsonl of captions or WebDataset shards (.tar, or a brace "
        "pattern such as train-{000..009}.tar)"
    )


def scan_video_captions(
    entries: Sequence[str | Path],
    buckets: Sequence[VideoBucket],
    *,
    fps: float,
    video_root: str | Path | None = None,
    on_bad_sample: str = "skip",
    verify_frames: bool = False,
) -> tuple[list[VideoCaptionSample], VideoScanReport]:
    """Scan video-caption entries into samples, one bucket each.

    Args:
        entries: ``.jsonl`` caption files and WebDataset shard paths or brace patterns.
        buckets: the training shapes.
        fps: the frame rate frames are sampled at.
        video_root: where relative video paths of a ``.jsonl`` start (default: its directory).
        on_bad_sample: ``skip`` (count and leave out) or ``error`` (raise the first).
        verify_frames: also decode each sample's frames (slow; finds a video cut short after its header).

    Raises:
        BadSampleError: the first bad record, with ``on_bad_sample="error"``.
    """
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise ValueError(f"on_bad_sample ({on_bad_sample!r}) must be one of {', '.join(ON_BAD_SAMPLE)}")
    root = Path(video_root) if video_root is not None else None
    report = VideoScanReport([str(e) for e in entries])
    samples = []
    for entry in entries:
        for record in _records(str(entry), root):
            report.records += 1
            sample = scan_or_skip(
                partial(_scan, record, buckets, fps, verify_frames), on_bad_sample, report.skipped
            )
            if sample is None:
                continue
            samples.append(sample)
            report.kept += 1
            report.buckets[str(sample.bucket)] = report.buckets.get(str(sample.bucket), 0) + 1
    return samples, report


def _scan(record: _Record, buckets: Sequence[VideoBucket], fps: float, verify: bool) -> VideoCaptionSample:
    source = record.source
    if record.problem is not None:
        raise BadSampleError(MALFORMED, record.problem)
    if not isinstance(record.caption, str) or not record.caption.strip():
        raise BadSampleError(MALFORMED, f"{source}: the caption is missing or empty")
    assert record.video is not None
    video = record.video
    if video.path is not None and not video.path.is_file():
        raise BadSampleError(MISSING_VIDEO, f"{source}: video {video.path} not found")
    local = (
        _temporary_video(record.data, video.member.extension)
        if record.data is not None and video.member is not None
        else video.local_file()
    )
    with local as path:
        try:
            info = probe_video(path)
        except ValueError as error:
            raise BadSampleError(UNREADABLE_VIDEO, f"{source}: {error}") from None
        bucket = choose_bucket(info, buckets, fps)
        if bucket is None:
            shortest = min(b.num_frames for b in buckets)
            raise BadSampleError(
                TOO_SHORT,
                f"{source}: {info.num_frames} frames at {info.fps:g} fps fill no bucket at {fps:g} fps "
                f"(the shortest needs {shortest})",
            )
        if verify:
            try:
                read_video(path, ClipSampling(fps=fps, num_frames=bucket.num_frames))
            except _decode_errors() as error:
                raise BadSampleError(CORRUPT_VIDEO, f"{source}: {error}") from None
    return VideoCaptionSample(source, record.caption, video, info, bucket)


def _decode_errors() -> tuple[type[BaseException], ...]:
    import av

    return (ValueError, OSError, av.FFmpegError)


class VideoCaptionDataset(Dataset):
    """Scanned video-caption samples, decoded on access: ``{"video": float [3, F, H, W] in [-1, 1], "caption"}``.

    Args:
        samples: from :func:`scan_video_captions`.
        fps: the frame rate frames are sampled at.
    """

    def __init__(self, samples: Sequence[VideoCaptionSample], *, fps: float) -> None:
        self.samples = list(samples)
        self.fps = fps
        self._frames = VideoFrames("pyav")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.samples[index]
        sampling = ClipSampling(fps=self.fps, num_frames=sample.bucket.num_frames)
        try:
            with sample.video.local_file() as path:
                # a shard's temporary file is decoded with a decoder of its own, closed on return
                frames = self._frames if sample.video.path is not None else None
                frames_THWC = read_video(path, sampling, frames)
        except (ValueError, OSError) as error:
            raise ValueError(
                f"{sample.source}: the video cannot be decoded ({error}); scan with verify_frames "
                "to find such videos at setup"
            ) from None
        return {"video": resize_crop(frames_THWC, sample.bucket), "caption": sample.caption}

    def group(self, index: int) -> VideoBucket:
        """The bucket of sample ``index``: a batch holds samples of one group."""
        return self.samples[index].bucket

    def sample_id(self, index: int) -> str:
        """The name of sample ``index`` (``file:line`` or ``shard.tar:key``)."""
        return self.samples[index].source

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the dataset's samples without decoding them: each sample's name, caption, video size
        and header, bucket, and the sampling rate (a video rewritten with the same size is not noticed)."""
        digest = hashlib.sha256()
        for s in self.samples:
            file = s.video.path if s.video.path is not None else Path(s.video.member.shard)  # type: ignore[union-attr]
            size = file.stat().st_size
            digest.update(
                json.dumps([s.source, s.caption, str(size), s.info.__dict__, str(s.bucket)]).encode()
            )
        return {
            "kind": "video_caption",
            "fps": self.fps,
            "num_samples": len(self.samples),
            "sha256": digest.hexdigest(),
        }


def video_caption_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch of one bucket: ``video [B, 3, F, H, W]`` and the ``caption`` list."""
    shapes = {tuple(s["video"].shape) for s in samples}
    if len(shapes) != 1:
        raise ValueError(f"a batch mixes video shapes {sorted(shapes)}: batch with GroupedStepLoader")
    return {"video": torch.stack([s["video"] for s in samples]), "caption": [s["caption"] for s in samples]}

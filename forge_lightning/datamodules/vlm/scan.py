"""The pre-scan of vision-language data at setup: every record is parsed, its images' headers read and verified
(no full decode), its videos' headers probed and its text encoded, so that bad input is found before training, not
in the middle of it.

Each bad record is named by ``file:line`` (``file[index]`` in a ``.json`` list, ``shard.tar:key`` in a shard) and
a reason; it is skipped and
counted, or raised as a :class:`BadSampleError`. Each kept sample keeps its tokens, image sizes, video headers,
training length and patch count (what packing and load balancing need).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar, cast

import numpy as np

from forge_lightning.datamodules.chat import ChatFormatError, Conversation
from forge_lightning.datamodules.json_records import MalformedRecord
from forge_lightning.datamodules.vlm.encoding import VLMEncoder
from forge_lightning.datamodules.vlm.records import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    ImageSource,
    VLMRecord,
    parse_vlm_record,
)
from forge_lightning.datamodules.vlm.sources import RawRecord, open_sources
from forge_lightning.datamodules.vlm.video import VideoFile, probe_video, read_video
from forge_lightning.datamodules.vlm.vision_inputs import VideoInputs, image_num_patches

ON_BAD_SAMPLE = ("skip", "error")
_Sample = TypeVar("_Sample")

# Reasons a record is left out, in the order the summary lists them.
MALFORMED = "malformed record"
NO_ASSISTANT = "no assistant turn"
IMAGE_COUNT = "image count mismatch"
UNSUPPORTED_IMAGE = "unsupported image"
MISSING_IMAGE = "missing image"
CORRUPT_IMAGE = "corrupt image"
VIDEO_COUNT = "video count mismatch"
UNSUPPORTED_VIDEO = "unsupported video"
MISSING_VIDEO = "missing video"
CORRUPT_VIDEO = "corrupt video"
TOO_LONG = "too long"
NOTHING_TRAINED = "nothing to train"
REASONS = (
    MALFORMED,
    NO_ASSISTANT,
    IMAGE_COUNT,
    UNSUPPORTED_IMAGE,
    MISSING_IMAGE,
    CORRUPT_IMAGE,
    VIDEO_COUNT,
    UNSUPPORTED_VIDEO,
    MISSING_VIDEO,
    CORRUPT_VIDEO,
    TOO_LONG,
    NOTHING_TRAINED,
)


class BadSampleError(ValueError):
    """A record that cannot become a training sample; the message names its ``file:line`` and the reason.

    Args:
        reason: one of :data:`REASONS`.
        message: ``"<source>: <what is wrong>"``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class VLMSample:
    """A record that passed the scan.

    Args:
        source: ``file:line`` (or ``file[index]``).
        conversation: its messages (images as placeholders in the text).
        tokens: int32 ids, vision tokens expanded.
        trainable: per-token loss flags.
        images: where its images are, in order.
        sizes: ``(width, height)`` of each image.
        num_patches: vision-encoder patches of all its images and videos.
        videos: its videos with their headers, in order.
    """

    source: str
    conversation: Conversation
    tokens: np.ndarray
    trainable: np.ndarray
    images: list[ImageSource]
    sizes: list[tuple[int, int]]
    num_patches: int
    videos: list[VideoFile] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Training positions (tokens minus one: the last token is only a target)."""
        return len(self.tokens) - 1


def scan_or_skip(
    scan: Callable[[], _Sample], on_bad_sample: str, skipped: dict[str, list[str]]
) -> _Sample | None:
    """``scan()``'s sample; on a :class:`BadSampleError` either raised again (``on_bad_sample`` ``error``) or its
    message recorded in ``skipped`` under its reason and ``None`` returned (``skip``)."""
    try:
        return scan()
    except BadSampleError as error:
        if on_bad_sample == "error":
            raise
        skipped.setdefault(error.reason, []).append(str(error))
        return None


@dataclass
class ScanReport:
    """What the scan kept and why it left records out.

    Args:
        files: the data files scanned.
        records: records read.
        kept: records kept as samples.
        tokens: training positions of the kept samples, vision tokens included.
        images: images of the kept samples.
        videos: videos of the kept samples.
        skipped: the messages of the left-out records, by reason (one of :data:`REASONS`).
    """

    files: list[str]
    records: int = 0
    kept: int = 0
    tokens: int = 0
    images: int = 0
    videos: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the log, naming the first record of each reason."""
        line = (
            f"VLM data {', '.join(self.files)}: {self.kept} of {self.records} samples kept "
            f"({self.tokens} tokens, {self.images} images{f', {self.videos} videos' if self.videos else ''})"
        )
        reasons = [r for r in REASONS if self.skipped.get(r)]
        if reasons:
            line += "; skipped " + ", ".join(
                f"{len(self.skipped[r])} {r} ({self.skipped[r][0]})" for r in reasons
            )
        return line


def scan_files(
    files: Sequence[str | Path],
    encoder: VLMEncoder,
    *,
    seq_length: int,
    image_root: str | Path | None = None,
    on_bad_sample: str = "skip",
    verify_pixels: bool = False,
    split: str = "train",
) -> tuple[list[VLMSample], ScanReport]:
    """Scan data files into the samples fit to train on.

    Args:
        files: ``.json`` / ``.jsonl`` files of records, WebDataset shards (paths or brace patterns) or
            energon-prepared directories (see ``sources.py``).
        encoder: renders and tokenizes a record with its vision tokens.
        seq_length: most training positions per sample; longer samples are bad (cutting one would cut images).
        image_root: the directory relative image paths start from (default: each data file's directory).
        on_bad_sample: ``skip`` (count and leave out) or ``error`` (raise the first).
        verify_pixels: also decode every image (slow; finds a truncated JPEG, which ``verify()`` cannot).
        split: the split part of an Energon dataset to read.

    Raises:
        BadSampleError: the first bad record, with ``on_bad_sample="error"``.
    """
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise ValueError(f"on_bad_sample ({on_bad_sample!r}) must be one of {', '.join(ON_BAD_SAMPLE)}")
    sources = open_sources(files, image_root, split)
    report = ScanReport([s.name for s in sources])
    samples = []
    for records in sources:
        for raw in records.records():
            report.records += 1
            sample = scan_or_skip(
                partial(_scan_record, raw, encoder, seq_length, verify_pixels), on_bad_sample, report.skipped
            )
            if sample is None:
                continue
            samples.append(sample)
            report.kept += 1
            report.tokens += sample.length
            report.images += len(sample.images)
            report.videos += len(sample.videos)
    return samples, report


def _scan_record(raw: RawRecord, encoder: VLMEncoder, seq_length: int, verify_pixels: bool) -> VLMSample:
    source, record = raw.source, raw.record
    if isinstance(record, MalformedRecord):
        raise BadSampleError(MALFORMED, str(record))
    try:
        parsed = parse_vlm_record(record, source)
    except ChatFormatError as error:
        raise BadSampleError(MALFORMED, str(error)) from None
    conversation = parsed.conversation
    if not conversation.assistant_turns:
        raise BadSampleError(NO_ASSISTANT, f"{source}: the conversation has no assistant turn to train on")
    _check_counts(parsed, encoder, source)
    images = [_resolve(source, ref, raw) for ref in parsed.image_refs]
    sizes = [_probe(source, image, verify_pixels) for image in images]
    try:
        num_patches = image_num_patches(encoder.vision, sizes)
    except ValueError as error:  # e.g. an aspect ratio smart_resize refuses
        raise BadSampleError(UNSUPPORTED_IMAGE, f"{source}: {error}") from None
    videos = [_scan_video(source, ref, raw, encoder, verify_pixels) for ref in parsed.video_refs]
    if videos:
        num_patches += sum(cast(VideoInputs, encoder.vision).video_num_patches(v.info) for v in videos)
    try:
        encoded = encoder.encode(conversation, sizes, [v.info for v in videos])
    except ValueError as error:  # the template cannot render it (the message names the source)
        raise BadSampleError(MALFORMED, str(error)) from None
    length = len(encoded.tokens) - 1
    if length > seq_length:
        raise BadSampleError(
            TOO_LONG, f"{source}: {length} tokens after image / video expansion > seq_length {seq_length}"
        )
    if not encoded.trainable[1:].any():  # the first token is never a target
        raise BadSampleError(NOTHING_TRAINED, f"{source}: no token left to train on (empty answers?)")
    images = [image.lazy() for image in images]
    return VLMSample(
        source, conversation, encoded.tokens, encoded.trainable, images, sizes, num_patches, videos
    )


def _check_counts(parsed: VLMRecord, encoder: VLMEncoder, source: str) -> None:
    """Placeholders against references, per kind; no vision token written as text; videos only where taken."""
    vision = encoder.vision
    if parsed.video_refs or parsed.count(VIDEO_PLACEHOLDER):
        if vision.video_token is None:
            raise BadSampleError(
                UNSUPPORTED_VIDEO, f"{source}: the record has videos but this processor takes images only"
            )
        if vision.video_token_id is None:
            raise BadSampleError(
                UNSUPPORTED_VIDEO,
                f"{source}: the record has videos but the tokenizer lacks the special token {vision.video_token} "
                "that videos are written with: use the tokenizer of the model being trained",
            )
    kinds = [
        (IMAGE_COUNT, "image", IMAGE_PLACEHOLDER, parsed.image_refs, vision.image_token),
        (VIDEO_COUNT, "video", VIDEO_PLACEHOLDER, parsed.video_refs, vision.video_token),
    ]
    for reason, kind, placeholder, refs, token in kinds:
        if parsed.count(placeholder) != len(refs):
            raise BadSampleError(
                reason,
                f"{source}: {parsed.count(placeholder)} {placeholder} placeholder(s) in the text but "
                f"{len(refs)} {kind}(s)",
            )
        texts = (str(m.get("content") or "").replace(placeholder, "") for m in parsed.conversation.messages)
        if token is not None and any(token in text for text in texts):
            raise BadSampleError(
                reason,
                f"{source}: the text holds the {kind} token {token!r} itself; mark {kind}s with {placeholder}",
            )


def _scan_video(source: str, ref: str, raw: RawRecord, encoder: VLMEncoder, verify_pixels: bool) -> VideoFile:
    """The video ``ref`` of a record with its header, checked to give the sampled frames."""
    try:
        path = raw.resolve(ref).path
    except FileNotFoundError as error:
        raise BadSampleError(MISSING_VIDEO, f"{source}: {error}") from None
    except ValueError as error:
        raise BadSampleError(UNSUPPORTED_VIDEO, f"{source}: {error}") from None
    if path is None:
        raise BadSampleError(
            UNSUPPORTED_VIDEO,
            f"{source}: {ref}: videos are decoded from files; give a path (a shard member or data: URL is not one)",
        )
    try:
        info = probe_video(path)
    except FileNotFoundError as error:
        raise BadSampleError(MISSING_VIDEO, f"{source}: {ref}: {error}") from None
    except ValueError as error:
        raise BadSampleError(CORRUPT_VIDEO, f"{source}: {ref}: {error}") from None
    vision = cast(VideoInputs, encoder.vision)
    try:
        vision.video_grid(info)
    except ValueError as error:  # too few frames for the sampling, or an aspect ratio smart_resize refuses
        raise BadSampleError(UNSUPPORTED_VIDEO, f"{source}: {ref}: {error}") from None
    if verify_pixels:
        try:
            read_video(path, vision.sampling)
        except Exception as error:  # FFmpeg's errors and missing frames alike
            raise BadSampleError(CORRUPT_VIDEO, f"{source}: {ref} cannot be decoded ({error})") from None
    return VideoFile(ref, path, info)


def _resolve(source: str, ref: str, raw: RawRecord) -> ImageSource:
    try:
        return raw.resolve(ref)
    except FileNotFoundError as error:
        raise BadSampleError(MISSING_IMAGE, f"{source}: {error}") from None
    except ValueError as error:
        raise BadSampleError(UNSUPPORTED_IMAGE, f"{source}: {error}") from None


def _probe(source: str, image: ImageSource, verify_pixels: bool) -> tuple[int, int]:
    try:
        size = image.size()
        if verify_pixels:
            image.load()
        return size
    except FileNotFoundError as error:
        raise BadSampleError(MISSING_IMAGE, f"{source}: {error}") from None
    except (
        Exception
    ) as error:  # Pillow raises many kinds (OSError, SyntaxError, struct.error ...) for bad files
        raise BadSampleError(CORRUPT_IMAGE, f"{source}: {image.ref} cannot be read ({error})") from None

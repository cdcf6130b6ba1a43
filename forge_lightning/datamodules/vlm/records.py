"""Vision-language records: image / video + text conversations in the formats users already have, read from
``.json`` (a list) or ``.jsonl`` files.

Every format becomes a chat :class:`~forge_lightning.datamodules.chat.Conversation` whose text marks each image
with :data:`IMAGE_PLACEHOLDER` and each video with :data:`VIDEO_PLACEHOLDER`, plus the record's images and videos,
each in placeholder order:

* LLaVA: ``{"image": "a.jpg" | [...], "conversations": [{"from": "human", "value": "<image>\\n..."}, ...]}``, or
  ``"video": "a.mp4" | [...]`` with ``<video>`` in the text;
* ShareGPT with images: ``{"images": [...], "videos": [...], "messages": [{"role": "user", "content":
  "<image>..."}, ...]}``;
* OpenAI content parts: ``{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
  {"type": "video", "video": "a.mp4"}, {"type": "text", "text": "..."}]}, ...]}``, or ``image_url`` / ``video_url``
  parts (``{"type": "image_url", "image_url": {"url": ...}}``); a part without a reference (``{"type": "image"}``)
  takes the next item of the top-level ``images`` (``videos``) list.

An image reference is a path (relative to the image root), a ``file://`` URL or a ``data:image/...;base64,`` URL;
in a shard it is the name of a member of the same sample (``0.jpg``; see ``sources.py``). A video reference is a
path or a ``file://`` URL (videos are decoded from files).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from PIL import Image, ImageOps

from forge_lightning.datamodules.chat import ChatFormatError, Conversation, parse_record
from forge_lightning.datamodules.vlm.image_processor import to_rgb

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a record's text."""

VIDEO_PLACEHOLDER = "<video>"
"""Where a video goes in a record's text."""

SUFFIXES = (".json", ".jsonl")
# Content part types by the modality they carry.
_MEDIA_PARTS = {"image": "images", "image_url": "images", "video": "videos", "video_url": "videos"}
_PLACEHOLDERS = {"images": IMAGE_PLACEHOLDER, "videos": VIDEO_PLACEHOLDER}
# EXIF orientations that rotate by 90 or 270 degrees (transposing swaps width and height).
_TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)


@runtime_checkable
class Member(Protocol):
    """A file inside a container (a tar shard, an Energon dataset), read when asked for; it must pickle, since
    DataLoader workers read it."""

    def read(self) -> bytes:
        """The file's bytes."""
        ...


@dataclass(frozen=True)
class ImageSource:
    """Where one image of a record is: a file, the bytes of a ``data:`` URL, or a member of a shard.

    Args:
        ref: the reference as the record writes it (shortened for ``data:`` URLs), for messages.
        path: the resolved file, or ``None``.
        data: the decoded bytes of a ``data:`` URL, or ``None``.
        member: the shard member holding the image, or ``None``; ``data`` may hold its bytes while a scan reads
            them (:meth:`lazy` drops them).
    """

    ref: str
    path: Path | None = None
    data: bytes | None = None
    member: Member | None = None

    def open(self) -> Image.Image:
        """The image, lazily opened (Pillow reads the header only until pixels are asked for)."""
        if self.path is not None:
            return Image.open(self.path)
        data = self.data if self.data is not None or self.member is None else self.member.read()
        return Image.open(io.BytesIO(data or b""))

    def lazy(self) -> ImageSource:
        """This image without the bytes of a shard member (read again from the shard when decoded)."""
        return replace(self, data=None) if self.member is not None else self

    def size(self) -> tuple[int, int]:
        """``(width, height)`` after the EXIF orientation, from the header; ``verify()`` checks the file too.

        Raises:
            FileNotFoundError: the file does not exist.
            Exception: whatever Pillow raises for an unreadable or corrupt image.
        """
        if self.path is not None and not self.path.is_file():
            raise FileNotFoundError(f"{self.ref} not found at {self.path}")
        with self.open() as image:
            image.verify()  # must come right after open; the image is unusable after it
        with self.open() as image:
            width, height = image.size
            transposed = image.getexif().get(0x0112) in _TRANSPOSED_ORIENTATIONS
        return (height, width) if transposed else (width, height)

    def load(self) -> Image.Image:
        """The decoded image in RGB, turned upright by its EXIF orientation (as transformers' ``load_image``)."""
        with self.open() as image:
            return to_rgb(ImageOps.exif_transpose(image))


@dataclass
class VLMRecord:
    """A conversation whose text marks images with :data:`IMAGE_PLACEHOLDER` and videos with
    :data:`VIDEO_PLACEHOLDER`, and the references of its images and videos.

    Args:
        conversation: the messages (``source`` names the file and line).
        image_refs: the image references in placeholder order, as the record writes them.
        video_refs: the video references in placeholder order.
    """

    conversation: Conversation
    image_refs: list[str]
    video_refs: list[str] = field(default_factory=list)

    def count(self, placeholder: str) -> int:
        """Occurrences of ``placeholder`` in the text of all messages."""
        return sum(str(m.get("content") or "").count(placeholder) for m in self.conversation.messages)

    @property
    def num_placeholders(self) -> int:
        """:data:`IMAGE_PLACEHOLDER` occurrences in the text of all messages."""
        return self.count(IMAGE_PLACEHOLDER)


def parse_vlm_record(record: Any, source: str = "") -> VLMRecord:
    """Read one record in any of the module's formats (text-only records included).

    Raises:
        ChatFormatError: the record is not a conversation, or its images are not references (naming ``source``).
    """
    try:
        if not isinstance(record, dict):
            raise TypeError(f"a record must be a JSON object, got {type(record).__name__}")
        top = {kind: _top_level(record, kind) for kind in _PLACEHOLDERS}
        record, part_refs = _content_parts_to_text(record)
        for kind in _PLACEHOLDERS:
            if top[kind] and part_refs[kind]:
                raise ValueError(
                    f"the record names {kind} both in content parts and in a top-level list; use one"
                )
    except (TypeError, ValueError) as error:
        raise ChatFormatError(f"{source}: {error}" if source else str(error)) from None
    refs = {kind: part_refs[kind] or top[kind] for kind in _PLACEHOLDERS}
    return VLMRecord(parse_record(record, source=source), refs["images"], refs["videos"])


def resolve_image(ref: str, root: Path) -> ImageSource:
    """Where the image ``ref`` is: a path relative to ``root`` (or absolute), ``file://`` or ``data:`` URL.

    Raises:
        ValueError: a remote URL (``http``, ``s3`` ...) or a ``data:`` URL that is not base64 image data.
    """
    if ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        if not (header.startswith("data:image/") and header.endswith(";base64")):
            raise ValueError(f"{ref[:40]}...: only base64 data:image/... URLs are supported")
        try:
            return ImageSource(f"{header},...", data=base64.b64decode(payload, validate=True))
        except binascii.Error as error:
            raise ValueError(f"{header},...: invalid base64 ({error})") from None
    if ref.startswith("file://"):
        url = urlparse(ref)
        return ImageSource(ref, path=root / unquote(url.netloc + url.path))
    if "://" in ref:
        scheme = ref.partition("://")[0]
        raise ValueError(
            f"{ref}: {scheme}:// images are not fetched; download them and refer to the local files"
        )
    return ImageSource(ref, path=root / ref)


def _top_level(record: dict[str, Any], kind: str) -> list[str]:
    """The references of the top-level ``kind`` (``images`` / ``videos``) list, or of its singular key."""
    refs = record.get(kind, record.get(kind.removesuffix("s")))
    if refs in (None, "", []):
        return []
    refs = [refs] if isinstance(refs, str) else refs
    if not isinstance(refs, list):
        raise TypeError(f"{kind} must be a path or a list of paths, got {type(refs).__name__}")
    for k, ref in enumerate(refs):
        if not isinstance(ref, str) or not ref:
            raise TypeError(f"{kind}[{k}] must be a non-empty path string, got {ref!r}")
    return refs


def _content_parts_to_text(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The record with each message's content parts joined into text (images and videos as placeholders), and the
    references the parts carry, by kind (``images``, ``videos``)."""
    refs: dict[str, list[str]] = {kind: [] for kind in _PLACEHOLDERS}
    messages = record.get("messages")
    if not isinstance(messages, list):
        return record, refs
    out = []
    for k, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            message = {**message, "content": "".join(_part_text(p, f"messages[{k}]", refs) for p in content)}
        out.append(message)
    return {**record, "messages": out}, refs


def _part_text(part: Any, where: str, refs: dict[str, list[str]]) -> str:
    if not isinstance(part, dict) or "type" not in part:
        raise TypeError(f"{where}: a content part must be an object with a 'type'")
    if part["type"] == "text":
        if not isinstance(part.get("text"), str):
            raise TypeError(f"{where}: a text part needs a 'text' string")
        return part["text"]
    if part["type"] not in _MEDIA_PARTS:
        raise ValueError(
            f"{where}: unsupported content part type {part['type']!r}; use text, {', '.join(_MEDIA_PARTS)}"
        )
    kind = _MEDIA_PARTS[part["type"]]
    ref = part.get(part["type"])
    if isinstance(ref, dict):
        ref = ref.get("url")
    if ref is not None:
        if not isinstance(ref, str) or not ref:
            raise TypeError(
                f"{where}: a {part['type']} part's reference must be a non-empty string (a video given as a list "
                "of frame images is not supported: write it as a video file)"
            )
        refs[kind].append(ref)
    return _PLACEHOLDERS[kind]

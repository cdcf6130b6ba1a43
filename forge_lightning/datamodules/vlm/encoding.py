"""Vision-language samples as tokens: the chat template's rendering with each image (video) expanded to its vision
tokens::

    record text "<image>\\nWhat colour?"   ─ placeholder → image token ─ ChatEncoder (template, loss mask)
      ─ tokens  [... <|im_start|> user \\n <|image_pad|> \\n What colour ? ...]
      ─ expand  [... <|im_start|> user \\n <|vision_start|> <|image_pad|> x N <|vision_end|> \\n What ...]

The image token is a special token, so the text around it tokenizes the same with one or with N of them; the
expanded vision tokens are never trained. A ``<video>`` placeholder becomes the vision inputs' text of the video
(``<|video_pad|>``; for Qwen3-VL a timestamp and ``<|video_pad|>`` per temporal patch, so the timestamp text is
tokenized in its context, as transformers' processor tokenizes it) and each video token expands likewise, to the
merged patches of its sampled frames; images and videos are each taken in their own order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from forge_lightning.datamodules.chat import ChatEncoder, ChatFormatError, Conversation
from forge_lightning.datamodules.vlm.records import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from forge_lightning.datamodules.vlm.video import VideoInfo
from forge_lightning.datamodules.vlm.vision_inputs import VideoInputs, VisionInputs, image_placeholder_ids


@dataclass
class EncodedConversation:
    """Token ids of a rendered conversation with its vision tokens expanded, and which ids are trained.

    Args:
        tokens: int32 ids ``[n]``.
        trainable: ``True`` where the token is a target of the loss ``[n]`` (never on vision tokens).
    """

    tokens: np.ndarray
    trainable: np.ndarray


class VLMEncoder:
    """Renders a conversation with a :class:`ChatEncoder` and expands each image and video into the vision tokens
    of a :class:`VisionInputs`.

    Args:
        chat: renders and tokenizes the text with its loss mask.
        vision: the image (and video) tokens and pixel inputs.
    """

    def __init__(self, chat: ChatEncoder, vision: VisionInputs) -> None:
        self.chat = chat
        self.vision = vision

    def with_vision_tokens(
        self, conversation: Conversation, videos: Sequence[VideoInfo] = ()
    ) -> Conversation:
        """``conversation`` with each :data:`IMAGE_PLACEHOLDER` written as the vision inputs' image token and each
        :data:`VIDEO_PLACEHOLDER` as the text of the next of ``videos`` (their video token where the videos run out;
        kept as it is where they take no videos)."""
        video = cast(VideoInputs, self.vision)
        texts = iter([] if video.video_token is None else [video.video_text(v) for v in videos])
        fallback = video.video_token or VIDEO_PLACEHOLDER

        def written(text: str) -> str:
            first, *rest = text.replace(IMAGE_PLACEHOLDER, self.vision.image_token).split(VIDEO_PLACEHOLDER)
            return first + "".join(next(texts, fallback) + part for part in rest)

        messages = [
            {**m, "content": written(m["content"])} if isinstance(m.get("content"), str) else m
            for m in conversation.messages
        ]
        return Conversation(messages, conversation.tools, conversation.source)

    def encode(
        self,
        conversation: Conversation,
        sizes: Sequence[tuple[int, int]],
        videos: Sequence[VideoInfo] = (),
    ) -> EncodedConversation:
        """Tokens and loss mask of ``conversation`` (placeholders in its text) whose images have ``sizes``
        ``(width, height)`` and whose videos' headers say ``videos``, each in order.

        Raises:
            ChatFormatError: the rendered text holds another number of image (video) tokens than there are images
                (videos).
        """
        encoded = self.chat.encode(self.with_vision_tokens(conversation, videos))
        tokens, trainable = self._expand(
            encoded.tokens, encoded.trainable, sizes, videos, conversation.source
        )
        return EncodedConversation(tokens, trainable)

    def prompt_and_answer(
        self,
        conversation: Conversation,
        sizes: Sequence[tuple[int, int]],
        videos: Sequence[VideoInfo] = (),
    ) -> tuple[list[int], str, int, int]:
        """The prompt ids before the last assistant turn (with the generation prompt, images and videos
        expanded), that turn's text, and how many of the images and of the videos (the first ones) the prompt
        holds."""
        prompt, answer = self.chat.prompt_and_answer(self.with_vision_tokens(conversation, videos))
        prompt_ids = np.asarray(prompt, np.int64)
        num_images = int((prompt_ids == self.vision.image_token_id).sum())
        num_videos = 0
        if self.vision.video_token_id is not None and videos:
            # the prompt holds whole videos: count those whose video tokens all fall in it
            runs = int((prompt_ids == self.vision.video_token_id).sum())
            per_video = [len(cast(VideoInputs, self.vision).video_placeholders(v)) for v in videos]
            num_videos = int(np.searchsorted(np.cumsum(per_video), runs, side="right"))
        tokens, _ = self._expand(
            prompt_ids,
            np.zeros(len(prompt_ids), bool),
            sizes[:num_images],
            videos[:num_videos],
            conversation.source,
        )
        return tokens.tolist(), answer, num_images, num_videos

    def _expand(
        self,
        tokens: np.ndarray,
        trainable: np.ndarray,
        sizes: Sequence[tuple[int, int]],
        videos: Sequence[VideoInfo],
        source: str,
    ) -> tuple[np.ndarray, np.ndarray]:
        replacements = self._replacements(tokens, sizes, videos, source)
        pieces_ids, pieces_trained, start = [], [], 0
        for position in sorted(replacements):
            vision_ids = np.asarray(replacements[position], np.int64)
            pieces_ids += [tokens[start:position], vision_ids]
            pieces_trained += [trainable[start:position], np.zeros(len(vision_ids), bool)]
            start = position + 1
        pieces_ids.append(tokens[start:])
        pieces_trained.append(trainable[start:])
        return np.concatenate(pieces_ids).astype(np.int32), np.concatenate(pieces_trained)

    def _replacements(
        self, tokens: np.ndarray, sizes: Sequence[tuple[int, int]], videos: Sequence[VideoInfo], source: str
    ) -> dict[int, list[int]]:
        """The vision ids that replace the image or video token at each of its positions in ``tokens``."""
        vision = self.vision
        images = image_placeholder_ids(vision, sizes)  # an image's tokens may depend on the sample's others
        kinds = [("image", vision.image_token, vision.image_token_id, len(sizes), images)]
        if vision.video_token_id is not None:
            runs = [run for v in videos for run in cast(VideoInputs, vision).video_placeholders(v)]
            kinds.append(("video", vision.video_token, vision.video_token_id, len(videos), runs))
        elif videos:
            raise ChatFormatError(f"{source}: the record has video(s) but the vision inputs take none")
        out: dict[int, list[int]] = {}
        for kind, token, token_id, count, items in kinds:
            at = np.flatnonzero(tokens == token_id)
            if len(at) != len(items):
                tokens_per_item = "" if count == len(items) else f", written with {len(items)} such tokens"
                raise ChatFormatError(
                    f"{source}: the rendered text holds {len(at)} {kind} token(s) {token!r} but the record has "
                    f"{count} {kind}(s){tokens_per_item}; the text must not contain that token itself"
                )
            out |= {int(position): ids for position, ids in zip(at, items)}
        return out

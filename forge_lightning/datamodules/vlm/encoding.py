"""Vision-language samples as tokens: the chat template's rendering with each image expanded to its vision tokens::

    record text "<image>\\nWhat colour?"   ─ placeholder → image token ─ ChatEncoder (template, loss mask)
      ─ tokens  [... <|im_start|> user \\n <|image_pad|> \\n What colour ? ...]
      ─ expand  [... <|im_start|> user \\n <|vision_start|> <|image_pad|> x N <|vision_end|> \\n What ...]

The image token is a special token, so the text around it tokenizes the same with one or with N of them; the
expanded vision tokens are never trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from forge_lightning.datamodules.chat import ChatEncoder, ChatFormatError, Conversation
from forge_lightning.datamodules.vlm.records import IMAGE_PLACEHOLDER
from forge_lightning.datamodules.vlm.vision_inputs import VisionInputs


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
    """Renders a conversation with a :class:`ChatEncoder` and expands each image into the vision tokens of a
    :class:`VisionInputs`.

    Args:
        chat: renders and tokenizes the text with its loss mask.
        vision: the image tokens and pixel inputs.
    """

    def __init__(self, chat: ChatEncoder, vision: VisionInputs) -> None:
        self.chat = chat
        self.vision = vision

    def with_image_tokens(self, conversation: Conversation) -> Conversation:
        """``conversation`` with each :data:`IMAGE_PLACEHOLDER` written as the vision inputs' image token."""
        messages = [
            {**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, self.vision.image_token)}
            if isinstance(m.get("content"), str)
            else m
            for m in conversation.messages
        ]
        return Conversation(messages, conversation.tools, conversation.source)

    def encode(self, conversation: Conversation, sizes: Sequence[tuple[int, int]]) -> EncodedConversation:
        """Tokens and loss mask of ``conversation`` (placeholders in its text) whose images have ``sizes``
        ``(width, height)``, in order.

        Raises:
            ChatFormatError: the rendered text holds another number of image tokens than there are images.
        """
        encoded = self.chat.encode(self.with_image_tokens(conversation))
        tokens, trainable = self._expand(encoded.tokens, encoded.trainable, sizes, conversation.source)
        return EncodedConversation(tokens, trainable)

    def prompt_and_answer(
        self, conversation: Conversation, sizes: Sequence[tuple[int, int]]
    ) -> tuple[list[int], str, int]:
        """The prompt ids before the last assistant turn (with the generation prompt, images expanded), that turn's
        text, and how many of the images (the first ones) the prompt holds."""
        prompt, answer = self.chat.prompt_and_answer(self.with_image_tokens(conversation))
        prompt_ids = np.asarray(prompt, np.int64)
        count = int((prompt_ids == self.vision.image_token_id).sum())
        tokens, _ = self._expand(
            prompt_ids, np.zeros(len(prompt_ids), bool), sizes[:count], conversation.source
        )
        return tokens.tolist(), answer, count

    def _expand(
        self, tokens: np.ndarray, trainable: np.ndarray, sizes: Sequence[tuple[int, int]], source: str
    ) -> tuple[np.ndarray, np.ndarray]:
        at = np.flatnonzero(tokens == self.vision.image_token_id)
        if len(at) != len(sizes):
            raise ChatFormatError(
                f"{source}: the rendered text holds {len(at)} image token(s) {self.vision.image_token!r} but the "
                f"record has {len(sizes)} image(s); the text must not contain that token itself"
            )
        pieces_ids, pieces_trained, start = [], [], 0
        for position, size in zip(at.tolist(), sizes):
            vision_ids = np.asarray(self.vision.placeholder_ids(size), np.int64)
            pieces_ids += [tokens[start:position], vision_ids]
            pieces_trained += [trainable[start:position], np.zeros(len(vision_ids), bool)]
            start = position + 1
        pieces_ids.append(tokens[start:])
        pieces_trained.append(trainable[start:])
        return np.concatenate(pieces_ids).astype(np.int32), np.concatenate(pieces_trained)

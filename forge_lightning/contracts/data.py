"""What a module may read from its datamodule and from the batches it yields.

Training batches of forge's datamodules carry :data:`STEP_TOKENS` (see ``datamodules/loader.py``'s
``StepLoader``): the trainable tokens (or items) of the micro-batch's whole optimizer step on its data rank, counted
by reading the step ahead. The module's loss divides by their sum over the data-parallel ranks (the one batch rule;
``forge_lightning.modules.objective.GlobalBatchLoss``). A text datamodule also describes its tokenizer and sequence
length (:class:`TextData`), which a module checks against its own config at setup.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

STEP_TOKENS = "step_tokens"
"""Batch key: trainable items of the micro-batch's optimizer step on this data rank (a 0-d integer tensor)."""


@runtime_checkable
class TextData(Protocol):
    """A datamodule of token sequences."""

    seq_length: int | None
    """Tokens per sample (``None``: variable)."""

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (``encode`` / ``decode``, ``eos_token_id``; ``save_pretrained`` for exports)."""
        ...

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size."""
        ...


@runtime_checkable
class VisionTextData(TextData, Protocol):
    """A datamodule of token sequences with images: its tokenizer's ids of the image tokens, which a
    vision-language module's config must agree with."""

    @property
    def special_token_ids(self) -> dict[str, int]:
        """The image tokens' ids by the model config's field name (``image_token_id``, ...)."""
        ...

    @property
    def vision_settings(self) -> dict[str, float | None]:
        """Other values the data was prepared with that the model config must agree with, by its field name
        (``tokens_per_second``: the video positions of packed rows; ``None`` where the data's videos have no such
        value, so the model must not use one)."""
        ...

"""Pi0.5's text prompt: the task and the discretised robot state, tokenised with PaliGemma's tokenizer.

Pi0.5 feeds the state to the backbone as text rather than through a projection: each normalised state value
(in ``[-1, 1]``) is put in one of ``num_bins`` equal bins and written as its bin index::

    "Task: pick up the cup, State: 12 255 128 0;\\nAction: "

Values below -1 get bin -1 and values from ``1 - 2 / num_bins`` upwards the last bin, as in lerobot and openpi.
The prompt is tokenised with a beginning-of-sequence token, truncated to a maximum length and right-padded to
it (lerobot and openpi) or to the batch's longest prompt, rounded up to a multiple (the default here).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from forge_lightning.modules.embodied.config import PROMPT_PADDINGS


def discretize_state(state_BS: Tensor, num_bins: int = 256) -> np.ndarray:
    """Bin indices ``[B, S]`` (int) of normalised states: ``i`` for ``-1 + 2 i / num_bins <= x < -1 + 2 (i+1) / num_bins``."""
    edges = np.linspace(-1.0, 1.0, num_bins + 1)[:-1]
    return np.digitize(state_BS.detach().float().cpu().numpy(), bins=edges) - 1


def build_prompt(task: str, state_bins: Sequence[int]) -> str:
    """The Pi0.5 prompt of one sample (underscores and newlines in the task become spaces)."""
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(str(int(b)) for b in state_bins)};\nAction: "


def build_prompts(tasks: Sequence[str], state_BS: Tensor, num_bins: int = 256) -> list[str]:
    """Prompts of a batch: tasks with their normalised states ``[B, S]``."""
    if len(tasks) != state_BS.shape[0]:
        raise ValueError(f"{len(tasks)} tasks for a batch of {state_BS.shape[0]} states")
    bins = discretize_state(state_BS, num_bins)
    return [build_prompt(task, row) for task, row in zip(tasks, bins)]


class PromptTokenizer:
    """PaliGemma's tokenizer (or any Hugging Face tokenizer) loaded from a local directory, with Pi0.5's settings.

    Args:
        path: a directory holding ``tokenizer.json`` or a SentencePiece ``tokenizer.model`` (with
            ``tokenizer_config.json``), e.g. a download of ``google/paligemma-3b-pt-224``; nothing is fetched.
        max_length: most prompt tokens (longer prompts are truncated).
        padding: ``"max_length"``: every prompt is right-padded to ``max_length``; ``"longest"``: to the batch's
            longest prompt rounded up to a multiple of ``pad_multiple`` (at most ``max_length``).
        pad_multiple: see ``padding``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_length: int,
        *,
        padding: str = "max_length",
        pad_multiple: int = 1,
    ) -> None:
        from transformers import AutoTokenizer

        if padding not in PROMPT_PADDINGS:
            raise ValueError(
                f"padding must be one of {', '.join(map(repr, PROMPT_PADDINGS))}, not {padding!r}"
            )
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple ({pad_multiple}) must be at least 1")
        self.padding, self.pad_multiple = padding, pad_multiple

        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {directory} not found")
        self.path = directory
        self.max_length = max_length
        self.backend: Any = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        if self.backend.pad_token_id is None:
            raise ValueError(f"the tokenizer in {directory} has no padding token; Pi0.5 pads prompts")

    @property
    def vocab_size(self) -> int:
        """Token ids, added tokens included."""
        return len(self.backend)

    def __call__(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Token ids ``[B, width]`` (int64) and their mask (bool, False on padding) of ``prompts``; ``width`` is
        ``max_length`` or, with ``padding="longest"``, the rounded-up longest prompt."""
        encoded = self.backend(
            list(prompts),
            max_length=self.max_length,
            truncation=True,
            padding=self.padding,
            padding_side="right",
            return_tensors="pt",
        )
        ids, mask = encoded["input_ids"].to(torch.long), encoded["attention_mask"].to(torch.bool)
        width = min(self.max_length, -(-ids.shape[1] // self.pad_multiple) * self.pad_multiple)
        if width > ids.shape[1]:
            extra = width - ids.shape[1]
            ids = torch.nn.functional.pad(ids, (0, extra), value=self.backend.pad_token_id)
            mask = torch.nn.functional.pad(mask, (0, extra), value=False)
        return ids, mask

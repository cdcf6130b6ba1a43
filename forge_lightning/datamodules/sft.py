"""Supervised fine-tuning data: chat JSONL files rendered with a chat template, loss-masked, optionally packed."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset
from typing_extensions import override

from forge_lightning.datamodules.base import TokenDataModule
from forge_lightning.datamodules.chat import FORMATS, ChatEncoder, Conversation, read_conversations
from forge_lightning.datamodules.packing import PackedDataset, pad_collate, shuffled_best_fit_pack

OVERLONG = ("truncate", "drop")


@dataclass
class SFTStats:
    """What loading chat files kept and left out."""

    records: int = 0
    samples: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    skipped_no_target: int = 0
    tokens: int = 0
    trained_tokens: int = 0

    def describe(self) -> str:
        """One line for the log."""
        return (
            f"{self.samples} samples from {self.records} records, {self.tokens} tokens "
            f"({self.trained_tokens} trained); truncated {self.truncated}, dropped {self.dropped_overlong} "
            f"too long, skipped {self.skipped_no_target} without a trained token"
        )


@dataclass
class GenerationReference:
    """A prompt to answer and the reference answer, for generation metrics such as exact match.

    ``inputs``: the prompt's other model inputs for one sample (a vision-language prompt's ``pixel_values`` and
    ``image_grid_thw``), passed to the module's ``generate`` with the prompt; ``None`` for text.
    """

    prompt_ids: list[int]
    reference: str
    source: str = ""
    inputs: dict[str, torch.Tensor] | None = None


class SFTDataset(Dataset):
    """Next-token samples of tokenized conversations: ``labels`` are the next tokens where trained, else ignored.

    Args:
        tokens: token ids of each conversation.
        trainable: per-token flags, ``True`` where the token is a target of the loss.
        ignore_index: label of tokens that are not trained.
    """

    def __init__(
        self, tokens: list[np.ndarray], trainable: list[np.ndarray], *, ignore_index: int = -100
    ) -> None:
        self.tokens = tokens
        self.trainable = trainable
        self.ignore_index = ignore_index

    def __len__(self) -> int:
        return len(self.tokens)

    def lengths(self) -> list[int]:
        """Training positions of each sample (tokens minus one)."""
        return [len(t) - 1 for t in self.tokens]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(self.tokens[index].astype(np.int64))
        trained = torch.from_numpy(self.trainable[index][1:])
        return {
            "input_ids": tokens[:-1],
            "labels": torch.where(trained, tokens[1:], torch.full_like(tokens[1:], self.ignore_index)),
        }


def load_sft_samples(
    files: Sequence[str],
    encoder: ChatEncoder,
    *,
    seq_length: int,
    format: str = "auto",
    overlong: str = "truncate",
    ignore_index: int = -100,
) -> tuple[SFTDataset, list[Conversation], SFTStats]:
    """Read, render and tokenize chat files into an :class:`SFTDataset`.

    A sample longer than ``seq_length`` training positions is cut to it (``overlong="truncate"``) or left out
    (``"drop"``); a sample with no trained token left is skipped. All are counted in the returned stats.

    Returns:
        The dataset, the conversations it holds (same order) and the counts.
    """
    if overlong not in OVERLONG:
        raise ValueError(f"overlong ({overlong!r}) must be one of {', '.join(OVERLONG)}")
    stats = SFTStats()
    tokens, trainable, kept = [], [], []
    for path in files:
        for conversation in read_conversations(path, format):
            stats.records += 1
            encoded = encoder.encode(conversation)
            ids, flags = encoded.tokens, encoded.trainable
            if len(ids) > seq_length + 1:
                if overlong == "drop":
                    stats.dropped_overlong += 1
                    continue
                ids, flags = ids[: seq_length + 1], flags[: seq_length + 1]
                stats.truncated += 1
            if not flags[1:].any():  # the first token is never a target
                stats.skipped_no_target += 1
                continue
            tokens.append(ids.astype(np.int32))
            trainable.append(flags)
            kept.append(conversation)
            stats.tokens += len(ids) - 1
            stats.trained_tokens += int(flags[1:].sum())
    stats.samples = len(tokens)
    return SFTDataset(tokens, trainable, ignore_index=ignore_index), kept, stats


class SFTDataModule(TokenDataModule):
    """Chat fine-tuning data from JSONL files (Alpaca, ShareGPT or OpenAI format), loss-masked, optionally packed.

    Conversations are rendered with the tokenizer's chat template or a built-in one, and only the tokens chosen by
    ``train_on`` are targets of the loss. With ``pack``, training samples are packed into ``seq_length``
    sequences (best fit over a buffer) whose attention stays within each sample; otherwise a micro-batch is padded
    to its longest sample. Either way the loss is the mean over the trained tokens of the whole global batch.

    Args:
        train_files: JSONL file(s) of training conversations.
        tokenizer: Hugging Face tokenizer directory.
        val_files: JSONL file(s) of validation conversations (masked loss and generation references).
        template: ``None`` for the tokenizer's own chat template, a built-in name (``chatml``, ``qwen``,
            ``llama3``) or a ``.jinja`` file.
        format: ``auto`` (per record), ``alpaca``, ``sharegpt`` or ``openai``.
        train_on: ``assistant`` (all assistant turns), ``last_assistant`` or ``all`` (the prompt too).
        seq_length: most training positions per sample, and the packed sequence length.
        overlong: ``truncate`` or ``drop`` samples longer than ``seq_length``.
        pack: pack training samples into ``seq_length`` sequences.
        pack_buffer: open sequences the online packer keeps.
        batch_size: micro-batch per data-parallel rank (packed sequences when ``pack``).
        seed: seed of the packing order and the per-epoch sample order.
        num_workers: DataLoader workers per rank.
        pin_memory: pin host memory (useful on CUDA).
    """

    def __init__(
        self,
        train_files: str | list[str],
        tokenizer: str,
        *,
        val_files: str | list[str] | None = None,
        template: str | None = None,
        format: str = "auto",
        train_on: str = "assistant",
        seq_length: int = 2048,
        overlong: str = "truncate",
        pack: bool = False,
        pack_buffer: int = 64,
        batch_size: int = 8,
        seed: int = 1234,
        num_workers: int = 2,
        pin_memory: bool = True,
    ) -> None:
        super().__init__(
            tokenizer, batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=pin_memory
        )
        if format not in FORMATS:
            raise ValueError(f"format ({format!r}) must be one of {', '.join(FORMATS)}")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong ({overlong!r}) must be one of {', '.join(OVERLONG)}")
        if seq_length < 1 or pack_buffer < 1:
            raise ValueError(f"seq_length ({seq_length}) and pack_buffer ({pack_buffer}) must be positive")
        self.train_files = [train_files] if isinstance(train_files, str) else list(train_files)
        self.val_files = [val_files] if isinstance(val_files, str) else list(val_files or [])
        self.template = template
        self.format = format
        self.train_on = train_on
        self.seq_length = seq_length
        self.overlong = overlong
        self.pack = pack
        self.pack_buffer = pack_buffer
        self.stats: dict[str, SFTStats] = {}
        self._encoder: ChatEncoder | None = None
        self._val_conversations: list[Conversation] = []

    @property
    def encoder(self) -> ChatEncoder:
        """Renders and tokenizes conversations (built on first use)."""
        if self._encoder is None:
            self._encoder = ChatEncoder(self.tokenizer.backend, self.template, train_on=self.train_on)
        return self._encoder

    @property
    def pad_id(self) -> int:
        """Token id used for padding (never trained)."""
        return self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0

    def _load(self, files: list[str], split: str) -> tuple[SFTDataset, list[Conversation]]:
        dataset, conversations, stats = load_sft_samples(
            files, self.encoder, seq_length=self.seq_length, format=self.format, overlong=self.overlong
        )
        if len(dataset) == 0:
            raise ValueError(f"no {split} sample left in {', '.join(files)} ({stats.describe()})")
        self.stats[split] = stats
        rank_zero_info(f"sft {split} data: {stats.describe()}")
        return dataset, conversations

    @override
    def setup(self, stage: str) -> None:
        self.collate_fn = functools.partial(pad_collate, pad_id=self.pad_id)
        if stage == "fit" and self.train_dataset is None:
            train, _ = self._load(self.train_files, "train")
            self.train_dataset = self._packed(train) if self.pack else train
        if self.val_files and self.val_dataset is None:
            self.val_dataset, self._val_conversations = self._load(self.val_files, "val")

    def _packed(self, dataset: SFTDataset) -> PackedDataset:
        lengths = dataset.lengths()
        bins = shuffled_best_fit_pack(lengths, self.seq_length, seed=self.seed, buffer_size=self.pack_buffer)
        packed = PackedDataset(dataset, bins, self.seq_length, pad_id=self.pad_id)
        padding = 1 - sum(lengths) / (len(bins) * self.seq_length)
        rank_zero_info(
            f"sft packing: {len(dataset)} samples into {len(bins)} sequences of {self.seq_length} "
            f"({padding:.1%} padding)"
        )
        return packed

    def generation_references(self, split: str = "val") -> list[GenerationReference]:
        """Prompts (the conversation before its last assistant turn) and that turn's text, for generation metrics."""
        if split != "val":
            raise ValueError(f"generation references exist for split 'val' only, got {split!r}")
        if not self._val_conversations and self.val_files:
            self.setup("validate")
        references = []
        for conversation in self._val_conversations:
            prompt, answer = self.encoder.prompt_and_answer(conversation)
            references.append(GenerationReference(prompt, answer, conversation.source))
        return references

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end a generated answer."""
        return self.encoder.stop_token_ids()

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(ids)

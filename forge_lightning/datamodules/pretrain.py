"""Pre-training data: fixed-length token samples from Megatron indexed datasets, blended and resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from forge_lightning.datamodules.base import TokenDataModule
from forge_lightning.datamodules.gpt_dataset import BlendedDataset, TokenSequenceDataset, split_documents
from forge_lightning.datamodules.indexed import IndexedDataset


class PretrainDataModule(TokenDataModule):
    """Fixed-length language-modelling samples from one or more ``forge-data pretrain`` datasets.

    Each dataset's documents are split into train / validation by document ranges (``split``), concatenated with
    their end-of-document tokens and cut into ``seq_length`` windows. Several datasets are mixed by ``weights``.
    The training loader's position is saved in checkpoints, so a resumed run sees exactly the samples the
    uninterrupted run would have seen.

    Args:
        data_prefix: path prefix (or list of prefixes) of ``PREFIX.bin`` / ``PREFIX.idx`` datasets.
        tokenizer: Hugging Face tokenizer directory the data was tokenized with.
        weights: blend weights, one per prefix (default: proportional to each dataset's training tokens).
        seq_length: tokens per sample.
        batch_size: micro-batch per data-parallel rank.
        split: train / validation weights over documents, e.g. ``"98,2"``.
        num_train_samples: training samples per epoch (default: one pass over the training documents).
        num_val_samples: validation samples (default: one pass over the validation documents).
        seed: seed of the document shuffle, the blend and the per-epoch sample order.
        num_workers: DataLoader workers per rank.
        pin_memory: pin host memory (useful on CUDA).
        reset_position_ids: restart positions at every document boundary inside a sample.
        predict_prompts: prompts that ``forge predict`` continues (one per batch).
    """

    def __init__(
        self,
        data_prefix: str | list[str],
        tokenizer: str,
        *,
        weights: list[float] | None = None,
        seq_length: int = 1024,
        batch_size: int = 8,
        split: str = "98,2",
        num_train_samples: int | None = None,
        num_val_samples: int | None = None,
        seed: int = 1234,
        num_workers: int = 2,
        pin_memory: bool = True,
        reset_position_ids: bool = False,
        predict_prompts: list[str] | None = None,
    ) -> None:
        super().__init__(
            tokenizer, batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=pin_memory
        )
        self.prefixes = [data_prefix] if isinstance(data_prefix, str) else list(data_prefix)
        if not self.prefixes:
            raise ValueError("data_prefix is empty: give at least one dataset prefix")
        if weights is not None and len(weights) != len(self.prefixes):
            raise ValueError(f"weights has {len(weights)} entries but data_prefix has {len(self.prefixes)}")
        if seq_length < 1:
            raise ValueError(f"seq_length ({seq_length}) must be positive")
        self.weights = weights
        self.seq_length = seq_length
        self.split = split
        self.num_train_samples = num_train_samples
        self.num_val_samples = num_val_samples
        self.reset_position_ids = reset_position_ids
        self.predict_prompts = list(predict_prompts or [])

    @override
    def setup(self, stage: str) -> None:
        if self.train_dataset is not None:
            return
        indexed = [self._open(prefix) for prefix in self.prefixes]
        train_parts, val_parts = [], []
        for data in indexed:
            train_docs, val_docs, *_ = split_documents(len(data), self.split, seed=self.seed)
            train_parts.append(self._sequences(data, train_docs))
            val_parts.append(self._sequences(data, val_docs) if len(val_docs) else None)
        self.train_dataset = self._blend(train_parts, self.num_train_samples)
        vals = [v for v in val_parts if v is not None and len(v) > 0]
        self.val_dataset = self._blend(vals, self.num_val_samples) if vals else None
        rank_zero_info(
            f"pretrain data: {len(self.train_dataset)} train / "
            f"{0 if self.val_dataset is None else len(self.val_dataset)} val samples of {self.seq_length} tokens "
            f"from {len(self.prefixes)} dataset(s)"
        )

    def _open(self, prefix: str) -> IndexedDataset:
        if not (Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists()):
            raise FileNotFoundError(
                f"data prefix {prefix!r} not found: expected {prefix}.bin and {prefix}.idx. Create them with "
                f"`forge-data pretrain --input FILES --tokenizer {self.tokenizer_path} --output-prefix {prefix}`"
            )
        return IndexedDataset(prefix)

    def _sequences(self, data: IndexedDataset, documents: Any) -> TokenSequenceDataset:
        return TokenSequenceDataset(
            data,
            self.seq_length,
            documents,
            seed=self.seed,
            reset_position_ids=self.reset_position_ids,
            vocab_size=self.vocab_size,
        )

    def _blend(self, parts: list[Dataset], num_samples: int | None) -> Dataset:
        if len(parts) == 1 and num_samples is None:
            return parts[0]
        weights = self.weights if self.weights is not None and len(parts) == len(self.weights) else None
        if weights is None:
            weights = [float(len(p)) for p in parts]  # type: ignore[arg-type]
        total = num_samples if num_samples is not None else sum(len(p) for p in parts)  # type: ignore[arg-type]
        return BlendedDataset(parts, weights, total, seed=self.seed)

    @override
    def predict_dataloader(self) -> DataLoader:
        if not self.predict_prompts:
            raise ValueError("forge predict needs prompts: set data.predict_prompts (a list of strings)")
        prompts = [{"input_ids": torch.tensor([self.tokenizer.encode(p)])} for p in self.predict_prompts]
        return DataLoader(prompts, batch_size=None)  # one prompt per batch: prompts differ in length

"""What the datamodules share: the data-parallel layout, the resumable loaders and (for text) the tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import Dataset
from typing_extensions import override

from forge_lightning.datamodules.loader import ShardedLoader, StepLoader
from forge_lightning.datamodules.tokenizer import TextTokenizer, load_tokenizer


class StepDataModule(pl.LightningDataModule):
    """Base of datamodules trained through a :class:`StepLoader`: subclasses build the datasets in ``setup``.

    Training batches come from a :class:`StepLoader` (exact resumption and, when samples carry labels,
    ``step_tokens`` for global-batch loss normalisation), evaluation batches from a :class:`ShardedLoader`. The
    loader's position advances when a batch reaches the model (``on_after_batch_transfer``), so prefetched
    batches are not counted.

    Args:
        batch_size: micro-batch per data-parallel rank.
        seed: seed of the per-epoch sample order.
        num_workers: DataLoader workers per rank.
        pin_memory: pin host memory (useful on CUDA).
    """

    #: batch key whose non-ignored entries ``step_tokens`` counts; ``None`` for samples without token labels.
    label_key: str | None = "labels"

    def __init__(self, *, batch_size: int, seed: int, num_workers: int, pin_memory: bool) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be positive")
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.collate_fn: Callable[[list[Any]], Any] | None = None
        self._train_loader: StepLoader | None = None

    def _dp(self) -> tuple[int, int]:
        """(data-parallel size, data-parallel rank) from the trainer's strategy."""
        if self.trainer is None:
            return 1, 0
        strategy = self.trainer.strategy
        size = getattr(strategy, "data_parallel_size", None) or self.trainer.world_size
        rank = getattr(strategy, "data_parallel_rank", None)
        return size, self.trainer.global_rank if rank is None else rank

    @override
    def train_dataloader(self) -> StepLoader:
        size, rank = self._dp()
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        self._train_loader = self._make_train_loader(
            self.train_dataset,
            batch_size=self.batch_size,
            num_replicas=size,
            rank=rank,
            accumulate=accumulate,
            seed=self.seed,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            collate_fn=self.collate_fn,
            label_key=self.label_key,
        )
        return self._train_loader

    def _make_train_loader(self, dataset: Dataset, **options: Any) -> StepLoader:
        """The training loader of ``dataset`` (subclasses may return a :class:`StepLoader` subclass)."""
        return StepLoader(dataset, **options)

    @override
    def val_dataloader(self) -> ShardedLoader | list:
        if self.val_dataset is None:
            return []
        size, rank = self._dp()
        return ShardedLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            num_replicas=size,
            rank=rank,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            collate_fn=self.collate_fn,
        )

    @override
    def test_dataloader(self) -> ShardedLoader | list:
        return self.val_dataloader()

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training and self._train_loader is not None:
            self._train_loader.mark_consumed()
        return batch


class TokenDataModule(StepDataModule):
    """A :class:`StepDataModule` of token sequences, with the tokenizer they were made with.

    Args:
        tokenizer: Hugging Face tokenizer directory.
        batch_size: micro-batch per data-parallel rank.
        seed: seed of the per-epoch sample order.
        num_workers: DataLoader workers per rank.
        pin_memory: pin host memory (useful on CUDA).
    """

    def __init__(
        self, tokenizer: str, *, batch_size: int, seed: int, num_workers: int, pin_memory: bool
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=pin_memory)
        self.tokenizer_path = tokenizer
        self._tokenizer: TextTokenizer | None = None

    @property
    def tokenizer(self) -> TextTokenizer:
        """The tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce."""
        return self.tokenizer.vocab_size

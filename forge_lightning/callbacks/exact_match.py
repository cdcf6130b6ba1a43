"""Generation metrics at validation: greedy answers to held-out prompts compared with the reference answers."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

METRICS = ("exact_match",)


class GenerationMetric(Callback):
    """Logs ``<stage>/exact_match``: the share of prompts whose greedy answer equals the reference answer.

    Runs at the end of every validation (the sanity check included, which gives the value before training) and
    test. The datamodule provides ``generation_references("val")`` (prompt token ids + reference text),
    ``stop_token_ids`` and ``decode`` (as ``SFTDataModule`` does); the module provides ``generate`` (greedy with a
    KV cache). Answers and references are compared after stripping surrounding whitespace. Prompts are split
    across data-parallel ranks and the counts summed.

    Args:
        metric: ``exact_match``.
        max_new_tokens: longest answer generated.
        num_samples: prompts evaluated (the first ones; ``None``: all).
        batch_size: prompts of equal length decoded together.
    """

    def __init__(
        self,
        metric: str = "exact_match",
        max_new_tokens: int = 64,
        num_samples: int | None = None,
        batch_size: int = 32,
    ) -> None:
        if metric not in METRICS:
            raise ValueError(f"metric ({metric!r}) must be one of {', '.join(METRICS)}")
        if max_new_tokens < 1 or batch_size < 1 or (num_samples is not None and num_samples < 1):
            raise ValueError(
                f"max_new_tokens ({max_new_tokens}), batch_size ({batch_size}) and num_samples ({num_samples}) "
                "must be positive"
            )
        self.metric = metric
        self.max_new_tokens = max_new_tokens
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.history: list[tuple[int, float]] = []

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> tuple[int, int]:
        """(correct, total) over this rank's share of the references."""
        datamodule: Any = trainer.datamodule
        references = datamodule.generation_references("val")[: self.num_samples]
        world = getattr(trainer.strategy, "data_parallel_size", None) or trainer.world_size
        rank = getattr(trainer.strategy, "data_parallel_rank", None)
        references = references[(trainer.global_rank if rank is None else rank) :: world]
        by_length: dict[int, list[Any]] = defaultdict(list)
        for reference in references:
            by_length[len(reference.prompt_ids)].append(reference)
        stop = datamodule.stop_token_ids
        correct = 0
        for group in by_length.values():
            for start in range(0, len(group), self.batch_size):
                chunk = group[start : start + self.batch_size]
                prompts = torch.tensor([r.prompt_ids for r in chunk], device=pl_module.device)
                out = pl_module.generate(
                    prompts, max_new_tokens=self.max_new_tokens, eos_token_id=stop or None
                )
                for reference, row in zip(chunk, out[:, prompts.shape[1] :].tolist()):
                    answer = datamodule.decode(_until_stop(row, stop))
                    correct += answer.strip() == reference.reference.strip()
        return correct, len(references)

    def _log(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        correct, total = self.evaluate(trainer, pl_module)
        counts = torch.tensor([correct, total], dtype=torch.float64, device=pl_module.device)
        counts = trainer.strategy.reduce(counts, reduce_op="sum")
        if counts[1] == 0:
            return
        value = float(counts[0] / counts[1])
        pl_module.log(f"{stage}/{self.metric}", value, rank_zero_only=True)
        self.history.append((trainer.global_step, value))
        rank_zero_info(
            f"{stage}/{self.metric}: {value:.3f} ({int(counts[0])}/{int(counts[1])}) at step {trainer.global_step}"
        )

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer, pl_module, "val")

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer, pl_module, "test")

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if len(self.history) >= 2:
            (first_step, first), (last_step, last) = self.history[0], self.history[-1]
            rank_zero_info(
                f"val/{self.metric}: {first:.3f} at step {first_step} -> {last:.3f} at step {last_step}"
            )


def _until_stop(ids: list[int], stop: list[int]) -> list[int]:
    for k, token in enumerate(ids):
        if token in stop:
            return ids[:k]
    return ids

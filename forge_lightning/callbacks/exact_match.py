"""Generation metrics at validation: greedy answers to held-out prompts compared with the reference answers."""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from forge_lightning.callbacks.generation import check_generation_layout, lockstep
from forge_lightning.contracts import data_parallel, module_weights

METRICS = ("exact_match",)


class GenerationMetric(Callback):
    """Logs ``<stage>/exact_match``: the share of prompts whose greedy answer equals the reference answer.

    Runs at the end of every validation (the sanity check included, which gives the value before training) and
    test. The datamodule provides ``generation_references("val")`` (prompt token ids + reference text),
    ``stop_token_ids`` and ``decode`` (as ``SFTDataModule`` does); the module provides ``generate`` (greedy with a
    KV cache). A reference with ``inputs`` of its own (a vision-language prompt's images) is decoded alone, its
    inputs passed to ``generate``. Answers and references are compared after stripping surrounding whitespace. Prompts are split
    across data-parallel ranks and the counts summed; the ranks decode in lockstep (see
    :mod:`forge_lightning.callbacks.generation`), a rank with fewer batches decoding stand-in prompts, with the
    trained weights in the module (``module_weights``: under ``MegatronStrategy`` the twin's, copied in).

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

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_generation_layout(self, trainer)

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> tuple[int, int]:
        """(correct, total) over this rank's share of the references. Collective: every rank calls it."""
        datamodule: Any = trainer.datamodule
        references = datamodule.generation_references("val")[: self.num_samples]
        world, rank = data_parallel(trainer.strategy)
        references = references[rank::world]
        by_length: dict[int, list[Any]] = defaultdict(list)
        alone = []  # prompts with inputs of their own (images) are decoded one at a time
        for reference in references:
            if reference.inputs:
                alone.append([reference])
            else:
                by_length[len(reference.prompt_ids)].append(reference)
        chunks = [
            group[start : start + self.batch_size]
            for group in by_length.values()
            for start in range(0, len(group), self.batch_size)
        ] + alone
        stop = datamodule.stop_token_ids
        together = lockstep(trainer)
        generate = functools.partial(
            pl_module.generate,
            max_new_tokens=self.max_new_tokens,
            eos_token_id=None if together else stop or None,
        )
        num_batches = len(chunks)
        if together:
            # Ranks hold different numbers of equal-length batches: each runs as many decodings as the most (agreed
            # before any decoding, whose collectives must pair up), the extra ones on a one-token stand-in prompt.
            count = torch.tensor(len(chunks), device=trainer.strategy.root_device)
            num_batches = int(trainer.strategy.reduce(count, reduce_op="max"))
        correct = 0
        # Entered by every rank (collective under MegatronStrategy), which then holds the whole model.
        with module_weights(trainer.strategy):
            device = pl_module.device
            for i in range(num_batches):
                if i >= len(chunks):
                    generate(torch.zeros((1, 1), dtype=torch.long, device=device))
                    continue
                prompts = torch.tensor([r.prompt_ids for r in chunks[i]], device=device)
                inputs = chunks[i][0].inputs or {}
                out = generate(prompts, **{k: v.to(device) for k, v in inputs.items()})
                for reference, row in zip(chunks[i], out[:, prompts.shape[1] :].tolist()):
                    answer = datamodule.decode(_until_stop(row, stop))
                    correct += answer.strip() == reference.reference.strip()
        return correct, len(references)

    def _log(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        correct, total = self.evaluate(trainer, pl_module)
        counts = torch.tensor([correct, total], dtype=torch.float64, device=trainer.strategy.root_device)
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

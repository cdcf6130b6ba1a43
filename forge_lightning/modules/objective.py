"""``GlobalBatchLoss``: the one batch rule's loss normalisation and logging, shared by every family.

A family computes, per micro-batch, the sum of its per-item losses and the number of items (trainable tokens of a
language model, samples of a policy). The optimizer step must follow the gradient of::

    sum of the global batch's item losses / number of items in the global batch

whatever the data-parallel size, micro-batch size and accumulation. Natively (every strategy built on Lightning's
loop) :meth:`GlobalBatchLoss.training_loss` scales each micro-batch's sum by ``accumulation x DP / items`` (Lightning
divides by the accumulation steps, data parallelism averages over ranks), the items counted ahead by the
datamodule (:data:`~forge_lightning.contracts.STEP_TOKENS`). Under ``MegatronStrategy`` megatron's per-token loss
divides by the same count and the family's megatron twin hands the step's sums to :meth:`record_train`. Either
way the module logs with :meth:`log_train` / :meth:`log_eval`, the same code.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from forge_lightning.contracts import STEP_TOKENS, data_parallel


class GlobalBatchLoss:
    """Loss sums of the current optimizer step and evaluation, normalised and logged by the one batch rule.

    Args:
        count_key: batch key of the step's item count on this data rank (``step_tokens``).
    """

    def __init__(self, count_key: str = STEP_TOKENS) -> None:
        self.count_key = count_key
        self._train: Tensor | None = (
            None  # [loss sum, count] (float64) of this rank's micro-batches of the step
        )
        self._eval: Tensor | None = None
        self._norm: tuple[int, Tensor] | None = None  # (global step, the step's global count)
        self._warned = False

    # ----- native training -------------------------------------------------------------------------------------
    def training_loss(self, module: Any, batch: dict[str, Any], loss_sum: Tensor, count: Tensor) -> Tensor:
        """The micro-batch's loss to back-propagate: ``loss_sum`` scaled so that the step's gradient is that of
        the global batch's item mean; records the sums for :meth:`log_train`.

        Args:
            module: the LightningModule (attached to a trainer).
            batch: the micro-batch (its ``count_key`` entry: the step's count on this data rank).
            loss_sum: sum of the micro-batch's item losses.
            count: its number of items.
        """
        self.record_train(torch.stack([loss_sum.detach().double(), count.double()]))
        return loss_sum * self.gradient_scale(module, batch, count).to(loss_sum.dtype)

    def gradient_scale(self, module: Any, batch: dict[str, Any], count: Tensor) -> Tensor:
        """The factor :meth:`training_loss` multiplies the micro-batch's loss sum by (``accumulation x DP / the
        global batch's items``), for further sums normalised by the same items (multi-token prediction's).

        Args:
            module: the LightningModule (attached to a trainer).
            batch: the micro-batch (its ``count_key`` entry: the step's count on this data rank).
            count: its number of items.
        """
        total = self._global_count(module, batch, count)
        trainer = module.trainer
        return trainer.accumulate_grad_batches * data_parallel(trainer.strategy)[0] / total

    def _global_count(self, module: Any, batch: dict[str, Any], count: Tensor) -> Tensor:
        """Items of this optimizer step over all micro-batches and data-parallel ranks (cached per step)."""
        trainer = module.trainer
        step = trainer.global_step
        if self._norm is not None and self._norm[0] == step:
            return self._norm[1]
        step_count = batch.get(self.count_key)
        if step_count is None:
            if not self._warned:
                rank_zero_warn(
                    f"batches carry no `{self.count_key}`: the loss is normalised per micro-batch, so gradient "
                    "accumulation weights micro-batches equally. Use a forge-lightning datamodule for exact "
                    "global-batch normalisation."
                )
                self._warned = True
            step_count = count * trainer.accumulate_grad_batches
        total = trainer.strategy.reduce(
            torch.as_tensor(step_count).to(module.device, torch.float64).clone(), reduce_op="sum"
        )
        self._norm = (step, total.clamp_min(1))
        return self._norm[1]

    # ----- sums and logging ------------------------------------------------------------------------------------
    def record_train(self, sums: Tensor) -> None:
        """Add ``[loss sum, count]`` of this rank's micro-batches to the current step's."""
        sums = sums.detach().double()
        self._train = sums if self._train is None else self._train + sums

    def pending_train(self) -> Tensor | None:
        """This rank's ``[loss sum, count]`` of the current step so far (``None``: nothing recorded yet)."""
        return self._train

    def record_eval(self, sums: Tensor) -> None:
        """Add ``[loss sum, count]`` of this rank's evaluation batches to the current evaluation's."""
        sums = sums.detach().double()
        self._eval = sums if self._eval is None else self._eval + sums

    def log_train(self, module: Any, name: str = "train/loss") -> Tensor | None:
        """Log the step's global mean loss as ``name`` (collective: the sums are reduced over the data-parallel
        ranks) and start the next step; returns the mean, ``None`` when nothing was recorded."""
        if self._train is None:
            return None
        sums = module.trainer.strategy.reduce(self._train.to(module.device), reduce_op="sum")
        self._train = None
        mean = (sums[0] / sums[1].clamp_min(1)).float()
        module.log(name, mean, prog_bar=True, rank_zero_only=True)
        return mean

    def log_eval(self, module: Any, prefix: str) -> Tensor | None:
        """Log the evaluation's global mean loss as ``<prefix>/loss`` (collective) and reset; returns the mean,
        ``None`` when the evaluation had no items."""
        sums = self._eval if self._eval is not None else torch.zeros(2, dtype=torch.float64)
        sums = module.trainer.strategy.reduce(sums.to(module.device), reduce_op="sum")
        self._eval = None
        if sums[1] <= 0:
            return None
        mean = (sums[0] / sums[1]).float()
        module.log(f"{prefix}/loss", mean, prog_bar=True, rank_zero_only=True)
        return mean


class TokenLossSteps:
    """The evaluation steps and the step-loss hook of a LightningModule whose loss is a sum over trainable tokens
    (``loss_sum(batch) -> (sum, count)``) normalised by its :class:`GlobalBatchLoss` (``objective``): validation
    and test accumulate the sums and log ``<split>/loss`` (and what :meth:`_eval_log` adds) at the epoch's end."""

    objective: GlobalBatchLoss

    def loss_sum(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(sum of per-token losses, number of trainable tokens) of a micro-batch."""
        raise NotImplementedError

    def step_loss_sums(self) -> Tensor | None:
        """This rank's ``[loss sum, tokens]`` of the coming optimizer step (:class:`~forge_lightning.contracts.StepLoss`)."""
        return self.objective.pending_train()

    def _eval_step(self, batch: dict[str, Any]) -> None:
        loss_sum, tokens = self.loss_sum(batch)
        self.objective.record_eval(torch.stack([loss_sum.detach().double(), tokens.double()]))

    def _eval_log(self, prefix: str) -> Tensor | None:
        return self.objective.log_eval(self, prefix)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_log("val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_log("test")

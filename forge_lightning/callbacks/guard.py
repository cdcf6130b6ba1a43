"""``NonFiniteGuard``: an optimizer step whose loss or gradients are not finite is not applied.

Before every optimizer step (Lightning's ``on_before_optimizer_step``, under every strategy) the guard sums, in one
all-reduce over the world, this rank's count of non-finite gradients and the module's loss sums of the step
(:class:`~forge_lightning.contracts.StepLoss`), then reads them in one host sync::

    [non-finite gradient tensors, loss sum, items] ──all-reduce (sum)──> bad?  spike?  ──> skip or apply

A skipped step leaves the weights and the optimizer state as they were (the strategy drops the step's gradients:
:func:`~forge_lightning.contracts.skip_optimizer_step`); the LR schedule still advances. ``max_consecutive`` bad
steps in a row stop the run with an error naming the newest checkpoint, and no checkpoint or export is written from
weights that are not finite (:meth:`NonFiniteGuard.on_save_checkpoint` refuses the save).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from forge_lightning.contracts import (
    SkippedStepAware,
    StepLoss,
    nonfinite_gradients,
    skip_optimizer_step,
    trained_parameters,
)


class NonFiniteGuard(Callback):
    """Skips optimizer steps whose loss or gradients are NaN / inf (and, optionally, loss spikes); stops the run after
    ``max_consecutive`` of them in a row. The forge CLI adds one to every ``fit`` unless the config has its own.

    Args:
        enabled: ``False`` turns the guard off (every step is applied, saves are not checked).
        max_consecutive: bad steps in a row after which the run stops with an error (0: never stop).
        spike_factor: a step loss above this factor times the median of the last ``spike_window`` applied steps'
            losses is a spike, logged with a warning (0: no spike detection).
        spike_window: applied steps in the running median (spikes are detected once it is full).
        skip_spikes: skip spike steps as well as non-finite ones.
    """

    def __init__(
        self,
        enabled: bool = True,
        max_consecutive: int = 10,
        spike_factor: float = 0.0,
        spike_window: int = 50,
        skip_spikes: bool = False,
    ) -> None:
        if max_consecutive < 0:
            raise ValueError(f"max_consecutive must be >= 0, got {max_consecutive}")
        if spike_factor and spike_factor <= 1:
            raise ValueError(f"spike_factor must be above 1 (or 0: off), got {spike_factor}")
        if spike_window < 1:
            raise ValueError(f"spike_window must be >= 1, got {spike_window}")
        if skip_spikes and not spike_factor:
            raise ValueError("skip_spikes needs spike_factor (a factor over the running median loss)")
        self.enabled = enabled
        self.max_consecutive = max_consecutive
        self.spike_factor = spike_factor
        self.skip_spikes = skip_spikes
        self._losses: deque[float] = deque(maxlen=spike_window)
        self.consecutive = 0
        self.skipped = 0
        self._warned_no_loss = False

    @property
    def state_key(self) -> str:
        return "NonFiniteGuard"

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.enabled:
            return
        bad_grads, loss = self._step_statistics(trainer, pl_module, optimizer)
        step = trainer.global_step
        reason = None
        if bad_grads:
            reason = f"{int(bad_grads)} gradient tensor(s) with NaN / inf"
        elif loss is not None and not math.isfinite(loss):
            reason = f"loss {loss}"
        elif loss is not None and self._is_spike(loss):
            median = statistics.median(self._losses)
            message = f"step {step}: loss {loss:.4g} is {loss / median:.1f}x the running median {median:.4g}"
            if self.skip_spikes:
                reason = f"loss spike ({message})"
            else:
                rank_zero_warn(f"NonFiniteGuard: loss spike at {message}")
        if reason is None:
            self.consecutive = 0
            if loss is not None:
                self._losses.append(loss)
        else:
            self._skip(trainer, pl_module, optimizer, step, reason)
        pl_module.log("train/skipped_steps", float(self.skipped), rank_zero_only=True)

    def _step_statistics(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> tuple[float, float | None]:
        """``(non-finite gradient tensors over the world, the step's global mean loss or None)``: one all-reduce,
        one host sync."""
        strategy = trainer.strategy
        device = strategy.root_device
        sums = pl_module.step_loss_sums() if isinstance(pl_module, StepLoss) else None
        if sums is None and not self._warned_no_loss:
            rank_zero_info(
                f"NonFiniteGuard: {type(pl_module).__name__} gives no step loss (StepLoss); only its gradients "
                "are checked"
            )
            self._warned_no_loss = True
        loss = torch.zeros(2, dtype=torch.float64, device=device) if sums is None else sums.detach()
        bad = nonfinite_gradients(strategy, optimizer).reshape(1)
        values = torch.cat([bad.to(device, torch.float64), loss.to(device, torch.float64)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(values)
        bad, loss_sum, items = values.tolist()
        return bad, (loss_sum / items if items > 0 else None)

    def _is_spike(self, loss: float) -> bool:
        if not self.spike_factor or len(self._losses) < (self._losses.maxlen or 1):
            return False
        return loss > self.spike_factor * statistics.median(self._losses)

    def _skip(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        optimizer: torch.optim.Optimizer,
        step: int,
        reason: str,
    ) -> None:
        skip_optimizer_step(trainer.strategy, optimizer)
        if isinstance(pl_module, SkippedStepAware):
            pl_module.optimizer_step_skipped()
        self.skipped += 1
        self.consecutive += 1
        rank_zero_warn(
            f"NonFiniteGuard: step {step} not applied: {reason} (the weights and optimizer state stay as they "
            f"were; {self.consecutive} bad step(s) in a row, {self.skipped} in all)"
        )
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise RuntimeError(
                f"NonFiniteGuard: {self.consecutive} optimizer steps in a row had a non-finite loss or gradients "
                f"(the last at step {step}: {reason}); the run stops. {_newest_checkpoint(trainer)} Lower "
                "optimizer.lr, raise the warm-up, check the data, or resume from that checkpoint"
            )

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Refuse to write a checkpoint of weights that are not finite (collective: every rank checks its own)."""
        if self.enabled:
            check_finite_weights(trainer, pl_module, "checkpoint")

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "consecutive": self.consecutive, "losses": list(self._losses)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
        self.consecutive = int(state_dict.get("consecutive", 0))
        self._losses.clear()
        self._losses.extend(float(v) for v in state_dict.get("losses", []))


def check_finite_weights(trainer: Trainer, pl_module: LightningModule, what: str) -> None:
    """Raise ``RuntimeError`` naming the first parameters that hold NaN / inf, on every rank, when any rank's trained
    weights are not finite (collective: one all-reduce)."""
    device = trainer.strategy.root_device
    named = trained_parameters(trainer.strategy, pl_module)
    flags = [(~torch.isfinite(_local(tensor))).any().to(device) for _, tensor in named]
    bad = torch.stack(flags) if flags else torch.zeros(0, dtype=torch.bool, device=device)
    count = bad.sum().reshape(1).float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count)
    if count.item() == 0:  # the one host sync
        return
    names = [name for (name, _), flag in zip(named, bad.tolist(), strict=True) if flag]
    where = f" (here: {names[:3]})" if names else " (on another rank)"
    raise RuntimeError(
        f"not writing the {what}: the weights are not finite{where}. {_newest_checkpoint(trainer)} Resume from it "
        "with a lower optimizer.lr, or keep NonFiniteGuard on to skip the steps that would break the weights"
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _newest_checkpoint(trainer: Trainer) -> str:
    callback = trainer.checkpoint_callback
    path = (
        (callback.last_model_path or callback.best_model_path)
        if isinstance(callback, ModelCheckpoint)
        else ""
    )
    return f"The newest checkpoint is {path}." if path else "No checkpoint was written yet."

"""A summary of how a validation metric moved over training: first value, last value, relative change."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class ValidationSummary(Callback):
    """Records ``monitor`` after every validation run, the sanity check included, and prints the change at the end.

    Run a full validation before training (``trainer.num_sanity_val_steps: -1``) to get the starting value.

    Args:
        monitor: the logged metric to follow.
    """

    def __init__(self, monitor: str = "val/loss") -> None:
        self.monitor = monitor
        self.history: list[tuple[int, float]] = []

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            self.history.append((trainer.global_step, float(value)))

    def change(self) -> tuple[float, float, float] | None:
        """(first, last, relative change) of the monitored metric, or None before two validations."""
        if len(self.history) < 2:
            return None
        first, last = self.history[0][1], self.history[-1][1]
        return first, last, (last - first) / first

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        change = self.change()
        if change is not None:
            first, last, rel = change
            rank_zero_info(
                f"{self.monitor}: {first:.4f} at step {self.history[0][0]} -> {last:.4f} at step "
                f"{self.history[-1][0]} ({rel:+.1%})"
            )

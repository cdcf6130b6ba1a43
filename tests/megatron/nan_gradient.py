"""Test callback: one gradient element set to NaN before one optimizer step (natively in a parameter's ``.grad``,
under MegatronStrategy in megatron-core's gradient buffer), so the non-finite guard leaves that step out."""

import math

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class NanGradientAtStep(Callback):
    """Poison one gradient element before optimizer step ``step`` (runs before the guard: listed first).

    Args:
        step: the optimizer step (``trainer.global_step`` while it is computed).
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if trainer.global_step != self.step:
            return
        chunks = getattr(trainer.strategy, "_chunks", None)
        if chunks:  # MegatronStrategy: the gradients live in megatron-core's buffers
            chunks[0].buffers[0].grad_data.view(-1)[0] = math.nan
            return
        grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
        grad.view(-1)[0] = math.nan

"""Test callback: one rank killed (SIGKILL) in the middle of an optimizer step, on the job's first attempt only."""

import os
import signal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from forge_lightning.resume import elastic_restart_count


class KillRankMidStep(Callback):
    """SIGKILL global rank ``rank`` after the backward pass of optimizer step ``step`` (before the step is applied),
    unless torchelastic has already restarted the job.

    Args:
        step: the optimizer step (``trainer.global_step`` while it is computed) to die in.
        rank: the global rank that dies.
    """

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if (
            trainer.global_step == self.step
            and trainer.global_rank == self.rank
            and elastic_restart_count() == 0
        ):
            os.kill(os.getpid(), signal.SIGKILL)

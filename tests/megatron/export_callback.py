"""Test callback: the trained weights as Hugging Face safetensors at one global step (``full_model_state_dict``)."""

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from safetensors.torch import save_file


class ExportAtStep(Callback):
    """Write ``trainer.strategy.full_model_state_dict()`` to ``path`` (rank 0) once ``global_step`` reaches ``step``.

    Args:
        step: the optimizer step after which to export.
        path: the safetensors file to write.
    """

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = Path(path)
        self.done = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if self.done or trainer.global_step != self.step:
            return
        self.done = True
        state = trainer.strategy.full_model_state_dict()  # collective
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, self.path)

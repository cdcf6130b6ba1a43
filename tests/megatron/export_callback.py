"""Test callback: the trained weights as a Hugging Face directory at one global step (the module's
``save_pretrained``, which gathers them through ``full_model_state_dict``)."""

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class ExportAtStep(Callback):
    """Write the module's Hugging Face export to ``path``'s directory once ``global_step`` reaches ``step``.

    Args:
        step: the optimizer step after which to export.
        path: the safetensors file the export writes (``<dir>/model.safetensors``).
    """

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = Path(path)
        self.done = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if self.done or trainer.global_step != self.step:
            return
        self.done = True
        pl_module.save_pretrained(self.path.parent, overwrite=True)  # collective

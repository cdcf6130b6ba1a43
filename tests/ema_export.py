"""Test callback: the EMA average under the LightningModule's own state-dict names, written at the end of training.

Under a strategy whose trained parameters are not the module's (``MegatronStrategy``: the twin's TP shards, named by
their place in its checkpoint) the average cannot be compared name by name with a one-process run's; here it is
swapped into the trained weights (``EMA.averaged``) and gathered the way an export gathers them
(``full_state_dict``: the strategy's ``full_model_state_dict``), then global rank 0 saves it with ``torch.save``.
Used by tests/test_callbacks_strategies.py through the CLI (``class_path: ema_export.ExportEMA``).
"""

from pathlib import Path

import lightning.pytorch as pl
import torch

from forge_lightning.callbacks.ema import EMA
from forge_lightning.contracts import full_state_dict


class ExportEMA(pl.Callback):
    """Write the run's EMA average, gathered under the LightningModule's ``state_dict()`` names, to ``path``.

    Args:
        path: the ``torch.save`` file global rank 0 writes when training ends.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (ema,) = [c for c in trainer.callbacks if isinstance(c, EMA)]
        with ema.averaged(trainer, pl_module):  # collective: every rank swaps, gathers and swaps back
            state = full_state_dict(trainer.strategy, pl_module)
            if state is None:  # the module's own parameters are the trained ones
                state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save(state, self.path)

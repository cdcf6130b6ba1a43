"""A test callback: the weights of the module's plain model before and after training, whichever strategy trains it."""

from pathlib import Path

import lightning.pytorch as pl
import torch

from forge_lightning.contracts import full_state_dict


class ExportWeights(pl.Callback):
    """Write ``pl_module.model``'s full state dict to ``<log_dir>/weights_start.pt`` when training starts and to
    ``<log_dir>/weights.pt`` when it ends (global rank 0).

    Through the contract (:func:`~forge_lightning.contracts.full_state_dict`): a strategy that shards the weights or
    trains another copy of them gathers them (collective: every rank calls it), the others leave them in the module.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, pl_module, "weights_start.pt")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, pl_module, "weights.pt")

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> None:
        state = full_state_dict(trainer.strategy, pl_module.model)
        if state is None:
            state = pl_module.model.state_dict()
        if trainer.is_global_zero:
            state = {k: v.detach().cpu().clone() for k, v in state.items()}
            torch.save(state, Path(trainer.logger.log_dir) / name)

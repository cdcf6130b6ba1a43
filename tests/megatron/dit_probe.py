"""Test helpers of the Wan DiT runs under MegatronStrategy: a callback that records what each rank trains on, and
the feature-cache datamodule with its training samples as validation data too."""

import hashlib
import json
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from forge_lightning.datamodules.diffusion import VideoDiffusionDataModule


class ValidatedVideoData(VideoDiffusionDataModule):
    """:class:`VideoDiffusionDataModule` whose validation data are its training samples."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.val_dataset = self.train_dataset


class DiTTokens(Callback):
    """Record, per rank, in ``<path>/rank<global rank>.json``: per step the sha256 of the micro-batch's latents and
    the patch tokens per video the DiT blocks take (under context parallelism the rank's share).

    Args:
        path: the directory of the records.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.steps: list[dict] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The DiT that trains: MegatronStrategy's twin chunk, else the module's own.
        chunks = getattr(trainer.strategy, "_chunks", None) or [pl_module]
        blocks = [m for c in chunks for m in c.modules() if type(m).__name__ == "WanBlock"]
        blocks[0].register_forward_pre_hook(self._record_tokens)

    def _record_tokens(self, block, args) -> None:
        if block.training:  # not the validation's forwards
            self.steps[-1]["tokens"].append(int(args[0].shape[1]))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx
    ) -> None:
        digest = hashlib.sha256(batch["latents"].detach().cpu().numpy().tobytes()).hexdigest()
        self.steps.append({"latents": digest, "tokens": []})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))

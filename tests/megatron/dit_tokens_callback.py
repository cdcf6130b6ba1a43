"""Test callback: what each rank of a Wan DiT run trains on, written to ``<dir>/rank<global rank>.json``: per step
the sha256 of every micro-batch's latents and the patch tokens its DiT blocks take per video (under context
parallelism each rank's share)."""

import hashlib
import json
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class DiTTokens(Callback):
    """Record the batches' latents and the tokens per video of the DiT blocks, per rank.

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
        self.steps[-1]["tokens"].append(int(args[0].shape[1]))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx
    ) -> None:
        digest = hashlib.sha256(batch["latents"].detach().cpu().numpy().tobytes()).hexdigest()
        self.steps.append({"latents": digest, "tokens": []})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))

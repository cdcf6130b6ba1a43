"""The FSDP2 runs of test_ema.py: ``python ema_worker.py MODE OUT`` (Lightning starts the other ranks).

MODE ``fsdp2`` (2 processes): ``first`` fits 4 steps with checkpoints at steps 2 and 4; ``resumed`` fits a fresh
model from the step-2 checkpoint to step 4; ``hsdp`` does the same under HSDP (replicate 2 x shard 1).
MODE ``one`` (1 process): ``one`` resumes the 2-process step-2 checkpoint, to step 4.
Rank 0 writes each run's record to ``OUT/<run>.pt``: the whole average (gathered here, for the comparison only)
after step 2 (``first``) or right after the restore (the others), at the end, the final weights and the validation
losses. The single-process reference of the same run is :func:`fit` without a strategy.
"""

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from tiny import TINY_LLM
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from worker_exit import exit_worker

from forge_lightning.callbacks.ema import EMA
from forge_lightning.modules.llm import CausalLM

STEPS, GLOBAL_BATCH, SEQ = 4, 4, 16


def make_ema() -> EMA:
    return EMA(decay=0.6, start_step=1)


def _loader(batch_size: int) -> DataLoader:
    # One global batch per epoch: however a resumed run restarts its epoch, every step sees the same batch.
    tokens = torch.randint(
        0, TINY_LLM["vocab_size"], (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    rows = [{"input_ids": t, "labels": t} for t in tokens]
    return DataLoader(rows, batch_size=batch_size)


def _whole(tensors: dict) -> dict:
    return {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
        for n, t in tensors.items()
    }


class Record(pl.Callback):
    """Whole copies of the EMA (after step ``at``, or after the restore when ``at`` is None), the final EMA and
    weights, and the validation losses."""

    def __init__(self, ema: EMA, at: int | None) -> None:
        self.ema, self.at = ema, at
        self.data: dict = {"val_loss": []}

    def _average(self) -> dict:
        return _whole(dict(zip(self.ema.names, self.ema.average, strict=True)))

    def on_train_start(self, trainer, pl_module):
        if self.at is None:
            self.data["loaded"] = self._average()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            self.data["loaded"] = self._average()

    def on_validation_end(self, trainer, pl_module):
        self.data["val_loss"].append(float(trainer.callback_metrics["val/loss"]))

    def on_train_end(self, trainer, pl_module):
        self.data["average"] = self._average()
        gather = getattr(trainer.strategy, "full_model_state_dict", None)
        self.data["weights"] = gather() if gather else _whole(pl_module.state_dict())


def fit(root: Path, *, seed: int = 0, ckpt_path=None, checkpoint: bool = False, **trainer_kwargs) -> dict:
    """Fit the tiny LLM for 4 steps with the EMA, validating after every step; the run's record."""
    torch.manual_seed(seed)
    module = CausalLM(config=TINY_LLM, optimizer={"name": "sgd", "lr": 0.5}, scheduler={"name": "constant"})
    ema = make_ema()
    record = Record(ema, at=2 if ckpt_path is None else None)
    callbacks = [ema, record]
    if checkpoint:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(root / "ckpt", "{step}", every_n_train_steps=2, save_top_k=-1)
        )
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=1,
        enable_checkpointing=checkpoint, **trainer_kwargs,
    )  # fmt: skip
    world = trainer.world_size
    loader = _loader(GLOBAL_BATCH // world)
    trainer.fit(module, loader, _loader(GLOBAL_BATCH // world), ckpt_path=ckpt_path)
    return record.data


def main() -> None:
    from forge_lightning.strategies import FSDP2Strategy

    mode, out = sys.argv[1], Path(sys.argv[2])
    step2 = out / "ckpt" / "step=2.ckpt"
    runs = {}
    if mode == "fsdp2":
        runs["first"] = fit(out, strategy=FSDP2Strategy(), devices=2, checkpoint=True)
        runs["resumed"] = fit(out, seed=1, ckpt_path=step2, strategy=FSDP2Strategy(), devices=2)
        hsdp = FSDP2Strategy(data_parallel_replicate_size=2)
        runs["hsdp"] = fit(out, seed=1, ckpt_path=step2, strategy=hsdp, devices=2)
    else:
        runs["one"] = fit(out, seed=1, ckpt_path=step2, strategy=FSDP2Strategy(), devices=1)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        for name, data in runs.items():
            torch.save(data, out / f"{name}.pt")
    print("ema_worker: done", flush=True)
    exit_worker()


if __name__ == "__main__":
    main()

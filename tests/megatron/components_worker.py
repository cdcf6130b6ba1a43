"""2-process worker: the tiny encoder -> projector -> LLM model (encoder_decoder.py) under MegatronStrategy with
per-component settings, one ``Trainer.fit`` per case in the same processes (megatron-core is imported once).

``python -m torch.distributed.run --nproc-per-node 2 components_worker.py OUT_DIR CASE...`` (gloo, CPU shim; cases
from :data:`CASES`, run in order). Each case writes its CSV log under ``OUT_DIR/CASE`` (global rank 0) and, per rank,
``OUT_DIR/CASE_rank{r}.pt``: the encoder side's parameters before and after the steps, the number of parameters
megatron's optimizer holds and which parts recompute. A case named ``bad_*`` is expected to fail: its error message
goes to ``OUT_DIR/CASE_error.txt``. test_components.py compares them with the single-process reference
(:data:`CASES`'s ``reference``: the batch of all data-parallel ranks, the same freezing as a module option).

Plain cases train 3 steps on a fixed-order loader and validate on 2 batches after every step. Checkpoint cases (with
a ``checkpoint`` entry) train 5 steps from a resumable :class:`StepData` without validation: ``checkpoint: "save"``
writes ``OUT_DIR/ckpt_CASE/epoch=0-step=3.ckpt`` and ``OUT_DIR/CASE_export.pt`` (global rank 0: the strategy's
``full_model_state_dict()`` before the first step and after the last, and of the decoder module after the last);
``checkpoint: OTHER`` resumes from OTHER's step-3 checkpoint.
"""

import faulthandler
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_shim
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from encoder_decoder import EncoderConfig, EncoderDecoderLM, samples
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler
from worker_exit import exit_worker

from forge_lightning.datamodules.base import StepDataModule

SEED = 7
MODEL = dict(llm="debug", optimizer={"lr": 1e-3})
STEPS = 3
CKPT_STEPS, CKPT_AT = 5, 3  # checkpoint cases: 5 steps, a checkpoint after step 3
CKPT = "epoch=0-step=3.ckpt"
TP2 = dict(tensor_model_parallel_size=2)
RECOMPUTE = {"encoder": {"recompute": "full"}, "llm": {"recompute": "full"}}
FROZEN = {"encoder": {"freeze": True}, "llm": {"freeze": True}}  # only the projector trains (LLaVA stage 1)
# strategy: MegatronStrategy options; batch: per data-parallel rank (3: not divisible by TP = 2, so the second TP
# rank pads its share); reference: the one-process run with the same global batch.
CASES = {
    "tp2": dict(
        strategy=dict(tensor_model_parallel_size=2, components=RECOMPUTE),
        batch=3,
        accumulate=2,
        reference=dict(batch=3, accumulate=2),
    ),
    "tp2_sp": dict(
        strategy=dict(tensor_model_parallel_size=2, sequence_parallel=True),
        batch=3,
        accumulate=2,
        reference=dict(batch=3, accumulate=2),
    ),
    "tp2_frozen": dict(
        strategy=dict(tensor_model_parallel_size=2, components=FROZEN),
        batch=3,
        accumulate=1,
        reference=dict(batch=3, accumulate=1, freeze=["encoder", "llm"]),
    ),
    "dp2": dict(strategy=dict(), batch=3, accumulate=1, reference=dict(batch=6, accumulate=1)),
    # The decoder's optimizer state and fp32 main weights sharded over DP; the encoder side's own optimizer chained.
    "dp2_distopt": dict(
        strategy=dict(use_distributed_optimizer=True),
        batch=3,
        accumulate=1,
        reference=dict(batch=6, accumulate=1),
    ),
    "bad_name": dict(
        strategy=dict(tensor_model_parallel_size=2, components={"vision": {}}), batch=3, accumulate=1
    ),
    # Checkpoints: TP 2 (each TP rank encodes 2 of the 4 samples) saves at step 3, then resumes at TP 2 and at
    # TP 1 x DP 2 (2 samples per rank: the same global micro-batches); a resume that freezes another component.
    "ckpt_tp2": dict(
        strategy=TP2, batch=4, accumulate=2, checkpoint="save", reference=dict(batch=4, accumulate=2)
    ),
    "ckpt_tp2_resume": dict(strategy=TP2, batch=4, accumulate=2, checkpoint="ckpt_tp2"),
    "ckpt_tp2_to_dp2": dict(strategy=dict(), batch=2, accumulate=2, checkpoint="ckpt_tp2"),
    # The distributed optimizer (twin sharded over DP, encoder side chained): save at step 3, resume.
    "ckpt_distopt": dict(
        strategy=dict(use_distributed_optimizer=True),
        batch=2,
        accumulate=2,
        checkpoint="save",
        reference=dict(batch=4, accumulate=2),
    ),
    "ckpt_distopt_resume": dict(
        strategy=dict(use_distributed_optimizer=True), batch=2, accumulate=2, checkpoint="ckpt_distopt"
    ),  # fmt: skip
    "bad_resume_frozen": dict(
        strategy=dict(**TP2, components={"encoder": {"freeze": True}}),
        batch=4,
        accumulate=2,
        checkpoint="ckpt_tp2",
    ),
}


class StepData(StepDataModule):
    """The samples through forge's resumable loader (its position is saved in checkpoints); no validation."""

    label_key = None

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size=batch_size, seed=SEED, num_workers=0, pin_memory=False)

    def setup(self, stage: str) -> None:
        self.train_dataset = samples(40, EncoderConfig(), vocab_size=256)  # 5 steps of 8 samples


def build_module(freeze: list[str] | None = None) -> EncoderDecoderLM:
    pl.seed_everything(SEED, verbose=False)
    return EncoderDecoderLM(**MODEL, freeze=freeze)


def data(batch: int, dp: int = 1, dp_rank: int = 0) -> DataLoader:
    """The samples in order, ``dp_rank``'s share of them (rank r: r, r + dp, ...): the global batch of a step is the
    reference's. Sharded here: MegatronStrategy leaves a plain DataLoader's sampler alone (forge's datamodules
    shard by its ``data_parallel_rank``)."""
    dataset = samples(36, EncoderConfig(), vocab_size=256)
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch, sampler=sampler)


def fit_data(batch: int, dp: int = 1, dp_rank: int = 0, *, resumable: bool = False) -> dict:
    """``Trainer.fit``'s data arguments: the fixed-order loader (also for validation) or :class:`StepData`."""
    if resumable:
        return {"datamodule": StepData(batch)}
    loader = data(batch, dp, dp_rank)
    return {"train_dataloaders": loader, "val_dataloaders": loader}


def trainer_kwargs(out: Path, name: str, accumulate: int, *, resumable: bool = False) -> dict:
    return dict(
        accelerator="cpu",
        max_steps=CKPT_STEPS if resumable else STEPS,
        accumulate_grad_batches=accumulate,
        precision="32-true",
        logger=CSVLogger(out, name=name, version=0),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0 if resumable else 2,
        val_check_interval=accumulate,  # after every optimizer step
    )


class _Export(pl.Callback):
    """``full_model_state_dict()`` before the first step and after the last (and of the decoder module), saved
    by global rank 0."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.states: dict[str, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.states["start"] = trainer.strategy.full_model_state_dict()  # collective

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.states["end"] = trainer.strategy.full_model_state_dict()
        self.states["llm_end"] = trainer.strategy.full_model_state_dict(pl_module.model.llm)
        if trainer.is_global_zero:
            torch.save(self.states, self.path)


def encoder_side(module: EncoderDecoderLM) -> dict[str, torch.Tensor]:
    return {
        f"{part}.{k}": v.detach().clone()
        for part in ("encoder", "projector")
        for k, v in getattr(module.model, part).state_dict().items()
    }


def run_case(out: Path, name: str) -> None:
    from forge_lightning.modules.llm.megatron import unwrap
    from forge_lightning.strategies.megatron import MegatronStrategy
    from forge_lightning.strategies.megatron.optimizer import torch_optimizers

    case = CASES[name]
    module = build_module()
    before = encoder_side(module)
    held: dict[str, object] = {}

    class _Inspect(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            inner = torch_optimizers(trainer.strategy.optimizers[0])
            held["optimizer_params"] = sum(len(g["params"]) for opt in inner for g in opt.param_groups)
            held["optimizer_numel"] = sum(
                p.numel() for opt in inner for g in opt.param_groups for p in g["params"]
            )
            held["recompute"] = unwrap(trainer.strategy._chunks[0]).config.recompute_granularity
            blocks = pl_module.model.encoder.blocks
            held["encoder_recompute"] = all(getattr(b, "_forge_megatron_recompute", False) for b in blocks)

    callbacks: list[pl.Callback] = [_Inspect()]
    kwargs = trainer_kwargs(out, name, case["accumulate"], resumable="checkpoint" in case)
    ckpt_path = None
    if case.get("checkpoint") == "save":
        every = dict(every_n_train_steps=CKPT_AT, save_top_k=-1)
        callbacks += [
            ModelCheckpoint(dirpath=out / f"ckpt_{name}", **every),
            _Export(out / f"{name}_export.pt"),
        ]
        kwargs["enable_checkpointing"] = True
    elif "checkpoint" in case:
        ckpt_path = out / f"ckpt_{case['checkpoint']}" / CKPT
    trainer = pl.Trainer(
        devices=2, strategy=MegatronStrategy(**case["strategy"]), callbacks=callbacks, **kwargs
    )
    tp = case["strategy"].get("tensor_model_parallel_size", 1)
    rank = int(os.environ["RANK"])
    try:
        dp = int(os.environ["WORLD_SIZE"]) // tp
        inputs = fit_data(case["batch"], dp, rank // tp, resumable="checkpoint" in case)
        trainer.fit(module, ckpt_path=ckpt_path, **inputs)
    except Exception as err:
        if not name.startswith("bad_"):
            raise
        if dist.get_rank() == 0:
            (out / f"{name}_error.txt").write_text(f"{type(err).__name__}: {err}")
        return
    after = encoder_side(module)
    torch.save(
        {"before": before, "after": after, **held},
        out / f"{name}_rank{dist.get_rank()}.pt",
    )


def main(out: Path, names: list[str], run: Callable[[Path, str], None] = run_case) -> None:
    """Run the cases ``names`` in order with ``run`` (this worker's, or another worker's on the same harness)."""
    cuda_shim.install()  # here, not at import: test_components.py imports this module into the test session
    faulthandler.dump_traceback_later(240, exit=True)  # a hung collective fails with every thread's stack
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        run(out, name)
    dist.barrier()
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])

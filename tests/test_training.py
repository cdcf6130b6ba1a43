"""End-to-end training on CPU: exact resume, accumulation invariance, the Python API and loggers."""

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from tiny import TINY_LLM

from forge_lightning.datamodules import PretrainDataModule
from forge_lightning.modules.llm import CausalLM
from forge_lightning.optim import OptimizerConfig, SchedulerConfig
from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO

TINY = TINY_LLM


class _Losses(Callback):
    """Collects train/loss after every optimizer step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "train/loss" in trainer.callback_metrics:
            self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])


def _run(corpus, tmp_path, *, max_steps, batch_size=4, accumulate=1, ckpt_path=None, callbacks=(), seed=11):
    torch.manual_seed(seed)
    model = CausalLM.from_config(
        TINY,
        optimizer=OptimizerConfig(lr=3e-3),
        scheduler=SchedulerConfig(name="cosine", warmup_steps=2, total_steps=8),
    )
    data = PretrainDataModule(
        str(corpus["prefix"]),
        str(corpus["tokenizer"]),
        seq_length=32,
        batch_size=batch_size,
        num_workers=0,
        pin_memory=False,
        seed=3,
    )
    losses = _Losses()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[losses, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=tmp_path,
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(model, data, ckpt_path=ckpt_path, weights_only=True)
    return losses.losses, trainer


def test_resume_reproduces_the_uninterrupted_run(tiny_corpus, tmp_path):
    full, _ = _run(tiny_corpus, tmp_path / "full", max_steps=6, accumulate=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=3)
    first, _ = _run(tiny_corpus, tmp_path / "a", max_steps=3, accumulate=2, callbacks=[ckpt])
    second, _ = _run(
        tiny_corpus,
        tmp_path / "b",
        max_steps=6,
        accumulate=2,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
        seed=999,  # a different init seed: everything must come from the checkpoint
    )
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert first == {k: full[k] for k in (1, 2, 3)}
    assert second == {k: full[k] for k in (4, 5, 6)}


def test_accumulation_equals_a_larger_batch(tiny_corpus, tmp_path):
    big, _ = _run(tiny_corpus, tmp_path / "big", max_steps=3, batch_size=4, accumulate=1)
    acc, _ = _run(tiny_corpus, tmp_path / "acc", max_steps=3, batch_size=2, accumulate=2)
    assert sorted(big) == sorted(acc) == [1, 2, 3]
    for step in big:
        assert acc[step] == pytest.approx(big[step], rel=1e-5)


def test_python_api_trains_validates_and_exports(tiny_corpus, tmp_path):
    """The docs/llm.md example: Trainer(...).fit(CausalLM.from_config(...), PretrainDataModule(...))."""
    model = CausalLM.from_config(TINY, optimizer={"lr": 3e-3})
    data = PretrainDataModule(
        str(tiny_corpus["prefix"]),
        str(tiny_corpus["tokenizer"]),
        seq_length=32,
        batch_size=4,
        num_workers=0,
        pin_memory=False,
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=15,
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        log_every_n_steps=1,
        val_check_interval=15,
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        num_sanity_val_steps=-1,
        enable_checkpointing=False,
    )
    trainer.fit(model, data)
    rows = list(csv.DictReader((Path(trainer.log_dir) / "metrics.csv").read_text().splitlines()))
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert val and train and train[-1] < train[0]
    result = trainer.validate(model, data, verbose=False)[0]
    assert result["val/loss"] == pytest.approx(val[-1], rel=1e-5)

    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids), atol=1e-4, rtol=1e-4)


def test_clear_errors_for_bad_data(tiny_corpus, tmp_path):
    data = PretrainDataModule(
        str(tmp_path / "nope"), str(tiny_corpus["tokenizer"]), seq_length=32, batch_size=2
    )
    with pytest.raises(FileNotFoundError, match="forge-data pretrain"):
        data.setup("fit")

    def fit(config, seq_length):
        dm = PretrainDataModule(
            str(tiny_corpus["prefix"]),
            str(tiny_corpus["tokenizer"]),
            seq_length=seq_length,
            batch_size=2,
            num_workers=0,
            pin_memory=False,
        )
        trainer = Trainer(
            accelerator="cpu",
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
        )
        trainer.fit(CausalLM.from_config(config), dm)

    with pytest.raises(ValueError, match=r"tokenizer has \d+ tokens but the model's vocab_size is 100"):
        fit({**TINY, "vocab_size": 100}, 32)
    with pytest.raises(
        ValueError, match=r"seq_length \(512\) is longer than the model's max_position_embeddings"
    ):
        fit(TINY, 512)

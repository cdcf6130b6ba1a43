"""What `forge fit` prints: the progress bar counts optimizer steps, the summary has no uncounted FLOPs, and
the CLI adds both by default without warnings of its own."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from torch.utils.data import DataLoader, TensorDataset

from forge_lightning.callbacks import ForgeModelSummary, StepProgressBar, StepTQDMProgressBar
from forge_lightning.cli import ForgeCLI, main

TINY_YAML = Path(__file__).resolve().parent / "configs" / "tiny_llm.yaml"
BARS = [StepProgressBar, StepTQDMProgressBar]


class _Line(LightningModule):
    """A linear regression over ``num_batches`` micro-batches of one sample: plain DataLoader, so an epoch can
    end in a partial accumulation window."""

    def __init__(self, num_batches: int, example_input: bool = False) -> None:
        super().__init__()
        self.num_batches = num_batches
        self.layer = torch.nn.Linear(4, 1)
        if example_input:
            self.example_input_array = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = self.num_batches
        return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)))


def _train_bar(bar) -> tuple[str, float, int]:
    """(description, total, completed) of a bar's training bar."""
    if isinstance(bar, StepProgressBar):
        task = bar.train_progress_bar
        return task.description.strip(), task.total, int(task.completed)
    tqdm = bar.train_progress_bar
    return tqdm.desc.removesuffix(": "), tqdm.total, tqdm.n


class _Probe(Callback):
    """Reads the bar after each of its updates (it runs after the bar: later in the callback list)."""

    def __init__(self, bar) -> None:
        self.bar = bar
        self.epoch_starts: list[tuple[str, float, int]] = []
        self.batches: list[tuple[str, float, int]] = []
        self.steps: list[int] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.epoch_starts.append(_train_bar(self.bar))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(_train_bar(self.bar))
        self.steps.append(trainer.global_step)


def _fit(bar_cls, num_batches, ckpt_path=None, callbacks=(), **trainer_kwargs) -> tuple[Trainer, _Probe]:
    bar = bar_cls()
    probe = _Probe(bar)
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_model_summary=False,
        callbacks=[bar, probe, *callbacks],
        **trainer_kwargs,
    )
    trainer.fit(_Line(num_batches), ckpt_path=ckpt_path)
    return trainer, probe


@pytest.mark.parametrize("bar_cls", BARS)
def test_bar_counts_optimizer_steps_against_max_steps(bar_cls):
    trainer, probe = _fit(bar_cls, num_batches=10, max_steps=3, accumulate_grad_batches=2)
    assert trainer.global_step == 3
    # One optimizer step per 2 micro-batches, counted against max_steps (Lightning's bar: micro-batches).
    assert probe.batches == [("Epoch 1", 3, c) for c in (0, 1, 1, 2, 2, 3)]
    assert [c for _, _, c in probe.batches] == probe.steps
    assert _train_bar(probe.bar) == ("Epoch 1", 3, 3)


@pytest.mark.parametrize("bar_cls", BARS)
def test_bar_counts_steps_of_each_epoch_with_a_partial_last_window(bar_cls):
    # 5 micro-batches, 2 per step: steps after micro-batches 2, 4 and 5 (the partial window), 3 per epoch.
    trainer, probe = _fit(bar_cls, num_batches=5, max_epochs=2, accumulate_grad_batches=2)
    assert trainer.global_step == 6
    assert probe.batches == [(f"Epoch {e}/2", 3, c) for e in (1, 2) for c in (0, 1, 1, 2, 3)]
    assert probe.epoch_starts == [("Epoch 1/2", 3, 0), ("Epoch 2/2", 3, 0)]


@pytest.mark.parametrize("bar_cls", BARS)
def test_max_steps_shortens_the_last_epoch_of_a_max_epochs_run(bar_cls):
    trainer, probe = _fit(bar_cls, num_batches=5, max_epochs=3, max_steps=4, accumulate_grad_batches=2)
    assert trainer.global_step == 4
    assert probe.epoch_starts == [("Epoch 1/3", 3, 0), ("Epoch 2/3", 1, 0)]
    assert probe.batches[-1] == ("Epoch 2/3", 1, 1)


@pytest.mark.parametrize("bar_cls", BARS)
@pytest.mark.parametrize("saved", ["mid-epoch", "after-fit"])
def test_resumed_run_starts_at_the_restored_step(bar_cls, saved, tmp_path):
    # Step 2 ends at micro-batch 4 of an epoch of 10.
    saver = ModelCheckpoint(tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    first, _ = _fit(bar_cls, 10, max_steps=2, accumulate_grad_batches=2, callbacks=[saver])
    if saved == "after-fit":
        first.save_checkpoint(tmp_path / "step=2.ckpt")  # Lightning then resumes into the next epoch
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*dataloader is not resumable")
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
        trainer, probe = _fit(
            bar_cls, 10, ckpt_path=tmp_path / "step=2.ckpt", max_steps=4, accumulate_grad_batches=2
        )
    assert trainer.global_step == 4
    epoch = "Epoch 1" if saved == "mid-epoch" else "Epoch 2"
    assert probe.batches == [(epoch, 4, c) for c in (2, 3, 3, 4)]
    assert [c for _, _, c in probe.batches] == probe.steps
    # Mid-epoch, Lightning does not start the epoch again: the bar appears at the first batch.
    assert probe.epoch_starts == ([] if saved == "mid-epoch" else [("Epoch 2", 4, 2)])


def _summary_text(capsys, example_input: bool) -> str:
    capsys.readouterr()
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[ForgeModelSummary()],
        max_steps=1,
    )
    trainer.fit(_Line(2, example_input=example_input))
    return capsys.readouterr().out


def test_summary_leaves_out_flops_nothing_counted(capsys):
    out = _summary_text(capsys, example_input=False)
    assert "Total params: 5" in out and "Trainable params: 5" in out and "Modules in train mode: 1" in out
    assert "FLOPs" not in out
    # With an example input Lightning counts the forward's FLOPs: 2 x 4 inputs x 1 output x 2 (multiply-add).
    out = _summary_text(capsys, example_input=True)
    assert "Total FLOPs: 16" in out


def _cli_args(corpus, *extra, show="true"):
    """The tiny LLM run, 3 steps of 2 micro-batches; ``show``: enable_progress_bar and enable_model_summary."""
    return [
        "fit",
        "--config",
        str(TINY_YAML),
        "--data.data_prefix",
        str(corpus["prefix"]),
        "--data.tokenizer",
        str(corpus["tokenizer"]),
        "--trainer.enable_progress_bar",
        show,
        "--trainer.enable_model_summary",
        show,
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.accumulate_grad_batches",
        "2",
        "--trainer.max_steps",
        "3",
        *extra,
    ]


def test_forge_fit_adds_the_step_bar_and_summary(tiny_corpus, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["host", "--host-option"])  # a host program with its own arguments
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = ForgeCLI(args=_cli_args(tiny_corpus))
    assert not [w for w in caught if "args parameter" in str(w.message)]
    bar = cli.trainer.progress_bar_callback
    assert type(bar) is StepProgressBar
    assert cli.trainer.global_step == 3
    assert _train_bar(bar) == ("Epoch 1", 3, 3)
    assert bar.val_progress_bar.total == 2  # Lightning's validation bar: limit_val_batches batches
    assert [type(cb) for cb in cli.trainer.callbacks if isinstance(cb, ModelSummary)] == [ForgeModelSummary]
    out = capsys.readouterr().out
    assert "Total params" in out and "FLOPs" not in out
    assert "Skipping setting a default `ModelSummary`" not in caplog.text


def test_barebones_gets_no_default_bar_or_summary(tiny_corpus, tmp_path, monkeypatch):
    # Lightning refuses a progress bar under barebones: adding the default one broke `--trainer.barebones true`.
    monkeypatch.chdir(tmp_path)
    barebones = ["--trainer.barebones", "true", "--trainer.log_every_n_steps", "0"]
    cli = ForgeCLI(args=_cli_args(tiny_corpus, *barebones, show="null"))
    assert cli.trainer.global_step == 3 and cli.trainer.progress_bar_callback is None
    assert not [cb for cb in cli.trainer.callbacks if isinstance(cb, ModelSummary)]


def test_main_reads_sys_argv_and_main_args_do_not_warn(tiny_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv, args in (
        (["forge", *_cli_args(tiny_corpus)], None),  # the `forge` command
        (["host", "--host-option"], _cli_args(tiny_corpus)),  # main(args=[...]) from Python
    ):
        monkeypatch.setattr(sys, "argv", argv)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            main(args)
        assert not [w for w in caught if "args parameter" in str(w.message)]
        # The bar left on the terminal (rich prints its last state when stdout is not a terminal).
        assert "Epoch 1" in (out := capsys.readouterr().out) and " 3/3 " in out

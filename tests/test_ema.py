"""The EMA callback: the average follows its formula, evaluation uses it, a resumed run continues it."""

import lightning.pytorch as pl
import pytest
import torch
from tiny import TINY_LLM
from torch.utils.data import DataLoader

from forge_lightning.callbacks.ema import EMA
from forge_lightning.modules.llm import CausalLM


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
        self.val_weights: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(self.frozen(x)), y)

    def validation_step(self, batch, batch_idx):
        self.val_weights.append(self.layer.weight.detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _RecordWeights(pl.Callback):
    def __init__(self) -> None:
        self.after_step: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after_step.append(pl_module.layer.weight.detach().clone())


def _data(n: int = 16):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    return DataLoader(list(zip(x, x.sum(-1, keepdim=True))), batch_size=4)


def _trainer(tmp_path, callbacks, steps, **kwargs):
    return pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, callbacks=callbacks, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


def test_average_follows_the_formula_and_evaluation_uses_it(tmp_path):
    torch.manual_seed(0)
    module, ema, record = _Regression(), EMA(decay=0.5, start_step=1), _RecordWeights()
    initial = module.layer.weight.detach().clone()
    trainer = _trainer(tmp_path, [ema, record], steps=4, val_check_interval=4, limit_val_batches=1)
    trainer.fit(module, _data(), _data())
    expected = initial
    for step, weight in enumerate(record.after_step, start=1):
        expected = weight if step <= 1 else 0.5 * expected + 0.5 * weight
    got = dict(zip(ema.names, ema.average))["layer.weight"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)
    assert "frozen.weight" not in ema.names  # only trainable parameters are averaged
    torch.testing.assert_close(module.val_weights[-1], expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(module.layer.weight, record.after_step[-1])  # training weights swapped back


def test_resume_continues_the_same_average(tmp_path):
    # One batch per epoch: however the loop resumes its epoch, every step sees the same batch.
    torch.manual_seed(0)
    straight = EMA(decay=0.9)
    _trainer(tmp_path / "a", [straight], steps=4).fit(_Regression(), _data(4))
    torch.manual_seed(0)
    first = EMA(decay=0.9)
    trainer = _trainer(tmp_path / "b", [first], steps=2)
    trainer.fit(_Regression(), _data(4))
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    torch.manual_seed(1)  # the weights come from the checkpoint, not from this seed
    resumed = EMA(decay=0.9)
    _trainer(tmp_path / "c", [resumed], steps=4).fit(
        _Regression(), _data(4), ckpt_path=tmp_path / "half.ckpt"
    )
    for a, b in zip(straight.average, resumed.average, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_bad_options_and_sharded_strategies_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"EMA decay \(1.5\) must be in \(0, 1\)"):
        EMA(decay=1.5)
    from forge_lightning.strategies import FSDP2Strategy

    batch = {"input_ids": torch.randint(0, 512, (2, 8)), "labels": torch.randint(0, 512, (2, 8))}
    trainer = _trainer(tmp_path, [EMA()], steps=1, strategy=FSDP2Strategy(), devices=1)
    with pytest.raises(ValueError, match="EMA needs whole parameters on every rank"):
        trainer.fit(CausalLM(config=TINY_LLM), DataLoader([batch], batch_size=None))

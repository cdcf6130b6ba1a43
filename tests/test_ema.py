"""The EMA callback: the average follows its formula, evaluation uses it, a resumed run continues it; it averages
the tensors a strategy declares it trains (``TrainedParameters``) instead of the module's; under FSDP2 / HSDP (2 gloo
processes, ``ema_worker.py``) it equals the single-process average and its DCP checkpoint resumes exactly, at
another world size too. Under MegatronStrategy (TP 2): tests/test_callbacks_strategies.py."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import ema_worker
import lightning.pytorch as pl
import pytest
import torch
from procs import assert_clean_exit
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader

from forge_lightning.callbacks.ema import EMA

WORKER = Path(__file__).with_name("ema_worker.py")


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


class _TwinStrategy:
    """Stands for a strategy that trains other tensors than the module's (MegatronStrategy's twin chunks)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.tensors.items())


def test_average_follows_the_strategys_trained_parameters_not_the_modules():
    module, twin = _Regression(), {"model0.layer.weight": torch.zeros(1, 4)}
    module_weight = module.layer.weight.detach().clone()
    trainer = SimpleNamespace(strategy=_TwinStrategy(twin), global_step=0)
    ema = EMA(decay=0.5)
    ema.on_fit_start(trainer, module)
    assert ema.names == ["model0.layer.weight"]
    for step, value in ((1, 2.0), (2, 4.0)):  # the strategy's optimizer steps the twin's tensor
        twin["model0.layer.weight"].fill_(value)
        trainer.global_step = step
        ema.on_train_batch_end(trainer, module, None, None, 0)
    expected = torch.full((1, 4), 2.5)  # 0 -> 0.5 * 0 + 0.5 * 2 = 1 -> 0.5 * 1 + 0.5 * 4
    torch.testing.assert_close(ema.average[0], expected, rtol=0, atol=0)
    with ema.averaged(trainer, module):  # evaluation / export on the average: written into the twin's tensor
        torch.testing.assert_close(twin["model0.layer.weight"], expected, rtol=0, atol=0)
    torch.testing.assert_close(twin["model0.layer.weight"], torch.full((1, 4), 4.0), rtol=0, atol=0)
    torch.testing.assert_close(module.layer.weight, module_weight, rtol=0, atol=0)  # never read nor written
    assert ema.state_dict()["average"].keys() == {
        "model0.layer.weight"
    }  # per-parameter state, strategy names


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match=r"EMA decay \(1.5\) must be in \(0, 1\)"):
        EMA(decay=1.5)
    with pytest.raises(ValueError, match=r"EMA update_every \(0\) must be >= 1"):
        EMA(update_every=0)


# ----- FSDP2 / HSDP: the average is sharded like the parameters -------------------------------------------------
@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    """The worker's runs (2 processes, then 1) and the single-process reference of the same run, in-process."""
    root = tmp_path_factory.mktemp("ema_fsdp2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mode in ("fsdp2", "one"):
        proc = subprocess.run(
            [sys.executable, str(WORKER), mode, str(root)], cwd=WORKER.parent, env=env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert_clean_exit(proc)
        assert "ema_worker: done" in proc.stdout, (proc.stdout + proc.stderr)[-6000:]
    runs = {
        name: torch.load(root / f"{name}.pt", weights_only=True)
        for name in ("first", "resumed", "hsdp", "one")
    }
    runs["reference"] = ema_worker.fit(root / "reference")
    runs["root"] = root
    return runs


def _assert_all_close(got: dict, expected: dict, atol: float) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol, msg=name)


def test_fsdp2_average_equals_one_process_and_evaluation_uses_it(fsdp2_runs):
    first, reference = fsdp2_runs["first"], fsdp2_runs["reference"]
    _assert_all_close(first["average"], reference["average"], atol=1e-6)  # measured 2.9e-7
    # Validated on the average (on the training weights the losses differ by 0.4-0.8 from step 2 on), and the
    # training weights were swapped back: FSDP2 keeps the root's gathered parameters after an evaluation forward,
    # and training on them would leave the weights 0.3 away.
    assert first["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
    _assert_all_close(first["weights"], reference["weights"], atol=2e-6)  # measured 7.2e-7


def test_fsdp2_resume_continues_the_average_exactly(fsdp2_runs):
    first, resumed = fsdp2_runs["first"], fsdp2_runs["resumed"]
    _assert_all_close(resumed["loaded"], first["loaded"], atol=0)  # the average after step 2, as saved
    _assert_all_close(resumed["average"], first["average"], atol=0)
    _assert_all_close(resumed["weights"], first["weights"], atol=0)
    assert resumed["val_loss"] == first["val_loss"][2:]
    # The average went through DCP, one entry per tensor; meta.pt holds only its stand-ins.
    ckpt = fsdp2_runs["root"] / "ckpt" / "step=2.ckpt"
    saved = torch.load(ckpt / "meta.pt", weights_only=True)["callbacks"]["EMA"]["average"]
    assert saved == {name: f"dcp:callbacks/EMA/average/{name}" for name in first["average"]}
    entries = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert {f"callbacks/EMA/average/{name}" for name in first["average"]} <= set(entries)


@pytest.mark.parametrize("run", ["one", "hsdp"])
def test_fsdp2_checkpoint_loads_at_another_world_size_and_layout(fsdp2_runs, run):
    # Written by 2 processes (FSDP over 2) and read by 1 process, or by HSDP (replicate 2 x shard 1): DCP reshards.
    first, got = fsdp2_runs["first"], fsdp2_runs[run]
    _assert_all_close(got["loaded"], first["loaded"], atol=0)
    _assert_all_close(got["average"], fsdp2_runs["reference"]["average"], atol=1e-6)

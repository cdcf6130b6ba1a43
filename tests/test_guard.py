"""NonFiniteGuard: a step with a NaN / inf loss or gradients leaves the weights and the optimizer state as they were,
spikes are logged (and skipped when asked), a run of bad steps stops with an error naming the newest checkpoint, and
no checkpoint or export is written from weights that are not finite. Multi-process (DDP, FSDP2, MegatronStrategy)
runs: tests/family/test_contract_family.py (a NaN sample on one rank)."""

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from forge_lightning.callbacks import NonFiniteGuard
from forge_lightning.modules.objective import GlobalBatchLoss


class _Regression(pl.LightningModule):
    """A linear regression whose step losses are scaled by ``factors[step]`` (NaN / inf / a spike)."""

    def __init__(self, factors: dict[int, float] | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.factors = factors or {}
        self.objective = GlobalBatchLoss()
        self.weights: dict[int, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss_sum = ((self.layer(x).squeeze(-1) - y) ** 2).sum() * self.factors.get(self.global_step, 1.0)
        count = torch.tensor(float(len(y)))
        self.objective.record_train(torch.stack([loss_sum.detach().double(), count.double()]))
        return loss_sum / count

    def step_loss_sums(self):
        return self.objective.pending_train()

    def on_before_optimizer_step(self, optimizer):
        self.objective.log_train(self)

    def on_train_batch_end(self, *args):
        self.weights[self.global_step] = self.layer.weight.detach().clone()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        return DataLoader(list(zip(x, x.sum(-1), strict=True)), batch_size=4)


def _fit(module, guard, tmp_path, steps=6, **trainer_kwargs):
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[guard, *trainer_kwargs.pop("callbacks", [])],
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(module)
    return trainer


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_step_leaves_weights_and_adam_state_unchanged(tmp_path, bad):
    module = _Regression({2: bad})
    guard = NonFiniteGuard()
    with pytest.warns(UserWarning, match="step 2 not applied"):
        trainer = _fit(module, guard, tmp_path, enable_checkpointing=False)
    assert torch.equal(
        module.weights[3], module.weights[2]
    )  # the step that ended at global step 3 changed nothing
    assert not torch.equal(module.weights[4], module.weights[3])  # the next one trains again
    adam = trainer.optimizers[0]
    assert all(state["step"].item() == 5 for state in adam.state.values())  # 6 steps, one skipped
    assert guard.skipped == 1 and guard.consecutive == 0
    assert trainer.global_step == 6


def test_bad_steps_in_a_row_stop_the_run_and_name_the_newest_checkpoint(tmp_path):
    module = _Regression({s: math.nan for s in range(3, 20)})
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    stops = pytest.raises(RuntimeError, match=r"3 optimizer steps in a row .*step=4\.ckpt")
    with stops as err, pytest.warns(UserWarning, match="not applied"):
        _fit(module, NonFiniteGuard(max_consecutive=3), tmp_path, steps=20, callbacks=[checkpoint])
    assert "the last at step 5" in str(err.value)
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
    ]  # finite weights: skipped steps keep them so
    state = torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=True)["state_dict"]
    assert all(torch.isfinite(t).all() for t in state.values())


def test_a_spike_is_logged_and_skipped_only_when_asked(tmp_path):
    with pytest.warns(UserWarning, match=r"loss spike at step 5: loss .* the running median"):
        module = _Regression({5: 1e4})
        _fit(module, NonFiniteGuard(spike_factor=10, spike_window=3), tmp_path, enable_checkpointing=False)
    assert not torch.equal(module.weights[6], module.weights[5])
    skipping = _Regression({5: 1e4})
    guard = NonFiniteGuard(spike_factor=10, spike_window=3, skip_spikes=True)
    with pytest.warns(UserWarning, match="step 5 not applied: loss spike"):
        _fit(skipping, guard, tmp_path, enable_checkpointing=False)
    assert torch.equal(skipping.weights[6], skipping.weights[5]) and guard.skipped == 1


def test_a_checkpoint_of_weights_that_are_not_finite_is_refused(tmp_path):
    module = _Regression()
    trainer = _fit(module, NonFiniteGuard(), tmp_path, steps=1, enable_checkpointing=False)
    with torch.no_grad():
        module.layer.weight[0, 1] = math.nan
    with pytest.raises(
        RuntimeError, match=r"not writing the checkpoint: the weights are not finite \(here: \['layer"
    ):
        trainer.save_checkpoint(tmp_path / "nan.ckpt")
    assert not (tmp_path / "nan.ckpt").exists()


def test_a_disabled_guard_applies_every_step(tmp_path):
    module = _Regression({2: math.nan})
    _fit(module, NonFiniteGuard(enabled=False), tmp_path, enable_checkpointing=False)
    assert torch.isnan(module.weights[3]).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_consecutive": -1}, "max_consecutive must be >= 0"),
        ({"spike_factor": 0.5}, "spike_factor must be above 1"),
        ({"skip_spikes": True}, "skip_spikes needs spike_factor"),
    ],
)
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NonFiniteGuard(**kwargs)

import math

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from forge_lightning.optim import OptimizerConfig, SchedulerConfig, build_optimizer, lr_lambda, param_groups
from forge_lightning.optim.clipping import UnscaledGradientClipping


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4, bias=True)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_param_groups_decay_only_matrices():
    model = _Tiny()
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model.proj.weight)}
    expected = {id(model.embed.weight), id(model.proj.bias), id(model.norm.weight), id(model.norm.bias)}
    assert {id(p) for p in no_decay["params"]} == expected  # tied head counted once, frozen excluded


def test_param_groups_decay_all():
    groups = param_groups(_Tiny(), weight_decay=0.1, decay_all=True)
    assert len(groups) == 1 and len(groups[0]["params"]) == 5


def test_build_optimizer_foreach_on_cpu_and_errors():
    opt = build_optimizer(_Tiny(), OptimizerConfig(lr=1e-3))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["foreach"] is True
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(frozen, OptimizerConfig())
    with pytest.raises(ValueError, match=r"optimizer.name \('lion'\)"):
        OptimizerConfig(name="lion")


def test_cosine_schedule_values():
    cfg = SchedulerConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    total = 110
    assert lr_lambda(0, cfg, total) == pytest.approx(0.1)
    assert lr_lambda(9, cfg, total) == pytest.approx(1.0)
    assert lr_lambda(10, cfg, total) == pytest.approx(1.0)
    assert lr_lambda(60, cfg, total) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_lambda(110, cfg, total) == pytest.approx(0.1)


def test_wsd_and_constant_schedules():
    wsd = SchedulerConfig(name="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0)
    total = 100
    assert lr_lambda(50, wsd, total) == 1.0
    assert lr_lambda(79, wsd, total) == 1.0
    assert lr_lambda(90, wsd, total) == pytest.approx(0.5)
    assert lr_lambda(100, wsd, total) == pytest.approx(0.0)
    const = SchedulerConfig(name="constant", warmup_steps=4)
    assert [lr_lambda(s, const, 50) for s in (0, 3, 40)] == [0.25, 1.0, 1.0]
    sqrt = SchedulerConfig(name="wsd", decay_fraction=1.0, decay_shape="sqrt", min_lr_ratio=0.0)
    assert lr_lambda(25, sqrt, 100) == pytest.approx(1 - math.sqrt(0.25))
    with pytest.raises(ValueError, match="scheduler.name"):
        SchedulerConfig(name="step")


class _ClippedFused(UnscaledGradientClipping, LightningModule):
    """A linear model with large gradients, trained with fused AdamW; records the gradient norm at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        return (self.layer(batch[0]) * 100.0).square().mean()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)
        optimizer.register_step_post_hook(
            lambda opt, args, kwargs: self.norms.append(
                float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters()])))
            )
        )
        return optimizer


def test_gradient_clipping_with_a_fused_optimizer_under_bf16_autocast(tmp_path):
    """Lightning's mixed-precision plugin refuses to clip for fused optimizers; without a scaler it is exact."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    model = _ClippedFused()
    trainer = Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        gradient_clip_val=0.5,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data)
    assert len(model.norms) == 3
    assert all(norm == pytest.approx(0.5, rel=1e-3) for norm in model.norms)

import math

import pytest
import torch
from torch import nn

from forge_lightning.optim import OptimizerConfig, SchedulerConfig, build_optimizer, lr_lambda, param_groups


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

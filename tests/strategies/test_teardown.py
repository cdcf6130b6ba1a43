"""The strategies' teardown drops the optimizer state instead of copying it to host memory (Lightning's default:
15 s for a 1B model with Adam on one H200), a ZeroRedundancyOptimizer's local shard included."""

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from forge_lightning.strategies.ddp import DDPStrategy, release_optimizer_state


def _stepped(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return optimizer


def test_release_drops_adam_state_behind_a_lightning_optimizer():
    model = nn.Linear(4, 4)
    adam = _stepped(torch.optim.AdamW(model.parameters()), model)
    assert len(adam.state) == 2
    release_optimizer_state([LightningOptimizer(adam)])
    assert len(adam.state) == 0
    assert adam.param_groups[0]["params"][0] is model.weight  # the groups stay: only the state goes


def test_release_drops_a_zero_redundancy_optimizers_local_shard(one_process_group):
    model = nn.Linear(4, 4)
    zero = _stepped(ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW), model)
    assert len(zero.optim.state) == 2
    release_optimizer_state([zero])
    assert len(zero.optim.state) == 0 and len(zero.state) == 0


def test_ddp_teardown_releases_before_lightnings_copy_to_host(monkeypatch):
    model = nn.Linear(4, 4)
    adam = _stepped(torch.optim.AdamW(model.parameters()), model)
    strategy = DDPStrategy()
    strategy.optimizers = [adam]
    seen = []
    monkeypatch.setattr(
        "lightning.pytorch.strategies.DDPStrategy.teardown", lambda self: seen.append(len(adam.state))
    )
    strategy.teardown()
    assert seen == [0]

"""Re-initialisation by ownership (``modules/layers/init.py``): torch layers are left to the block that owns them."""

from __future__ import annotations

import torch
from torch import nn

from forge_lightning.modules.layers import OWNED_LAYERS, reset_owned_parameters


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.conv = nn.Conv2d(1, 2, 2)
        self.norm = nn.LayerNorm(4)
        self.calls = 0

    def reset_parameters(self) -> None:
        self.calls += 1
        nn.init.constant_(self.proj.weight, 0.5)


def test_owned_layers_are_reset_by_their_owner_only():
    block = _Block()
    conv = block.conv.weight.clone()
    with torch.no_grad():
        block.norm.weight.fill_(3.0)
    reset_owned_parameters(block.modules())
    assert block.calls == 1 and torch.all(block.proj.weight == 0.5)  # the owner's scheme, not Kaiming's
    assert torch.equal(block.conv.weight, conv)  # an owned layer: left alone
    assert torch.all(block.norm.weight == 1.0)  # not an owned type: its own reset runs
    assert {nn.Linear, nn.Embedding, nn.Conv2d, nn.Conv3d} == set(OWNED_LAYERS)

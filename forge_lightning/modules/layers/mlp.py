"""Feed-forward blocks."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class GatedMLP(nn.Module):
    """SwiGLU feed-forward block: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Shazeer, 2020).

    Args:
        hidden_size: model width.
        intermediate_size: width of the gated hidden layer.
        bias: whether the three projections carry a bias.
        init_std: standard deviation of the normal initialisation of the projection weights.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, bias: bool = False, init_std: float = 0.02
    ) -> None:
        super().__init__()
        self.init_std = init_std
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (self.gate_proj, self.up_proj, self.down_proj):
            init_linear(proj, self.init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def init_linear(linear: nn.Linear, std: float) -> None:
    """Initialise a linear layer the Hugging Face way: weight ~ N(0, std), bias = 0.

    Args:
        linear: the layer to initialise in place.
        std: standard deviation of the weight.
    """
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)

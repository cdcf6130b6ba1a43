"""Activations named as in Hugging Face ``config.json`` files (``hidden_act``, ``projector_hidden_act``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: the sigmoid approximation of GELU that CLIP was trained with (``quick_gelu``)."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,  # the exact (erf) GELU
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "quick_gelu": QuickGELU,
}
"""Activation modules by their Hugging Face name."""


def activation(name: str, field: str) -> nn.Module:
    """The activation called ``name`` in a config; ``field`` names the config field in the error.

    Raises:
        ValueError: ``name`` is not in :data:`ACTIVATIONS`.
    """
    if name not in ACTIVATIONS:
        raise ValueError(f"{field} ({name!r}) is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]()

"""Re-initialisation by ownership: each block initialises the torch layers it owns in its ``reset_parameters``."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

OWNED_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding, nn.Conv2d, nn.Conv3d)
"""torch layers whose own ``reset_parameters`` (Kaiming-uniform, N(0, 1)) is never used: their owner draws them."""


def reset_owned_parameters(modules: Iterable[nn.Module]) -> None:
    """Call ``reset_parameters`` of every module in ``modules`` that has one, except the layers of
    :data:`OWNED_LAYERS` (initialised by the block that owns them), in the order given.

    Args:
        modules: the modules to re-initialise, usually ``model.modules()``.
    """
    for module in modules:
        if not isinstance(module, OWNED_LAYERS) and hasattr(module, "reset_parameters"):
            module.reset_parameters()

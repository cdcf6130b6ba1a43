"""Materialize a module built on the meta device with the initialisation its model defines.

Lightning's ``_materialize_distributed_module`` calls ``reset_parameters()`` on every submodule that holds
parameters, so ``nn.Linear`` layers get torch's Kaiming-uniform draw instead of the model's own scheme (e.g.
``N(0, initializer_range)`` for decoder LMs), and a model trained from scratch would start from different weights
under a sharded strategy than under DDP. Here a submodule with an ``init_weights()`` method initialises its whole
subtree; the remaining submodules with parameters or buffers of their own fall back to ``reset_parameters()``.
"""

from __future__ import annotations

import itertools

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def materialize_module(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s meta tensors on ``device`` and initialise them (no-op without meta tensors).

    Args:
        module: the root module (``to_empty`` must run on the root so shared parameters stay shared).
        device: where to allocate.
    """
    if not has_meta_tensors(module):
        return
    module.to_empty(device=device)
    covered: set[nn.Module] = set()
    uninitialized: set[str] = set()
    for sub in module.modules():
        if sub in covered:
            continue
        init_weights = getattr(sub, "init_weights", None)
        if callable(init_weights):
            init_weights()
            covered.update(sub.modules())
            continue
        if not any(True for _ in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
            continue
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            uninitialized.add(type(sub).__name__)
    if uninitialized:
        rank_zero_warn(
            "these modules hold parameters or buffers but define neither init_weights() nor reset_parameters(), "
            f"so they keep uninitialised memory after meta-device materialization: {', '.join(sorted(uninitialized))}"
        )

"""Strict copies of checkpoint tensors into a module, with every mismatch named."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn


def load_exact(
    module: nn.Module,
    weights: Mapping[str, Tensor],
    *,
    what: str,
    owner: str = "encoder",
) -> None:
    """Copy ``weights`` (named as in ``module.state_dict()``) into ``module``.

    Args:
        module: the component to fill.
        weights: its tensors.
        what: what the tensors are, for the error message.
        owner: what ``module`` is, for the error message.

    Raises:
        ValueError: entries are missing, unexpected or of another shape (the message names up to 8 of each).
    """
    own = module.state_dict()
    missing, unexpected = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
    reshaped = [
        f"{k} {list(weights[k].shape)} ({owner}: {list(own[k].shape)})"
        for k in sorted(own.keys() & weights.keys())
        if weights[k].shape != own[k].shape
    ]
    if missing or unexpected or reshaped:
        problems = {"missing": missing, "unexpected": unexpected, "of another shape": reshaped}
        detail = "; ".join(f"{kind}: {', '.join(keys[:8])}" for kind, keys in problems.items() if keys)
        raise ValueError(f"{what} do not fit the {owner}'s config ({detail})")
    module.load_state_dict(weights)

"""Muon's orthogonalisation: the quintic Newton-Schulz iteration over a matrix or a stack of matrices, and the
learning-rate adjustment by matrix shape.

Both follow ``torch.optim.Muon`` (Keller Jordan's coefficients, https://kellerjordan.github.io/posts/muon/): one
2-D matrix gives the same numbers as torch's ``_zeropower_via_newtonschulz``; a stack ``[..., m, n]`` runs the same
iteration on every matrix at once (batched matmuls).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def check_newton_schulz_args(steps: int, coefficients: Sequence[float], eps: float) -> None:
    """Raise a ValueError naming the first bad Newton-Schulz argument."""
    if not isinstance(steps, int) or not 1 <= steps < 100:
        raise ValueError(f"ns_steps ({steps}) must be an integer in [1, 100); Muon's default is 5")
    if len(coefficients) != 3:
        raise ValueError(
            f"ns_coefficients ({tuple(coefficients)}) must be three numbers (a, b, c); "
            "Muon's default is (3.4445, -4.7750, 2.0315)"
        )
    if not eps > 0:
        raise ValueError(f"eps ({eps}) must be positive; Muon's default is 1e-7")


def newton_schulz(
    x: Tensor,
    steps: int = 5,
    coefficients: Sequence[float] = (3.4445, -4.7750, 2.0315),
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """An approximately orthogonal ``U S' V^T`` (``S'`` near 1) of each matrix of ``x`` (``[..., m, n]``), in
    ``dtype``.

    Each matrix is cast to ``dtype``, transposed when it has more rows than columns, divided by its Frobenius norm
    (clamped below by ``eps``), run through ``steps`` quintic iterations ``X <- a X + (b A + c A^2) X`` with
    ``A = X X^T``, and transposed back. ``x`` itself is never modified.

    Args:
        x: a matrix ``[m, n]`` or a stack ``[..., m, n]``.
        steps: iterations (Muon uses 5).
        coefficients: ``(a, b, c)`` of the quintic.
        eps: lower bound of the norm the input is divided by.
        dtype: the dtype the iteration runs in (bfloat16, like torch's Muon; float32 for a precise reference).
    """
    check_newton_schulz_args(steps, coefficients, eps)
    if x.ndim < 2:
        raise ValueError(
            f"newton_schulz needs a matrix or a stack of matrices [..., m, n], got shape {tuple(x.shape)}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"ns dtype ({dtype}) must be a floating-point dtype, e.g. torch.bfloat16")
    a, b, c = coefficients
    shape = x.shape
    tall = shape[-2] > shape[-1]
    if x.ndim == 2:
        return _iterate_2d(x.to(dtype), tall, a, b, c, steps, eps)
    x_BMN = x.to(dtype).reshape(-1, shape[-2], shape[-1])
    return _iterate_3d(x_BMN, tall, a, b, c, steps, eps).reshape(shape)


def _iterate_2d(x: Tensor, tall: bool, a: float, b: float, c: float, steps: int, eps: float) -> Tensor:
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def _iterate_3d(x_BMN: Tensor, tall: bool, a: float, b: float, c: float, steps: int, eps: float) -> Tensor:
    if tall:
        x_BMN = x_BMN.mT
    norms_B11 = torch.linalg.vector_norm(x_BMN, dim=(-2, -1), keepdim=True)
    x_BMN = x_BMN / norms_B11.clamp(min=eps)
    for _ in range(steps):
        gram_BMM = x_BMN @ x_BMN.mT
        update_BMM = torch.baddbmm(gram_BMM, gram_BMM, gram_BMM, beta=b, alpha=c)
        x_BMN = torch.baddbmm(x_BMN, update_BMM, x_BMN, beta=a)
    return x_BMN.mT if tall else x_BMN


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The learning rate of a ``rows x cols`` matrix's orthogonalised update (torch's ``_adjust_lr``).

    ``None`` / ``"original"``: ``lr * sqrt(max(1, rows / cols))`` (Keller Jordan's); ``"match_rms_adamw"``:
    ``lr * 0.2 * sqrt(max(rows, cols))`` (Moonshot, https://arxiv.org/abs/2502.16982), so AdamW's lr and weight
    decay carry over.
    """
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(
            f"adjust_lr_fn ({adjust_lr_fn!r}) must be one of None, 'original', 'match_rms_adamw'"
        )
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1, rows / cols))

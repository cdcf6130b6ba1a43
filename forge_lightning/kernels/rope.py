"""Rotary position embeddings (Su et al., "RoFormer", 2021) in the HF rotate-half convention.

For ``r = rotary_dim`` and the first ``r`` channels of each head split into halves ``x1, x2``::

    out[:r]  = x[:r] * cos + rotate_half(x[:r]) * sin,   rotate_half(x) = cat(-x2, x1)
    out[r:]  = x[r:]                                     (partial rotary: the rest passes through)

``cos`` / ``sin`` come from :func:`rope_cos_sin` (shared by both backends), so frequency scaling such as
Llama 3's lives there and the kernel only rotates. The Triton path handles one (batch, position) per
program, all heads at once, and computes in fp32 with one rounding to the input dtype; its backward is the
same rotation by the negative angle.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from forge_lightning.kernels._dispatch import (
    Backend,
    next_power_of_2,
    num_warps_for,
    tl,
    triton_kernel,
    use_triton,
)

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp."""
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"llama3 rope scaling needs keys {missing}; got {sorted(scaling)}")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # ramp = 0 at wavelen = old_context / low (fully scaled), 1 at wavelen = old_context / high (unscaled).
    ramp = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - ramp) * inv_freq / factor + ramp * inv_freq


def rope_cos_sin(
    position_ids: torch.Tensor,
    dim: int,
    theta: float = 10000.0,
    scaling: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary ``cos`` / ``sin`` tables for :func:`apply_rope`, computed in fp32.

    Args:
        position_ids: integer positions ``[batch, seq]`` (or ``[seq]``, treated as batch 1).
        dim: the rotary dim (``head_dim`` for full rotary); must be even.
        theta: the RoPE base.
        scaling: ``None`` (default RoPE) or an HF-style ``rope_scaling`` dict whose ``"rope_type"`` (or
            legacy ``"type"``) is ``"default"``, ``"linear"`` (needs ``"factor"``: positions are divided by
            it) or ``"llama3"`` (needs ``"factor"``, ``"low_freq_factor"``, ``"high_freq_factor"``,
            ``"original_max_position_embeddings"``).

    Returns:
        ``(cos, sin)``, each fp32 ``[batch, seq, dim]`` on ``position_ids``' device, with the frequencies
        repeated for both halves as the rotate-half convention expects.
    """
    if dim % 2:
        raise ValueError(f"rotary dim ({dim}) must be even")
    position_ids = position_ids[None] if position_ids.dim() == 1 else position_ids
    device = position_ids.device
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; expected default, linear or llama3")
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # [batch, seq, dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain-torch rotate-half RoPE in fp32, rounded once to ``x.dtype``; see :func:`apply_rope`."""
    rotary_dim = cos.shape[-1]
    cos_bs1r, sin_bs1r = cos[:, :, None, :].float(), sin[:, :, None, :].float()
    x_rot = x[..., :rotary_dim].float()
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos_bs1r + torch.cat((-x2, x1), dim=-1) * sin_bs1r
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


@triton_kernel
def _rope_kernel(
    x_ptr,
    x_stride_b,
    x_stride_s,
    x_stride_h,
    cos_ptr,
    sin_ptr,
    cs_stride_b,
    cs_stride_s,
    y_ptr,
    seq_len,
    n_heads,
    head_dim,
    half,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # one (batch, position) per program
    b, s = pid // seq_len, pid % seq_len
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = d < half
    mask = (heads < n_heads) & dmask
    x_row = x_ptr + b * x_stride_b + s * x_stride_s + heads * x_stride_h
    y_row = y_ptr + pid * n_heads * head_dim + heads * head_dim
    x1 = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + d, mask=mask, other=0.0).to(tl.float32)
    cs_row = b * cs_stride_b + s * cs_stride_s
    cos1 = tl.load(cos_ptr + cs_row + d, mask=dmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs_row + half + d, mask=dmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs_row + d, mask=dmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs_row + half + d, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation: rotate by the negative angle
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    tl.store(y_row + d, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + half + d, y2.to(y_ptr.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        p = tl.arange(0, BLOCK_PASS)[None, :]
        pmask = (heads < n_heads) & (p < head_dim - 2 * half)
        passthrough = tl.load(x_row + 2 * half + p, mask=pmask, other=0.0)
        tl.store(y_row + 2 * half + p, passthrough, mask=pmask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, seq_len, n_heads, head_dim = x.shape
    half = cos.shape[-1] // 2
    y = torch.empty((batch, seq_len, n_heads, head_dim), dtype=x.dtype, device=x.device)
    block_h, block_half = next_power_of_2(n_heads), next_power_of_2(half)
    block_pass = next_power_of_2(head_dim - 2 * half) if head_dim > 2 * half else 0
    _rope_kernel[(batch * seq_len,)](
        x, x.stride(0), x.stride(1), x.stride(2), cos, sin, cos.stride(0), cos.stride(1), y,
        seq_len, n_heads, head_dim, half,
        BACKWARD=backward, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        num_warps=num_warps_for(block_h * block_half),
    )  # fmt: skip
    return y


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, backward=True), None, None


def _check_rope_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.dim() != 3:
        raise ValueError(
            f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [batch or 1, seq, dim]"
        )
    batch, seq_len, _, head_dim = x.shape
    rotary_dim = cos.shape[-1]
    if cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
        raise ValueError(f"cos/sin shape {tuple(cos.shape)} does not match x shape {tuple(x.shape)}")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary dim ({rotary_dim}) must be even and at most head_dim ({head_dim})")


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: Backend = "auto"
) -> torch.Tensor:
    """Applies rotate-half RoPE to ``x``; partial rotary when ``cos.shape[-1] < head_dim``.

    Args:
        x: queries or keys ``[batch, seq, heads, head_dim]``, any layout, fp32 / bf16 / fp16.
        cos: ``[batch or 1, seq, rotary_dim]`` from :func:`rope_cos_sin` (any float dtype; used in fp32).
        sin: same shape as ``cos``.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :func:`forge_lightning.kernels.use_triton`).

    Returns:
        A contiguous tensor of ``x``'s shape and dtype. Differentiable in ``x``; ``cos`` / ``sin`` are
        position tables and get no gradient (the Triton path raises if they require one).
    """
    _check_rope_args(x, cos, sin)
    if not use_triton(backend, x, cos, sin):
        return apply_rope_reference(x, cos, sin)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "apply_rope's Triton path gives no gradient to cos / sin; detach them or use backend='torch'"
        )
    batch, seq_len = x.shape[:2]
    cos = cos.contiguous().expand(batch, seq_len, -1)
    sin = sin.contiguous().expand(batch, seq_len, -1)
    return _RoPEFunction.apply(x, cos, sin)

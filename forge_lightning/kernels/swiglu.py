"""SwiGLU activation: ``silu(gate) * up`` (Shazeer, "GLU Variants Improve Transformer", 2020).

The Triton path computes in fp32 and rounds ``silu(gate)`` to the input dtype before the product, as
``F.silu(gate) * up`` does. The backward recomputes ``sigmoid(gate)`` from the saved inputs rather than
saving activations. ``gate`` and ``up`` may be strided views (e.g. the two halves of one fused projection).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forge_lightning.kernels._dispatch import Backend, as_rows, next_power_of_2, tl, triton_kernel, use_triton

_BLOCK = 1024


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-torch SwiGLU; see :func:`swiglu`."""
    return F.silu(gate) * up


@triton_kernel
def _swiglu_fwd_kernel(g_ptr, g_row_stride, u_ptr, u_row_stride, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (silu * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton_kernel
def _swiglu_bwd_kernel(
    dy_ptr,
    dy_row_stride,
    g_ptr,
    g_row_stride,
    u_ptr,
    u_row_stride,
    dg_ptr,
    du_ptr,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = (g * sig).to(g_ptr.dtype.element_ty).to(tl.float32)
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + row * n_cols + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * n_cols + cols, (dy * silu).to(du_ptr.dtype.element_ty), mask=mask)


def _grid(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    return (n_rows, -(-n_cols // _block(n_cols)), 1)


def _block(n_cols: int) -> int:
    return min(_BLOCK, next_power_of_2(n_cols))


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g2, u2 = as_rows(gate), as_rows(up)
        n_rows, n_cols = g2.shape
        y = g2.new_empty((n_rows, n_cols), dtype=torch.promote_types(gate.dtype, up.dtype))
        _swiglu_fwd_kernel[_grid(n_rows, n_cols)](
            g2, g2.stride(0), u2, u2.stride(0), y, n_cols, BLOCK=_block(n_cols)
        )
        ctx.save_for_backward(g2, u2)
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        n_rows, n_cols = g2.shape
        dy2 = as_rows(dy)
        dg = g2.new_empty((n_rows, n_cols))
        du = u2.new_empty((n_rows, n_cols))
        _swiglu_bwd_kernel[_grid(n_rows, n_cols)](
            dy2, dy2.stride(0), g2, g2.stride(0), u2, u2.stride(0), dg, du, n_cols, BLOCK=_block(n_cols)
        )  # fmt: skip
        return dg.view(dy.shape), du.view(dy.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up``, differentiable in both inputs.

    Args:
        gate: gate projection ``[..., intermediate]``, any layout, fp32 / bf16 / fp16.
        up: up projection, same shape as ``gate``.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :func:`forge_lightning.kernels.use_triton`).

    Returns:
        A contiguous tensor of ``gate``'s shape in the promoted dtype of the inputs.
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} must equal up shape {tuple(up.shape)}")
    if not use_triton(backend, gate, up):
        return swiglu_reference(gate, up)
    return _SwiGLUFunction.apply(gate, up)

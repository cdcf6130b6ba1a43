"""RMSNorm over the last dim, optionally fused with the residual add before it.

Semantics follow Hugging Face's Llama / Qwen RMSNorm: normalise in fp32, cast the normalised value back to
the input dtype, then multiply by the weight (so the output dtype is the promotion of the two)::

    s = x + residual                       (only with a residual; rounded to the input dtype)
    y = weight * (s * rsqrt(mean(s^2) + eps)).to(s.dtype)

Triton path: the forward runs one row per program and saves ``s`` and the per-row ``rstd`` (fp32); the
backward recomputes the normalised row, writes ``ds`` and accumulates per-program partial weight gradients
(fp32) that torch sums at the end.
"""

from __future__ import annotations

import torch

from forge_lightning.kernels._dispatch import (
    Backend,
    add_combine,
    as_rows,
    next_power_of_2,
    num_warps_for,
    tl,
    triton_kernel,
    use_triton,
)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch RMSNorm (HF semantics); see :func:`rms_norm`."""
    if residual is not None:
        s = x + residual
        return rms_norm_reference(s, weight, eps), s
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@triton_kernel
def _rms_norm_fwd_kernel(
    x_ptr,
    x_row_stride,
    r_ptr,
    r_row_stride,
    w_ptr,
    y_ptr,
    s_ptr,
    rstd_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    s = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * n_cols + cols, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.reduce(sf * sf, 0, add_combine) / n_cols + eps)
    normed = (sf * rstd).to(s_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton_kernel
def _rms_norm_bwd_kernel(
    dy_ptr,
    dy_row_stride,
    dsum_ptr,
    dsum_row_stride,
    s_ptr,
    s_row_stride,
    w_ptr,
    rstd_ptr,
    ds_ptr,
    dw_partial_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_DSUM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.full([BLOCK], 0.0, tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    first = row_start.to(tl.int64)
    dy_ptrs = dy_ptr + first * dy_row_stride + cols
    dsum_ptrs = dsum_ptr + first * dsum_row_stride + cols
    s_ptrs = s_ptr + first * s_row_stride + cols
    ds_ptrs = ds_ptr + first * n_cols + cols
    rstd_ptrs = rstd_ptr + first
    for _ in range(row_start, row_end):
        s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptrs)
        normed = s * rstd
        dw_acc += dy * normed.to(s_ptr.dtype.element_ty).to(tl.float32)
        dn = dy * w
        ds = rstd * (dn - normed * (tl.reduce(dn * normed, 0, add_combine) / n_cols))
        if HAS_DSUM:
            ds += tl.load(dsum_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ds_ptrs, ds.to(ds_ptr.dtype.element_ty), mask=mask)
        dy_ptrs += dy_row_stride
        dsum_ptrs += dsum_row_stride
        s_ptrs += s_row_stride
        ds_ptrs += n_cols
        rstd_ptrs += 1
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=mask)


def _num_programs(n_rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 4)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        x2 = as_rows(x)
        n_rows, n_cols = x2.shape
        has_residual = residual is not None
        r2 = as_rows(residual) if has_residual else x2
        s_dtype = torch.promote_types(x.dtype, residual.dtype) if has_residual else x.dtype
        s2 = x2.new_empty((n_rows, n_cols), dtype=s_dtype) if has_residual else x2
        y2 = x2.new_empty((n_rows, n_cols), dtype=torch.promote_types(s_dtype, weight.dtype))
        rstd = x2.new_empty(n_rows, dtype=torch.float32)
        block = next_power_of_2(n_cols)
        _rms_norm_fwd_kernel[(n_rows,)](
            x2, x2.stride(0), r2, r2.stride(0), weight, y2, s2, rstd, n_cols, eps,
            HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=num_warps_for(block),
        )  # fmt: skip
        ctx.save_for_backward(s2, weight, rstd)
        ctx.shape, ctx.x_dtype, ctx.r_dtype = x.shape, x.dtype, residual.dtype if has_residual else None
        ctx.set_materialize_grads(False)
        y = y2.view(x.shape)
        return (y, s2.view(x.shape)) if has_residual else y

    @staticmethod
    def backward(ctx, dy, dsum=None):
        s2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = s2.shape
        if dy is None:  # only s was used downstream
            dy = s2.new_zeros((n_rows, n_cols))
        dy2 = as_rows(dy)
        dsum2 = as_rows(dsum) if dsum is not None else dy2
        ds = s2.new_empty((n_rows, n_cols))
        programs = _num_programs(n_rows, s2.device)
        dw_partial = s2.new_empty((programs, n_cols), dtype=torch.float32)
        block = next_power_of_2(n_cols)
        _rms_norm_bwd_kernel[(programs,)](
            dy2, dy2.stride(0), dsum2, dsum2.stride(0), s2, s2.stride(0), weight, rstd, ds, dw_partial,
            n_rows, n_cols, -(-n_rows // programs),
            HAS_DSUM=dsum is not None, BLOCK=block, num_warps=num_warps_for(block),
        )  # fmt: skip
        dw = dw_partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        dx = ds.view(ctx.shape).to(ctx.x_dtype)
        dr = ds.view(ctx.shape).to(ctx.r_dtype) if ctx.r_dtype is not None else None
        return dx, dw, dr, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim with HF semantics, optionally fused with a residual add.

    Args:
        x: input ``[..., hidden]``, any layout, fp32 / bf16 / fp16.
        weight: scale ``[hidden]``.
        eps: added to the mean square before the reciprocal square root.
        residual: if given (same shape as ``x``), computes ``s = x + residual`` first.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :func:`forge_lightning.kernels.use_triton`).

    Returns:
        ``weight * normalise(x)``; with ``residual``, the pair ``(weight * normalise(s), s)`` so the caller
        can carry ``s`` as the next residual stream. Differentiable in ``x``, ``weight`` and ``residual``.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} must be ({x.shape[-1]},), x's last dim")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}")
    if not use_triton(backend, x, weight, residual):
        return rms_norm_reference(x, weight, eps, residual)
    return _RMSNormFunction.apply(x, weight.contiguous(), residual, float(eps))

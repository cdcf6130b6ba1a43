"""Fused linear + cross-entropy: the LM-head matmul and the loss, chunked over tokens.

The fp32 logits ``[N, V]`` (tens of GB for a 128k vocabulary) are never materialised. Tokens are processed
in chunks of ``C`` rows; per chunk::

    logits_C = hidden_C @ weight.T              (input dtype, cuBLAS)
    per-row loss, lse, and d loss / d logits    (fp32 math, written over logits_C in place)
    grad_hidden_C = dlogits_C @ weight           (stored into grad_hidden[C rows])
    grad_weight  += dlogits_C.T @ hidden_C       (addmm into one [V, H] buffer in the weight dtype)

``d loss / d logits`` is rounded to the input dtype before its two matmuls (as autograd through a bf16 LM
head does), and each chunk's addmm accumulates in fp32 and rounds ``grad_weight`` once, so with half
precision weights it is rounded once per chunk; chunks are large (see ``_chunk_size``) so there are few.

``fp8=True`` runs the three matmuls as FP8 GEMMs (``torch._scaled_mm``, Hopper or newer) with per-tensor scales:
the weight and the hidden states in e4m3 (each quantized once per call, from its amax), ``d loss / d logits`` in
e5m2 with a scale from a bound known without reading it (``|d loss / d logits| <= 1`` per unit of upstream
gradient without z-loss, see ``_grad_bound``). One kernel per chunk reads the logits once and writes that
gradient twice, row-major for ``grad_hidden_C`` and transposed into a ``[V, tokens]`` buffer, so that the weight
gradient is one GEMM over all chunks at the end (FP8 GEMMs cannot accumulate into a bf16 output in place). The
logits GEMM uses cuBLAS fast accumulation, the hidden-state-gradient GEMM too with ``fast_accum=True``; the
weight-gradient GEMM never does: it sums over every token of the batch, and fast accumulation there raised the
200-step loss of a 4B model on real text by 9% (within 0.5% of bf16 with cuBLAS's promoted accumulation). Softmax,
loss and gradient math stay fp32. Off CUDA the same quantization runs with fp32 matmuls (an emulation for tests).

Saved gradients vs recompute: for ``reduction="sum"`` / ``"mean"`` the upstream gradient is one scalar, so
the forward computes the input gradients chunk by chunk and stores them (three matmuls in total instead of
four); the backward only scales them. ``"none"`` needs a per-token upstream gradient that is unknown at
forward time, so its forward saves the inputs and the backward recomputes each chunk's logits.

The loss per non-ignored token, with ``lse = logsumexp(z)`` in fp32 over the vocabulary ``V``::

    loss = (1 - ls) * (lse - z[label]) + ls * (lse - mean(z)) + z_loss * lse^2
    dloss/dz = softmax(z) * (1 + 2 * z_loss * lse) - (1 - ls) * onehot(label) - ls / V

(``ls`` = label smoothing as ``F.cross_entropy`` defines it; ``z_loss`` as in PaLM, Chowdhery et al.
2022). Ignored tokens contribute zero loss and zero gradient; ``"mean"`` divides by the number of
non-ignored tokens (NaN when there are none, as ``F.cross_entropy`` gives).

The Triton path runs the per-chunk softmax / loss / gradient in one kernel (one program per row, two
passes over the vocabulary with an online logsumexp); the torch reference runs the same chunked algorithm
with torch ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from forge_lightning.kernels._dispatch import (
    Backend,
    add_combine,
    max_combine,
    next_power_of_2,
    tl,
    triton_kernel,
    use_triton,
)
from forge_lightning.kernels.fp8 import quantize_fp8

Reduction = Literal["mean", "sum", "none"]
# A chunk's logits (C rows x V) are budgeted at this many elements (512 MiB in bf16); see _chunk_size.
_CHUNK_LOGITS_ELEMENTS = 1 << 28
_BLOCK_V = 4096
_FP8_GRAD_BLOCK = 64  # rows and vocabulary entries per tile of the FP8 gradient kernel (fastest on an H200)
_E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)
# The FP8 weight-gradient GEMM reads the e5m2 gradient transposed, [V, tokens]; up to this many bytes of it are
# kept so that one GEMM covers many chunks (all 16k tokens of a 152k vocabulary: 2.5 GB).
_FP8_GRAD_BUFFER_BYTES = 1 << 32
_MIN_GRAD_BOUND = 1e-30  # keeps the e5m2 scale finite when every gradient of a chunk is zero


@dataclass(frozen=True)
class _LossOptions:
    ignore_index: int
    z_loss: float
    label_smoothing: float


def _chunk_size(n_tokens: int, vocab: int, budget_factor: int = 1) -> int:
    """Rows per chunk: the largest power of two whose logits fit ``_CHUNK_LOGITS_ELEMENTS`` (at least 16).

    Every chunk costs one read-modify-write of the whole ``[V, H]`` weight gradient next to its
    ``6 * C * V * H`` matmul FLOPs, so that overhead is about ``(2/3) * (FLOP/s / bytes/s) / C`` of the
    matmul time, independent of ``H``: ~5% at C = 2048 on an H200 (measured there: about 89 / 85 / 83 ms
    at C = 1024 / 2048 / 4096 for 32768 tokens, H = 2048, V = 128256). The budget keeps C >= 2048 up to a
    128k vocabulary while a chunk's logits stay at 512 MiB in bf16. The FP8 path doubles the budget
    (``budget_factor=2``): it computes the weight gradient after the loop, so fewer, larger chunks only save
    launches, and its gradient payloads are one byte per logit.
    """
    rows = 1 << max(4, (budget_factor * _CHUNK_LOGITS_ELEMENTS // max(vocab, 1)).bit_length() - 1)
    return max(1, min(n_tokens, rows))


def _logit_grad(z: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, opts: _LossOptions) -> torch.Tensor:
    """``d loss / d logits`` of each row (fp32 ``[C, V]``), for non-ignored labels (``safe`` ids elsewhere)."""
    probs = torch.exp(z - lse[:, None]) * (1 + 2 * opts.z_loss * lse)[:, None]
    grad = probs - opts.label_smoothing / z.shape[-1]
    safe_labels = torch.where(labels != opts.ignore_index, labels, 0)
    return grad.scatter_add_(1, safe_labels[:, None], torch.full_like(grad[:, :1], opts.label_smoothing - 1))


def _chunk_loss_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    grad_scale: torch.Tensor | None,
    opts: _LossOptions,
    lse: torch.Tensor | None = None,
) -> None:
    """Writes the chunk's per-token losses into ``loss`` (and, given ``lse``, each row's logsumexp, 0 for ignored
    rows); with ``grad_scale``, also overwrites ``logits`` with ``grad_scale[:, None] * d loss / d logits``."""
    z = logits.float()
    valid = labels != opts.ignore_index
    safe_labels = torch.where(valid, labels, 0)
    row_lse = torch.logsumexp(z, dim=-1)
    nll = row_lse - z.gather(1, safe_labels[:, None]).squeeze(1)
    row_loss = (1 - opts.label_smoothing) * nll + opts.z_loss * row_lse.square()
    if opts.label_smoothing:
        row_loss = row_loss + opts.label_smoothing * (row_lse - z.mean(dim=-1))
    loss.copy_(torch.where(valid, row_loss, 0.0))
    if lse is not None:
        lse.copy_(torch.where(valid, row_lse, 0.0))
    if grad_scale is not None:
        grad = _logit_grad(z, labels, row_lse, opts)
        logits.copy_(grad * torch.where(valid, grad_scale, 0.0)[:, None])


def _chunk_grad_fp8_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_scale: torch.Tensor,
    opts: _LossOptions,
    scale: torch.Tensor,
    out: torch.Tensor,
    out_t: torch.Tensor | None,
) -> None:
    """Writes ``clamp(scale * grad_scale[:, None] * d loss / d logits)`` as e5m2 into ``out`` ``[C, V]`` and, given
    ``out_t``, its transpose into ``out_t`` ``[V, C]`` (any row stride); ``lse`` from the loss pass."""
    grad = _logit_grad(logits.float(), labels, lse, opts) * (grad_scale * scale)[:, None]
    grad = torch.where((labels != opts.ignore_index)[:, None], grad, 0.0)  # +0, not -0, as the Triton kernel
    payload = grad.clamp(-_E5M2_MAX, _E5M2_MAX).to(out.dtype)
    out.copy_(payload)
    if out_t is not None:
        out_t.copy_(payload.t())


@triton_kernel
def _ce_chunk_kernel(
    logits_ptr,
    logits_row_stride,
    labels_ptr,
    loss_ptr,
    lse_ptr,
    grad_scale_ptr,
    grad_scale_stride,
    vocab,
    ignore_index,
    z_loss,
    label_smoothing,
    COMPUTE_GRAD: tl.constexpr,
    STORE_LSE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    cols = tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row).to(tl.int64)
    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if STORE_LSE:
            tl.store(lse_ptr + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, vocab, BLOCK_V):
                zeros = tl.full([BLOCK_V], 0.0, logits_ptr.dtype.element_ty)
                tl.store(row_ptr + start + cols, zeros, mask=start + cols < vocab)
        return
    # Pass 1: online logsumexp (running max m, running sum d of exp(z - m)) and the sum of logits.
    m = float("-inf")
    d = 0.0
    z_sum = 0.0
    for start in range(0, vocab, BLOCK_V):
        mask = start + cols < vocab
        z = tl.load(row_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.reduce(z, 0, max_combine))
        d = d * tl.exp(m - m_new) + tl.reduce(tl.exp(z - m_new), 0, add_combine)
        m = m_new
        z_sum += tl.reduce(tl.where(mask, z, 0.0), 0, add_combine)
    lse = m + tl.log(d)
    z_label = tl.load(row_ptr + label).to(tl.float32)
    loss = (1.0 - label_smoothing) * (lse - z_label) + z_loss * lse * lse
    loss += label_smoothing * (lse - z_sum / vocab)
    tl.store(loss_ptr + row, loss)
    if STORE_LSE:
        tl.store(lse_ptr + row, lse)
    if COMPUTE_GRAD:
        # Pass 2: overwrite the row with its gradient (the logits it needs were read above or are re-read).
        g = tl.load(grad_scale_ptr + row * grad_scale_stride)
        p_scale = 1.0 + 2.0 * z_loss * lse
        for start in range(0, vocab, BLOCK_V):
            mask = start + cols < vocab
            z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(z - lse) * p_scale - label_smoothing / vocab
            grad = tl.where(start + cols == label, grad - (1.0 - label_smoothing), grad)
            tl.store(row_ptr + start + cols, (grad * g).to(logits_ptr.dtype.element_ty), mask=mask)


def _chunk_loss_triton(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    grad_scale: torch.Tensor | None,
    opts: _LossOptions,
    lse: torch.Tensor | None = None,
) -> None:
    """Triton twin of :func:`_chunk_loss_torch` (same contract)."""
    n_rows, vocab = logits.shape
    block_v = min(_BLOCK_V, next_power_of_2(vocab))
    scale = grad_scale if grad_scale is not None else loss  # unused without COMPUTE_GRAD
    _ce_chunk_kernel[(n_rows,)](
        logits, logits.stride(0), labels, loss, loss if lse is None else lse, scale, scale.stride(0),
        vocab, opts.ignore_index, float(opts.z_loss), float(opts.label_smoothing),
        COMPUTE_GRAD=grad_scale is not None, STORE_LSE=lse is not None, BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )  # fmt: skip


@triton_kernel
def _ce_grad_fp8_kernel(
    logits_ptr,
    logits_row_stride,
    labels_ptr,
    lse_ptr,
    grad_scale_ptr,
    grad_scale_stride,
    scale_ptr,
    out_ptr,
    out_row_stride,
    out_t_ptr,
    out_t_row_stride,
    n_rows,
    vocab,
    ignore_index,
    z_loss,
    label_smoothing,
    fp8_max,
    WRITE_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < vocab)
    label = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(grad_scale_ptr + rows * grad_scale_stride, mask=row_ok, other=0.0) * tl.load(scale_ptr)
    z = tl.load(logits_ptr + rows[:, None] * logits_row_stride + cols[None, :], mask=mask, other=0.0)
    grad = tl.exp(z.to(tl.float32) - lse[:, None]) * (1.0 + 2.0 * z_loss * lse)[:, None]
    grad = grad - label_smoothing / vocab
    grad = tl.where(cols[None, :] == label[:, None], grad - (1.0 - label_smoothing), grad)
    grad = tl.where((label != ignore_index)[:, None], grad * g[:, None], 0.0)
    grad = tl.minimum(tl.maximum(grad, -fp8_max), fp8_max)
    tl.store(
        out_ptr + rows[:, None] * out_row_stride + cols[None, :], grad.to(out_ptr.dtype.element_ty), mask=mask
    )
    if WRITE_T:
        t_ptrs = out_t_ptr + cols[:, None] * out_t_row_stride + rows[None, :]
        tl.store(t_ptrs, tl.trans(grad).to(out_t_ptr.dtype.element_ty), mask=tl.trans(mask))


def _chunk_grad_fp8_triton(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_scale: torch.Tensor,
    opts: _LossOptions,
    scale: torch.Tensor,
    out: torch.Tensor,
    out_t: torch.Tensor | None,
) -> None:
    """Triton twin of :func:`_chunk_grad_fp8_torch`: one read of the logits, both layouts written from one tile."""
    n_rows, vocab = logits.shape
    grid = (-(-n_rows // _FP8_GRAD_BLOCK), -(-vocab // _FP8_GRAD_BLOCK))
    _ce_grad_fp8_kernel[grid](
        logits, logits.stride(0), labels, lse, grad_scale, grad_scale.stride(0), scale,
        out, out.stride(0), out if out_t is None else out_t, 0 if out_t is None else out_t.stride(0),
        n_rows, vocab, opts.ignore_index, float(opts.z_loss), float(opts.label_smoothing), _E5M2_MAX,
        WRITE_T=out_t is not None, BLOCK_M=_FP8_GRAD_BLOCK, BLOCK_V=_FP8_GRAD_BLOCK, num_warps=4,
    )  # fmt: skip


@dataclass(frozen=True)
class _ChunkKernels:
    """One backend's per-chunk kernels: ``loss`` (the loss, lse, and the gradient written over the logits) and
    ``grad_fp8`` (the scaled e5m2 gradient in both layouts, for the FP8 GEMMs)."""

    loss: Callable[..., None]
    grad_fp8: Callable[..., None]


_TORCH_KERNELS = _ChunkKernels(_chunk_loss_torch, _chunk_grad_fp8_torch)
_TRITON_KERNELS = _ChunkKernels(_chunk_loss_triton, _chunk_grad_fp8_triton)


@dataclass(frozen=True)
class _FP8Settings:
    """FP8 settings of the chunk loop (``None`` in its place: high-precision matmuls)."""

    fast_accum: bool


def _quantize_2d(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` in ``dtype`` with one per-tensor scale: (payload ``[M, K]`` row-major, descale ``[]``)."""
    payload, descale = quantize_fp8(x, block=None, dtype=dtype)
    return payload.view(x.shape), descale.reshape(())


def _fp8_mm(
    a: torch.Tensor,
    b_t: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    fast_accum: bool,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(a * scale_a) @ (b_t * scale_b).T`` in ``out_dtype``, for FP8 ``a`` ``[M, K]`` and ``b_t`` ``[N, K]``
    (row-major)."""
    if a.is_cuda:
        return torch._scaled_mm(
            a, b_t.t(), scale_a=scale_a.float(), scale_b=scale_b.float(), out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )  # fmt: skip
    return ((a.float() * scale_a) @ (b_t.float() * scale_b).t()).to(out_dtype)


def _grad_bound(
    grad_scale: torch.Tensor, lse: torch.Tensor | None, labels: torch.Tensor, opts: _LossOptions
) -> torch.Tensor:
    """An upper bound (0-dim fp32, on the device) of ``|grad_scale * d loss / d logits|`` over the rows.

    With ``p`` in [0, 1] each entry is ``p * (1 + 2 z lse) - ls / V - (1 - ls) * onehot``: at most 1 in magnitude
    without z-loss (so the bound is known before any logits exist), at most ``|1 + 2 z lse| + 1`` with it.
    """
    bound = grad_scale.abs()
    if opts.z_loss:
        bound = torch.where(labels != opts.ignore_index, bound * ((1 + 2 * opts.z_loss * lse).abs() + 1), 0.0)
    return bound.max().float().clamp_min(_MIN_GRAD_BOUND)


def _round_up_16(n: int) -> int:
    return -(-n // 16) * 16


def _weight_grad_fp8(
    grad_t: torch.Tensor,
    hidden8: torch.Tensor,
    grad_descale: torch.Tensor,
    hidden_descale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``grad_t[:, :K] @ hidden8`` ``[V, H]`` for the ``K`` tokens of ``hidden8`` ``[K, H]`` (e4m3) and their
    gradients in the first ``K`` columns of ``grad_t`` ``[V, >= K]`` (e5m2); ``K`` is zero-padded to a multiple of
    16, the GEMM's tile. Always with precise accumulation (see the module docstring)."""
    tokens = hidden8.shape[0]
    padded = _round_up_16(tokens)
    hidden_t = hidden8.new_zeros((hidden8.shape[1], padded))  # K-major (tokens) operand
    hidden_t[:, :tokens] = hidden8.t()
    if padded > tokens:
        grad_t[:, tokens:padded].zero_()
    return _fp8_mm(grad_t[:, :padded], hidden_t, grad_descale, hidden_descale, False, out_dtype)


def _run_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    opts: _LossOptions,
    kernels: _ChunkKernels,
    chunk_size: int,
    grad_scale: torch.Tensor | None,
    needs_grad: tuple[bool, bool],
    fp8: _FP8Settings | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Runs the chunk loop; returns per-token losses and, with ``grad_scale``, the input gradients."""
    if fp8 is not None:
        return _run_fp8_chunks(hidden, weight, labels, opts, kernels, chunk_size, grad_scale, needs_grad, fp8)
    n_tokens = hidden.shape[0]
    loss = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    with_grad = grad_scale is not None
    grad_hidden = hidden.new_empty(hidden.shape) if with_grad and needs_grad[0] else None
    grad_weight = torch.zeros_like(weight) if with_grad and needs_grad[1] else None
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        hidden_c = hidden[start:end]
        logits = hidden_c @ weight.T  # [C, V], overwritten by d loss / d logits
        scale_c = grad_scale[start:end] if with_grad else None
        kernels.loss(logits, labels[start:end], loss[start:end], scale_c, opts)
        if grad_hidden is not None:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if grad_weight is not None:
            grad_weight.addmm_(logits.T, hidden_c)
    return loss, grad_hidden, grad_weight


def _run_fp8_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    opts: _LossOptions,
    kernels: _ChunkKernels,
    chunk_size: int,
    grad_scale: torch.Tensor | None,
    needs_grad: tuple[bool, bool],
    fp8: _FP8Settings,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The chunk loop with FP8 GEMMs (see the module docstring).

    The weight and all hidden states are quantized once (e4m3, one scale each). Each chunk's logits feed the
    loss pass (loss and lse per row), then one kernel writes the scaled e5m2 gradient twice: row-major for the
    chunk's hidden-state-gradient GEMM, and transposed into the columns of a ``[V, tokens]`` buffer. Without
    z-loss the gradient's bound, hence its scale, is known before the loop, so one weight-gradient GEMM covers
    every chunk that fits the buffer (``_FP8_GRAD_BUFFER_BYTES``); with z-loss each chunk has its own scale and
    its own GEMM, added into the weight gradient.
    """
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    device, with_grad = hidden.device, grad_scale is not None
    want_hidden, want_weight = with_grad and needs_grad[0], with_grad and needs_grad[1]
    loss = torch.empty(n_tokens, dtype=torch.float32, device=device)
    lse = torch.empty(n_tokens, dtype=torch.float32, device=device) if with_grad else None
    w8, w_descale = _quantize_2d(weight, torch.float8_e4m3fn)  # [V, H]
    h8, h_descale = _quantize_2d(hidden, torch.float8_e4m3fn)  # [N, H]
    w8_t = w8.t().contiguous() if want_hidden else None  # [H, V]: K-major for d hidden
    grad_hidden = hidden.new_empty(hidden.shape) if want_hidden else None
    grad_weight = None
    static_bound = _grad_bound(grad_scale, None, labels, opts) if with_grad and not opts.z_loss else None
    group = chunk_size
    if static_bound is not None:
        group = max(chunk_size, _FP8_GRAD_BUFFER_BYTES // vocab // chunk_size * chunk_size)
    group = min(group, n_tokens)
    e5m2 = dict(dtype=torch.float8_e5m2, device=device)
    # One chunk's gradient, and a group's transposed.
    g8 = torch.empty((min(chunk_size, n_tokens), vocab), **e5m2) if with_grad else None
    g8_t = torch.empty((vocab, _round_up_16(group)), **e5m2) if want_weight else None
    group_start = 0
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        logits = _fp8_mm(h8[start:end], w8, h_descale, w_descale, fast_accum=True)  # [C, V]
        lse_c = None if lse is None else lse[start:end]
        kernels.loss(logits, labels[start:end], loss[start:end], None, opts, lse_c)
        if not with_grad:
            continue
        scale_c, labels_c = grad_scale[start:end], labels[start:end]
        bound = static_bound if static_bound is not None else _grad_bound(scale_c, lse_c, labels_c, opts)
        g8_c = g8[: end - start]
        columns = None if g8_t is None else g8_t[:, start - group_start : end - group_start]
        kernels.grad_fp8(logits, labels_c, lse_c, scale_c, opts, _E5M2_MAX / bound, g8_c, columns)
        g_descale = bound / _E5M2_MAX
        if grad_hidden is not None:
            grad_hidden[start:end] = _fp8_mm(g8_c, w8_t, g_descale, w_descale, fp8.fast_accum, hidden.dtype)
        if g8_t is not None and (end - group_start >= group or end == n_tokens):
            hidden_group = h8[group_start:end]
            part = _weight_grad_fp8(g8_t, hidden_group, g_descale, h_descale, weight.dtype)
            grad_weight = part if grad_weight is None else grad_weight.add_(part)
            group_start = end
    if want_weight and grad_weight is None:  # no tokens
        grad_weight = torch.zeros_like(weight)
    return loss, grad_hidden, grad_weight


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, opts, reduction, kernels, chunk_size, fp8):
        n_valid = (labels != opts.ignore_index).sum()
        store_grads = reduction != "none" and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        ones = torch.ones((), dtype=torch.float32, device=hidden.device).expand(hidden.shape[0])
        scale, needs = (ones if store_grads else None), ctx.needs_input_grad[:2]
        loss, grad_hidden, grad_weight = _run_chunks(
            hidden, weight, labels, opts, kernels, chunk_size, scale, needs, fp8
        )
        ctx.reduction, ctx.fp8 = reduction, fp8
        ctx.consumed = False
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, labels)
            ctx.opts, ctx.kernels, ctx.chunk_size = opts, kernels, chunk_size
            return loss
        ctx.save_for_backward(grad_hidden, grad_weight, n_valid)
        return loss.sum() / n_valid if reduction == "mean" else loss.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.reduction == "none":
            hidden, weight, labels = ctx.saved_tensors
            grad_scale, needs = grad_loss.float().contiguous(), ctx.needs_input_grad[:2]
            _, grad_hidden, grad_weight = _run_chunks(
                hidden, weight, labels, ctx.opts, ctx.kernels, ctx.chunk_size, grad_scale, needs, ctx.fp8
            )
            return grad_hidden, grad_weight, None, None, None, None, None, None
        if ctx.consumed:
            raise RuntimeError(
                "fused_linear_cross_entropy scales its stored gradients in place: backward runs once"
            )
        ctx.consumed = True
        grad_hidden, grad_weight, n_valid = ctx.saved_tensors
        scale = grad_loss / n_valid if ctx.reduction == "mean" else grad_loss
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(scale)  # fp32 0-dim scale: computed in fp32, rounded once to the grad's dtype
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    *,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    fp8: bool = False,
    fast_accum: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, without materialising fp32 logits.

    Args:
        hidden: final hidden states ``[..., H]`` (flattened to ``[N, H]``), fp32 / bf16 / fp16.
        weight: LM-head weight ``[V, H]``, same dtype as ``hidden``.
        labels: target ids, ``hidden.shape[:-1]``; ``ignore_index`` entries are skipped.
        ignore_index: label value that contributes no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"``, or ``"none"`` (per token, in the shape
            of ``labels``; ignored tokens give 0).
        z_loss: coefficient of the ``logsumexp^2`` penalty added per non-ignored token.
        label_smoothing: in ``[0, 1]``, as ``torch.nn.functional.cross_entropy`` defines it.
        chunk_size: tokens per chunk; by default the largest power of two whose logits fit 2^28 elements.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :func:`forge_lightning.kernels.use_triton`).
        fp8: run the three matmuls in FP8 (see the module docstring); ``H`` and ``V`` multiples of 16.
        fast_accum: with ``fp8``, fast accumulation in the two gradient GEMMs too.

    Returns:
        The fp32 loss (a scalar, or per-token for ``"none"``), differentiable in ``hidden`` and ``weight``.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # Under autocast the logit GEMMs run in the autocast dtype, as `F.linear` would; the casts sit outside the
        # kernel, so fp32 master weights and hidden states receive fp32 gradients.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return fused_linear_cross_entropy(
                hidden, weight, labels, ignore_index, reduction, z_loss, label_smoothing,
                chunk_size=chunk_size, backend=backend, fp8=fp8, fast_accum=fast_accum,
            )  # fmt: skip
    _check_ce_args(hidden, weight, labels, reduction, label_smoothing)
    if fp8 and (weight.shape[0] % 16 or weight.shape[1] % 16):
        raise ValueError(
            f"fp8 cross-entropy needs the vocabulary and hidden sizes to be multiples of 16 (FP8 GEMM tiles), "
            f"got weight {tuple(weight.shape)}; pad the vocabulary or keep the LM head in high precision"
        )
    fp8_settings = _FP8Settings(fast_accum) if fp8 else None
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    labels1 = labels.reshape(-1).contiguous()
    chunk = chunk_size or _chunk_size(hidden2.shape[0], weight.shape[0], 2 if fp8 else 1)
    opts = _LossOptions(int(ignore_index), float(z_loss), float(label_smoothing))
    kernels = _TRITON_KERNELS if use_triton(backend, hidden, weight, labels) else _TORCH_KERNELS
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss = _FusedLinearCrossEntropy.apply(
            hidden2, weight, labels1, opts, reduction, kernels, chunk, fp8_settings
        )
    else:  # evaluation: no gradients to compute or store
        per_token, _, _ = _run_chunks(
            hidden2, weight, labels1, opts, kernels, chunk, None, (False, False), fp8_settings
        )
        loss = _reduce(per_token, labels1, opts.ignore_index, reduction)
    return loss.view(labels.shape) if reduction == "none" else loss


def _reduce(per_token: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total / (labels != ignore_index).sum() if reduction == "mean" else total


def _check_ce_args(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str, label_smoothing: float
) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [vocab, {hidden.shape[-1]}]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must be hidden's leading shape {tuple(hidden.shape[:-1])}"
        )


def linear_cross_entropy_unfused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The unfused formulation (full fp32 logits + ``F.cross_entropy``): a baseline and a test oracle."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.T).float()
    flat_labels = labels.reshape(-1)
    loss = F.cross_entropy(
        logits, flat_labels, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = flat_labels != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.where(valid, torch.logsumexp(logits, dim=-1), 0.0).square()
    if reduction == "none":
        return loss.view(labels.shape)
    return loss.sum() / valid.sum() if reduction == "mean" else loss.sum()

"""FlashAttention-4 (the ``flash-attn-4`` package, CuTe DSL kernels for Hopper and Blackwell) as ``torch.library``
custom ops, dense and varlen, causal or not, with grouped key/value heads.

The package is optional and imported on first use only. Its forward and backward kernels are wrapped as two custom
ops with fake (meta) implementations, tied together by ``register_autograd``, so that per-block ``torch.compile``
traces through them (one opaque node each) and activation checkpointing recomputes or saves them like any op::

    flash4_attention ─ forge_lightning::flash4_forward ─▶ (out, lse)          saved: q, k, v, out, lse
                                   backward: forge_lightning::flash4_backward ─▶ (dq, dk, dv)

Layouts are FA4's: dense ``[B, S, H, D]``; varlen ``[T, H, D]`` (the batch's tokens flattened) with
``cu_seqlens`` ``[num_documents + 1]`` int32 offsets and the longest document ``max_seqlen``. Inputs in
bf16 / fp16, head dims 64 or 128 (query, key and value alike; see ``SUPPORTED_HEAD_DIMS``). Which calls reach these ops is
decided in ``forge_lightning.modules.layers.attention``; see docs/performance.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from forge_lightning.accelerators.capabilities import capabilities

INSTALL_HINT = "pip install flash-attn-4 (FlashAttention-4, CuTe DSL; CUDA 12.8+, a Hopper or Blackwell GPU)"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128)
"""Head dims checked against SDPA on an H200 (``tests/gpu/test_flash4_gpu.py``, flash-attn-4 4.0.0b36): 64 and 128
match; at 72 (SigLIP's) the Hopper backward returned wrong query gradients (relative error 0.56, rows of zeros)
while the forward matched, so other head dims stay on SDPA."""
SUPPORTED_CAPABILITIES = (9, 10)
"""Compute capability majors FA4 runs on: Hopper (sm90) and Blackwell (sm100)."""


@functools.cache
def import_error() -> str | None:
    """Why ``flash_attn.cute`` does not import here (``None``: it does)."""
    try:
        # The entry points FA4's own autograd.Function calls (as in 4.0.0b36, the version this wrapper follows).
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd  # noqa: F401
    except Exception as err:  # a broken CUDA or cutlass install fails with other errors than ImportError
        return f"flash_attn.cute does not import ({type(err).__name__}: {err}); {INSTALL_HINT}"
    return None


def device_unsupported(device: torch.device | str) -> str | None:
    """Why FA4 cannot run on ``device`` (``None``: it can).

    Args:
        device: where attention runs.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"FlashAttention-4 needs a CUDA GPU, got device {device.type!r}"
    caps = capabilities(device)
    if not caps.flash_attention:
        return f"FlashAttention-4 needs an NVIDIA GPU, and this 'cuda' device is a {caps.platform} device"
    if not torch.cuda.is_available():
        return "FlashAttention-4 needs a CUDA GPU, and CUDA is not available here"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in SUPPORTED_CAPABILITIES:
        return f"FlashAttention-4 needs a Hopper (sm90) or Blackwell (sm100) GPU, got sm{major}{minor}"
    return import_error()


def inputs_unsupported(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why FA4 cannot take these queries, keys and values (``None``: it can); the device is not checked.

    Args:
        q: queries, heads and head dim last (``[..., H, D]``).
        k: keys ``[..., K, D]``.
        v: values ``[..., K, D]``.
    """
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"FlashAttention-4 takes bf16 / fp16 inputs, got {q.dtype} / {k.dtype} / {v.dtype}"
    dims = {q.shape[-1], k.shape[-1], v.shape[-1]}
    if len(dims) != 1 or q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return (
            f"FlashAttention-4 here takes equal query / key / value head dims of {' or '.join(map(str, SUPPORTED_HEAD_DIMS))} "
            f"(the ones verified on Hopper); got {q.shape[-1]} / {k.shape[-1]} / {v.shape[-1]}"
        )
    if q.shape[-2] % k.shape[-2]:
        return f"key/value heads ({k.shape[-2]}) must divide query heads ({q.shape[-2]})"
    return None


@functools.cache
def _load_kernels() -> tuple[Callable, Callable]:
    """FA4's forward and backward entry points (those its own ``autograd.Function`` calls)."""
    reason = import_error()
    if reason is not None:
        raise RuntimeError(reason)
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    return _flash_attn_fwd, _flash_attn_bwd


def _varlen_kwargs(cu_seqlens: Tensor | None, max_seqlen: int) -> dict:
    if cu_seqlens is None:
        return {}
    return {
        "cu_seqlens_q": cu_seqlens,
        "cu_seqlens_k": cu_seqlens,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_k": max_seqlen,
    }


@torch.library.custom_op("forge_lightning::flash4_forward", mutates_args=())
def _forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, causal: bool
) -> tuple[Tensor, Tensor]:
    forward, _ = _load_kernels()
    out, lse, *_ = forward(q, k, v, causal=causal, return_lse=True, **_varlen_kwargs(cu_seqlens, max_seqlen))
    return out, lse


@_forward.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, causal: bool
) -> tuple[Tensor, Tensor]:
    if cu_seqlens is None:
        B, S, H, _ = q.shape
        lse = q.new_empty((B, H, S), dtype=torch.float32)
    else:
        T, H, _ = q.shape
        lse = q.new_empty((H, T), dtype=torch.float32)
    return torch.empty_like(q), lse


@torch.library.custom_op("forge_lightning::flash4_backward", mutates_args=())
def _backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor | None,
    max_seqlen: int,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    _, backward = _load_kernels()
    dq, dk, dv = backward(
        q, k, v, out, dout, lse, None, causal, 0.0, **_varlen_kwargs(cu_seqlens, max_seqlen)
    )
    return dq, dk, dv


@_backward.register_fake
def _(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor | None,
    max_seqlen: int,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens, max_seqlen, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.causal = max_seqlen, causal


def _autograd_backward(
    ctx: torch.autograd.function.FunctionCtx, dout: Tensor, dlse: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
    # `lse` stays inside flash4_attention (never differentiated), so its gradient is ignored.
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.causal)
    return dq, dk, dv, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def flash4_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int = 0,
) -> Tensor:
    """FlashAttention-4 over FA4's layout, differentiable (scale ``1 / sqrt(D)``).

    Dense, ``causal`` needs as many queries as keys (this wrapper does not use FA4's bottom-right alignment).

    Args:
        q: queries ``[B, S_q, H, D]``, or ``[T, H, D]`` with ``cu_seqlens``.
        k: keys ``[B, S_kv, K, D]`` (``K`` divides ``H``), or ``[T, K, D]``.
        v: values, shaped like ``k``.
        causal: each query attends to the keys at or before its position (within its document, varlen).
        cu_seqlens: ``[num_documents + 1]`` int32 offsets of the documents in ``T`` (``None``: dense).
        max_seqlen: the longest document (varlen).

    Returns:
        ``[B, S_q, H, D]`` or ``[T, H, D]``, in the inputs' dtype.

    Raises:
        ValueError: inputs FA4 does not take (see :func:`inputs_unsupported`), or a dense causal call with
            different query and key lengths.
    """
    reason = inputs_unsupported(q, k, v)
    if reason is not None:
        raise ValueError(reason)
    if cu_seqlens is None and causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"flash4_attention: causal attention needs as many queries ({q.shape[1]}) as keys ({k.shape[1]})"
        )
    if cu_seqlens is not None and cu_seqlens.dtype != torch.int32:
        raise ValueError(f"flash4_attention: cu_seqlens must be int32, got {cu_seqlens.dtype}")
    out, _ = _forward(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, int(max_seqlen), causal)
    return out

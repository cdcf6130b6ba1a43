"""FP8 quantize / dequantize with fp32 scales, for compressing communication payloads.

The tensor is flattened (row-major) and cut into consecutive blocks of ``block`` elements (the last may be
partial); each block gets one fp32 scale ``amax / fp8_max`` (1.0 for an all-zero block, at least the smallest
normal fp32 so that a block of denormal values never divides by zero), and the payload is
the saturating cast ``clamp(x / scale, -fp8_max, fp8_max).to(fp8)``. Two special granularities use the
same layout: one scale for the whole tensor (``block=None``) and one scale per row of a 2-D tensor
(``rowwise=True``, i.e. ``block = x.shape[1]``)::

    x.flatten():  | block 0 ........ | block 1 ........ | ... | last (partial) |
    scales:       | s0               | s1               | ... | s_last         |

Triton path: blocks up to ``_FUSED_MAX_BLOCK`` elements are quantized by one fused kernel (amax, scale and
cast in one read, several blocks per program); larger blocks (and the per-tensor case) are cut into tiles
and take a per-tile amax pass, then a cast pass. Every program reads its scales once per block or tile,
never per element. These functions operate on data, not on the autograd graph: they are not
differentiable (inputs are detached).
"""

from __future__ import annotations

import torch

from forge_lightning.kernels._dispatch import (
    Backend,
    max_combine,
    next_power_of_2,
    tl,
    triton_kernel,
    use_triton,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FUSED_MAX_BLOCK = 8192
# Smallest normal fp32: the floor of a non-zero block's scale (amax / fp8_max underflows to 0 for amax < ~1e-42,
# and x / 0 would turn the block into NaN); the Triton kernel spells the same value as a literal.
FP32_TINY = torch.finfo(torch.float32).tiny
_FUSED_ELEMENTS = 4096  # elements per program in the fused kernel (several small blocks per program)
_TILE = 4096


def _resolve_block(x: torch.Tensor, block: int | None, rowwise: bool) -> int:
    if rowwise:
        if x.dim() != 2:
            raise ValueError(f"rowwise=True needs a 2-D tensor, got shape {tuple(x.shape)}")
        return max(x.shape[1], 1)
    if block is None:
        return max(x.numel(), 1)
    if block < 1:
        raise ValueError(f"block must be a positive int or None, got {block}")
    return block


def _check_fp8_dtype(dtype: torch.dtype) -> float:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    return float(torch.finfo(dtype).max)


def _scales_from_amax(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    # Divide by a tensor: CUDA torch turns division by a Python scalar into a multiplication by its
    # reciprocal, which can differ from the correctly rounded quotient that the Triton kernel computes.
    quotient = (amax / torch.full_like(amax, fp8_max)).clamp_min(FP32_TINY)
    return torch.where(amax > 0, quotient, torch.ones_like(amax))


def _pad_to_blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    n_blocks = -(-flat.numel() // block)
    return torch.nn.functional.pad(flat, (0, n_blocks * block - flat.numel())).view(n_blocks, block)


def quantize_fp8_reference(
    x: torch.Tensor, block: int | None = 256, dtype: torch.dtype = torch.float8_e4m3fn, rowwise: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch FP8 quantization; see :func:`quantize_fp8`."""
    fp8_max = _check_fp8_dtype(dtype)
    block = _resolve_block(x, block, rowwise)
    flat = x.detach().reshape(-1).float()
    blocks = _pad_to_blocks(flat, block)  # [n_blocks, block], zero-padded
    scales = _scales_from_amax(blocks.abs().amax(dim=1), fp8_max)
    payload = (blocks / scales[:, None]).clamp(-fp8_max, fp8_max).to(dtype).reshape(-1)[: flat.numel()]
    return payload, scales


def dequantize_fp8_reference(
    payload: torch.Tensor,
    scales: torch.Tensor,
    block: int | None = 256,
    shape: torch.Size | tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch FP8 dequantization; see :func:`dequantize_fp8`."""
    block = _dequant_block(payload, scales, block)
    blocks = _pad_to_blocks(payload.reshape(-1).float(), block)
    out = (blocks * scales.float()[:, None]).reshape(-1)[: payload.numel()].to(dtype)
    return out.view(shape if shape is not None else (-1,))


def _dequant_block(payload: torch.Tensor, scales: torch.Tensor, block: int | None) -> int:
    if block is None:
        if scales.numel() != 1:
            raise ValueError(f"block=None means one scale, got {scales.numel()} scales")
        return max(payload.numel(), 1)
    expected = -(-payload.numel() // block)
    if scales.numel() != expected:
        raise ValueError(
            f"{payload.numel()} elements in blocks of {block} need {expected} scales, got {scales.numel()}"
        )
    return block


@triton_kernel
def _quantize_fused_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    numel,
    block,
    n_blocks,
    fp8_max,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    BLOCK_P2: tl.constexpr,
):
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_P2)
    offs = blocks[:, None] * block + cols[None, :]
    mask = (blocks[:, None] < n_blocks) & (cols[None, :] < block) & (offs < numel)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(x), 1, max_combine)
    scale = tl.where(amax > 0, tl.maximum(tl.math.div_rn(amax, fp8_max), 1.1754943508222875e-38), 1.0)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + blocks, scale, mask=blocks < n_blocks)


@triton_kernel
def _tile_amax_kernel(x_ptr, amax_ptr, numel, block, tiles_per_block, TILE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # one tile of one block per program
    in_block = (pid % tiles_per_block) * TILE + tl.arange(0, TILE)
    offs = (pid // tiles_per_block) * block + in_block
    x = tl.load(x_ptr + offs, mask=(in_block < block) & (offs < numel), other=0.0).to(tl.float32)
    tl.store(amax_ptr + pid, tl.reduce(tl.abs(x), 0, max_combine))


@triton_kernel
def _quantize_tiles_kernel(
    x_ptr, q_ptr, scale_ptr, numel, block, tiles_per_block, fp8_max, TILE: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)  # one tile of one block per program
    in_block = (pid % tiles_per_block) * TILE + tl.arange(0, TILE)
    offs = (pid // tiles_per_block) * block + in_block
    mask = (in_block < block) & (offs < numel)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + pid // tiles_per_block)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton_kernel
def _dequantize_kernel(
    q_ptr,
    scale_ptr,
    out_ptr,
    numel,
    block,
    tiles_per_block,
    n_tiles,
    TILES_PER_PROGRAM: tl.constexpr,
    TILE: tl.constexpr,
):
    tiles = tl.program_id(0).to(tl.int64) * TILES_PER_PROGRAM + tl.arange(0, TILES_PER_PROGRAM)
    block_ids = tiles // tiles_per_block
    in_block = (tiles % tiles_per_block)[:, None] * TILE + tl.arange(0, TILE)[None, :]
    offs = block_ids[:, None] * block + in_block
    mask = (tiles[:, None] < n_tiles) & (in_block < block) & (offs < numel)
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + block_ids, mask=tiles < n_tiles, other=1.0)
    tl.store(out_ptr + offs, (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def _tiling(block: int) -> tuple[int, int]:
    """(tile size, tiles per block): a block of up to ``_TILE`` elements is one power-of-two tile."""
    tile = min(next_power_of_2(block), _TILE)
    return tile, -(-block // tile)


def _quantize_triton(flat: torch.Tensor, block: int, dtype: torch.dtype, fp8_max: float):
    numel = flat.numel()
    n_blocks = -(-numel // block)
    payload = torch.empty(numel, dtype=dtype, device=flat.device)
    scales = torch.empty(n_blocks, dtype=torch.float32, device=flat.device)
    if block <= _FUSED_MAX_BLOCK:
        block_p2 = next_power_of_2(block)
        per_program = max(1, _FUSED_ELEMENTS // block_p2)
        grid = (-(-n_blocks // per_program),)
        _quantize_fused_kernel[grid](
            flat, payload, scales, numel, block, n_blocks, fp8_max,
            BLOCKS_PER_PROGRAM=per_program, BLOCK_P2=block_p2,
        )  # fmt: skip
        return payload, scales
    tile, tiles = _tiling(block)
    tile_amax = torch.empty((n_blocks, tiles), dtype=torch.float32, device=flat.device)
    _tile_amax_kernel[(n_blocks * tiles,)](flat, tile_amax, numel, block, tiles, TILE=tile)
    scales = _scales_from_amax(tile_amax.amax(dim=1), fp8_max)
    _quantize_tiles_kernel[(n_blocks * tiles,)](
        flat, payload, scales, numel, block, tiles, fp8_max, TILE=tile
    )
    return payload, scales


def _dequantize_triton(
    flat: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype
) -> torch.Tensor:
    out = torch.empty(flat.numel(), dtype=dtype, device=flat.device)
    tile, tiles = _tiling(block)
    n_tiles = scales.numel() * tiles
    per_program = max(1, _FUSED_ELEMENTS // tile)
    _dequantize_kernel[(-(-n_tiles // per_program),)](
        flat, scales, out, flat.numel(), block, tiles, n_tiles, TILES_PER_PROGRAM=per_program, TILE=tile
    )
    return out


def quantize_fp8(
    x: torch.Tensor,
    block: int | None = 256,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rowwise: bool = False,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` to FP8 with one fp32 scale per block of its flattened elements.

    Args:
        x: any shape and layout, fp32 / bf16 / fp16 (flattened in row-major order).
        block: elements per scale; the last block may be partial. ``None`` gives one scale for the tensor.
        dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344).
        rowwise: one scale per row of a 2-D ``x`` (overrides ``block`` with ``x.shape[1]``).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :func:`forge_lightning.kernels.use_triton`).

    Returns:
        ``(payload, scales)``: ``payload`` is 1-D with ``x.numel()`` elements of ``dtype``, equal to
        ``clamp(x / scale, -max, max).to(dtype)``; ``scales`` is fp32 ``[ceil(numel / block)]`` with
        ``scale = amax(|block|) / max`` (1.0 for an all-zero block, so zeros round-trip).
    """
    fp8_max = _check_fp8_dtype(dtype)
    resolved = _resolve_block(x, block, rowwise)
    if not use_triton(backend, x):
        return quantize_fp8_reference(x, resolved, dtype)
    return _quantize_triton(x.detach().reshape(-1).contiguous(), resolved, dtype, fp8_max)


def dequantize_fp8(
    payload: torch.Tensor,
    scales: torch.Tensor,
    block: int | None = 256,
    shape: torch.Size | tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``payload * scale`` per block, cast to ``dtype``.

    Args:
        payload: the FP8 payload (flattened order of the original tensor).
        scales: fp32 scales, one per ``block`` elements (one in total for ``block=None``).
        block: the block size used to quantize; ``None`` for per-tensor. For a ``rowwise`` payload pass
            the row length.
        shape: the shape to return (default: 1-D).
        dtype: the output dtype.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :func:`forge_lightning.kernels.use_triton`).

    Returns:
        The dequantized tensor, contiguous, of ``shape`` and ``dtype``.
    """
    resolved = _dequant_block(payload, scales, block)
    if not use_triton(backend, payload, scales):
        return dequantize_fp8_reference(payload, scales, resolved, shape, dtype)
    out = _dequantize_triton(payload.reshape(-1).contiguous(), scales.float().contiguous(), resolved, dtype)
    return out.view(shape if shape is not None else (-1,))

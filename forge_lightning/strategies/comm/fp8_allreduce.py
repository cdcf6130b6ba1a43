"""FP8 all-reduce of a flat fp32 vector: a reduce-scatter by all-to-all, then an all-gather, both in FP8.

Each rank quantizes its vector to e4m3 with one fp32 scale per block of 256 elements, sends chunk ``j`` to rank
``j`` (all-to-all), sums the W received chunks in fp32, divides by W, re-quantizes its reduced chunk and
all-gathers it::

    x (n, fp32) ─ quantize ─ all-to-all ─ dequantize + sum in fp32 ─ / W ─ quantize ─ all-gather ─ dequantize
                 1 B + 4/256 B per element each way

Bytes each rank sends: ``2 (W-1)/W · n · (1 + 4/256)``, against ``2 (W-1)/W · n · 2`` for a bf16 ring
all-reduce: a ratio of 0.508. Collectives that reject float8 (gloo) get the payload as ``uint8`` bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from forge_lightning.kernels.fp8 import dequantize_fp8, quantize_fp8

FP8 = torch.float8_e4m3fn


def _padded(n: int, world: int, block: int) -> int:
    unit = world * block
    return -(-n // unit) * unit


def fp8_all_reduce_bytes(numel: int, world_size: int, block: int = 256) -> int:
    """Bytes one rank sends in :func:`fp8_all_reduce_` of ``numel`` elements (payload plus fp32 scales)."""
    padded = _padded(numel, world_size, block)
    per_rank_chunk = padded // world_size
    chunk_bytes = per_rank_chunk + 4 * (per_rank_chunk // block)
    return 2 * (world_size - 1) * chunk_bytes


def _quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    payload, scales = quantize_fp8(x, block, FP8)
    return payload.view(torch.uint8), scales


def _dequantize(payload_u8: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    return dequantize_fp8(payload_u8.view(FP8), scales, block)


def fp8_all_reduce_(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    block: int = 256,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Average ``flat`` (1-D fp32) over ``group`` in place, communicating FP8 with block scales.

    Args:
        flat: this rank's values; overwritten with the (approximate) mean over ranks.
        group: process group (default: world).
        block: elements per fp32 scale.
        residual: error-feedback buffer of ``flat``'s size: added before quantizing and replaced by this rank's
            local quantization error (``None``: no error feedback).

    Returns:
        ``flat``.
    """
    world = dist.get_world_size(group)
    n = flat.numel()
    padded = _padded(n, world, block)
    x = torch.zeros(padded, dtype=torch.float32, device=flat.device)
    x[:n] = flat
    if residual is not None:
        x[:n] += residual
    payload, scales = _quantize(x, block)  # [padded] uint8, [padded / block] fp32
    if residual is not None:
        residual.copy_((x - _dequantize(payload, scales, block))[:n])
    recv_payload, recv_scales = torch.empty_like(payload), torch.empty_like(scales)
    dist.all_to_all_single(recv_payload, payload, group=group)
    dist.all_to_all_single(recv_scales, scales, group=group)
    chunk = padded // world
    parts_WC = _dequantize(recv_payload, recv_scales, block).view(world, chunk)
    reduced_C = parts_WC.sum(dim=0) / world
    mine, my_scales = _quantize(reduced_C, block)
    all_payload, all_scales = torch.empty_like(payload), torch.empty_like(scales)
    dist.all_gather_into_tensor(all_payload, mine, group=group)
    dist.all_gather_into_tensor(all_scales, my_scales, group=group)
    flat.copy_(_dequantize(all_payload, all_scales, block)[:n].to(flat.dtype))
    return flat

"""Compressed communication: bf16 / block-scaled FP8 all-reduce hooks for DDP, and for FSDP2 the delta-FP8
parameter all-gather and the FP8 / bf16 gradient reduce-scatter with error feedback."""

from forge_lightning.strategies.comm.delta_fp8 import (
    PARAM_ALL_GATHER,
    DeltaFP8AllGather,
    DeltaFP8AllGatherComm,
    DeltaStats,
    FSDPCommHandles,
    apply_fsdp_comm_options,
    check_fsdp_comm_options,
    delta_all_gather_bytes,
    enable_delta_fp8_all_gather,
    exact_all_gather_bytes,
)
from forge_lightning.strategies.comm.fp8_allreduce import fp8_all_reduce_, fp8_all_reduce_bytes
from forge_lightning.strategies.comm.fp8_reduce_scatter import (
    GRADIENT_REDUCE,
    CompressedReduceScatter,
    ReduceScatterStats,
    compressed_reduce_scatter,
    compressed_reduce_scatter_bytes,
    enable_fp8_reduce_scatter,
)
from forge_lightning.strategies.comm.hooks import CommHookState, bf16_hook, fp8_hook, make_comm_hook

__all__ = [
    "GRADIENT_REDUCE",
    "PARAM_ALL_GATHER",
    "CommHookState",
    "CompressedReduceScatter",
    "DeltaFP8AllGather",
    "DeltaFP8AllGatherComm",
    "DeltaStats",
    "FSDPCommHandles",
    "ReduceScatterStats",
    "apply_fsdp_comm_options",
    "bf16_hook",
    "check_fsdp_comm_options",
    "compressed_reduce_scatter",
    "compressed_reduce_scatter_bytes",
    "delta_all_gather_bytes",
    "enable_delta_fp8_all_gather",
    "enable_fp8_reduce_scatter",
    "exact_all_gather_bytes",
    "fp8_all_reduce_",
    "fp8_all_reduce_bytes",
    "fp8_hook",
    "make_comm_hook",
]

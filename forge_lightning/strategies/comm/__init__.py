"""Compressed gradient communication for DDP: bf16 and block-scaled FP8 all-reduce hooks."""

from forge_lightning.strategies.comm.fp8_allreduce import fp8_all_reduce_, fp8_all_reduce_bytes
from forge_lightning.strategies.comm.hooks import CommHookState, bf16_hook, fp8_hook, make_comm_hook

__all__ = [
    "CommHookState",
    "bf16_hook",
    "fp8_all_reduce_",
    "fp8_all_reduce_bytes",
    "fp8_hook",
    "make_comm_hook",
]

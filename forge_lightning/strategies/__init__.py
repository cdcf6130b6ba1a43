"""Strategies (backends) and their checkpoint I/O.

Importable as ``forge_lightning.strategies.<Name>`` and registered in Lightning's ``StrategyRegistry`` under short
names (``trainer.strategy: fsdp2``); see docs/strategies.md.
"""

from lightning.pytorch.strategies import StrategyRegistry

from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO
from forge_lightning.strategies.ddp import DDPStrategy
from forge_lightning.strategies.fsdp2 import FSDP2Strategy

# megatron-core (the optional ``megatron`` extra) is imported only when MegatronStrategy sets up.
from forge_lightning.strategies.megatron import MegatronStrategy
from forge_lightning.strategies.zero1 import ZeRO1Strategy

__all__ = ["AtomicCheckpointIO", "DDPStrategy", "FSDP2Strategy", "MegatronStrategy", "ZeRO1Strategy"]


def _register() -> None:
    entries = [
        ("fsdp2", FSDP2Strategy, "FSDP2 (fully_shard) from the module's parallel plan", {}),
        (
            "hsdp",
            FSDP2Strategy,
            "FSDP2 sharded within a node and replicated across nodes",
            {"data_parallel_replicate_size": "auto"},
        ),
        ("zero1", ZeRO1Strategy, "DDP with the optimizer state sharded across ranks (ZeRO-1)", {}),
        ("ddp_bf16", DDPStrategy, "DDP with a bf16 gradient all-reduce", {"comm_hook": "bf16"}),
        ("ddp_fp8", DDPStrategy, "DDP with a block-scaled FP8 gradient all-reduce", {"comm_hook": "fp8"}),
        (
            "megatron",
            MegatronStrategy,
            "megatron-core: TP / PP / VPP / SP / CP / EP, distributed optimizer",
            {},
        ),
    ]
    for name, cls, description, init_params in entries:
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description, **init_params)


_register()

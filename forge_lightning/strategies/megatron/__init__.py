"""megatron-core as a Lightning strategy (``MegatronStrategy``, short name ``megatron``); see docs/megatron.md.

Importing this package needs megatron-core (the ``megatron`` extra).
"""

from lightning.pytorch.strategies import StrategyRegistry

from forge_lightning.strategies.megatron.checkpoint import MegatronCheckpointIO
from forge_lightning.strategies.megatron.strategy import MegatronStrategy

__all__ = ["MegatronCheckpointIO", "MegatronStrategy"]

if "megatron" not in StrategyRegistry:
    StrategyRegistry.register(
        "megatron",
        MegatronStrategy,
        description="megatron-core: TP / PP / VPP / SP, DDP, distributed optimizer",
    )

"""megatron-core as a Lightning strategy (``MegatronStrategy``, short name ``megatron``); see docs/megatron.md.

Importing this package needs no megatron-core: the strategy imports it when it sets up (the ``megatron`` extra).
"""

from forge_lightning.strategies.megatron.checkpoint import MegatronCheckpointIO
from forge_lightning.strategies.megatron.strategy import MegatronStrategy

__all__ = ["MegatronCheckpointIO", "MegatronStrategy"]

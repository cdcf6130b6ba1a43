"""``ZeRO1Strategy``: DDP with the optimizer state sharded across data-parallel ranks (ZeRO stage 1).

Gradients are all-reduced as in DDP; each rank then updates only the parameters it owns (whole tensors,
balanced by size) with its shard of the optimizer state, and broadcasts them to the others (torch's
``ZeroRedundancyOptimizer``). Optimizer state memory per rank drops to about ``1 / data_parallel_size``.

Checkpoints are single files: the sharded state is consolidated on rank 0 when saving (Lightning calls the
optimizer's ``consolidate_state_dict``), and on load each rank keeps its own partition, so a checkpoint resumes
at any world size.

``Muon`` (``optimizer.name: muon``) is not wrapped: it shards its state tensor-wise itself, every matrix's momentum
and every AdamW tensor's moments on one owner rank (docs/optimizers.md), and consolidates it the same way.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from forge_lightning.contracts import process_group_backend
from forge_lightning.optim.muon import Muon


class ZeRO1Strategy(DDPStrategy):
    """DDP + optimizer-state sharding (registered as ``zero1``).

    Takes every argument of Lightning's ``DDPStrategy`` (``process_group_backend``, ``timeout``, DDP kwargs
    such as ``bucket_cap_mb``), plus:

    Args:
        parameters_as_bucket_view: pack each rank's parameters into contiguous buckets for the broadcast
            (faster broadcast, parameters become views).
        **kwargs: passed to Lightning's ``DDPStrategy``.
    """

    strategy_name = "zero1"

    def __init__(self, *, parameters_as_bucket_view: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.parameters_as_bucket_view = parameters_as_bucket_view

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel ranks (the world size)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel index (the global rank)."""
        return self.global_rank

    @override
    def _get_process_group_backend(self) -> str:
        """The configured backend, else the accelerator's (:class:`~forge_lightning.contracts.DistributedDevices`),
        else Lightning's default for the device."""
        return self._process_group_backend or process_group_backend(self.accelerator, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self.optimizers = [self._shard(opt) for opt in self.optimizers]

    def _shard(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        if isinstance(optimizer, Muon):
            # Muon shards tensor-wise itself: each matrix's momentum (and, now, each AdamW tensor's state) on its
            # owner rank; ZeroRedundancyOptimizer's partition would split the owners' work a second way.
            optimizer.set_shard_adamw_state(True)
            rank_zero_info(
                f"{type(self).__name__}: Muon keeps each tensor's state on one owner rank of {self.world_size}"
            )
            return optimizer
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
        groups = [dict(group) for group in optimizer.param_groups]
        sharded = ZeroRedundancyOptimizer(
            groups,
            optimizer_class=type(optimizer),
            parameters_as_bucket_view=self.parameters_as_bucket_view,
            **defaults,
        )
        # Schedulers were built on the plain optimizer: point them at the sharded one, whose param_groups
        # (lr included) it copies into the local optimizer at every step.
        for config in self.lr_scheduler_configs:
            if config.scheduler.optimizer is optimizer:
                config.scheduler.optimizer = sharded
        owned = (
            sum(p.numel() for p in sharded.optim.param_groups[0]["params"])
            if sharded.optim.param_groups
            else 0
        )
        rank_zero_info(
            f"{type(self).__name__}: {type(optimizer).__name__} state sharded over {self.world_size} ranks "
            f"(rank 0 owns {owned} elements of its first parameter group)"
        )
        return sharded

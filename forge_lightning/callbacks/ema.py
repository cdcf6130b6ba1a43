"""``EMA``: an exponential moving average of the trainable weights, for evaluation and export.

After every optimizer step (from ``start_step`` on, every ``update_every`` steps)::

    ema <- decay * ema + (1 - decay) * weight            (in fp32, whatever the weights' dtype)

Validation, test and predict run on the averaged weights when ``evaluate_with_ema``: they are swapped in at the
start and the training weights swapped back at the end. The average lives in the checkpoint (callback state), so
a resumed run continues the same average; ``apply_at_end`` copies it into the model when training ends (e.g. for
an HF export or a policy evaluation after ``fit``).

Under a strategy that shards parameters (FSDP2 / HSDP, with or without TP: the parameters are DTensors) the
average is a DTensor sharded exactly like its parameter: each rank averages, swaps and applies only its local
shard, and nothing is gathered. Such a strategy's sharded checkpoint saves the average through
``torch.distributed.checkpoint`` (see ``forge_lightning.strategies.distributed_checkpoint``), so it resumes at
another world size too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.tensor import DTensor
from typing_extensions import override


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor`` (a DTensor's local shard, sharing its storage), detached."""
    tensor = tensor.detach()
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _reshard(module: torch.nn.Module) -> None:
    """Drop parameters that FSDP2 keeps gathered between forwards (the root's after an evaluation forward; every
    unit's with ``reshard_after_forward`` / ``reshard_after_backward`` off), so that the next forward gathers from
    the shards the average was just written into.
    """
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


class EMA(Callback):
    """Exponential moving average of the trainable parameters (frozen ones are not averaged).

    Works under every native strategy: where ranks hold whole parameters (single device, DDP, ZeRO-1) the average is
    whole too; under FSDP2 / HSDP (DTensor parameters) it is sharded like the parameters and kept in fp32, updated
    and swapped shard by shard. Its state is a callback state: in ``meta.pt`` / the ``.ckpt`` file for whole
    parameters, in the DCP shards for DTensors (``FSDP2Strategy``'s checkpoints, which reshard on load).

    Args:
        decay: weight of the running average per update (0.999: a horizon of about 1000 updates).
        update_every: optimizer steps between updates.
        start_step: first optimizer step that updates the average (before it the average tracks the weights).
        evaluate_with_ema: validate / test / predict with the averaged weights.
        apply_at_end: copy the average into the model when training ends.
    """

    def __init__(
        self,
        decay: float = 0.999,
        update_every: int = 1,
        start_step: int = 0,
        evaluate_with_ema: bool = True,
        apply_at_end: bool = False,
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay ({decay}) must be in (0, 1)")
        if update_every < 1 or start_step < 0:
            raise ValueError(
                f"EMA update_every ({update_every}) must be >= 1 and start_step ({start_step}) >= 0"
            )
        self.decay, self.update_every, self.start_step = decay, update_every, start_step
        self.evaluate_with_ema, self.apply_at_end = evaluate_with_ema, apply_at_end
        self.names: list[str] = []
        self.average: list[torch.Tensor] = []  # fp32; DTensors placed like the parameters under FSDP2
        self._params: list[torch.nn.Parameter] = []
        self._loaded: dict[str, torch.Tensor] | None = None
        self._backup: list[torch.Tensor] | None = None
        self._last_step = -1

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # FSDP2 registers its gathered parameters on a module while they are gathered; the sharded ones are those
        # the optimizer updates, and they keep their identity, so they are taken once here.
        _reshard(pl_module)
        params = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        self.names, self._params = [n for n, _ in params], [p for _, p in params]
        self.average = [p.detach().float().clone() for p in self._params]
        if self._loaded is not None:
            self._use_loaded()
        sharded = sum(isinstance(p, DTensor) for p in self._params)
        where = f" ({sharded} sharded: averaged shard by shard)" if sharded else ""
        rank_zero_info(f"EMA: {len(self.average)} parameter tensors{where}, decay {self.decay}")

    def _use_loaded(self) -> None:
        assert self._loaded is not None
        missing = sorted(set(self.names) - set(self._loaded))
        if missing:
            raise ValueError(
                f"the checkpoint's EMA state lacks {len(missing)} parameters, e.g. {missing[:3]}"
            )
        # A sharded checkpoint loads DTensors already placed like self.average (their templates).
        self.average = [
            self._loaded[n].to(a.device, torch.float32) for n, a in zip(self.names, self.average, strict=True)
        ]
        self._loaded = None

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step or not self.average:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_step = step
        with torch.no_grad():
            average = [_local(a) for a in self.average]
            weights = [_local(p).float() for p in self._params]  # a copy only for low-precision weights
            if step <= self.start_step:
                torch._foreach_copy_(average, weights)
            elif step % self.update_every == 0:
                torch._foreach_lerp_(average, weights, 1.0 - self.decay)

    def _write(self, pl_module: LightningModule, values: Sequence[torch.Tensor]) -> None:
        """Copy ``values`` (whole tensors or local shards) into the parameters this rank holds."""
        _reshard(pl_module)
        with torch.no_grad():
            torch._foreach_copy_([_local(p) for p in self._params], [_local(v) for v in values])
        changed = getattr(pl_module.trainer.strategy, "parameters_changed", None)  # FSDP2Strategy
        if callable(changed):
            changed()

    def _swap_in(self, pl_module: LightningModule) -> None:
        if not self.evaluate_with_ema or not self.average or self._backup is not None:
            return
        self._backup = [_local(p).clone() for p in self._params]
        self._write(pl_module, self.average)

    def _swap_out(self, pl_module: LightningModule) -> None:
        if self._backup is None:
            return
        self._write(pl_module, self._backup)
        self._backup = None

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_in(pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(pl_module)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_in(pl_module)

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(pl_module)

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_in(pl_module)

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.apply_at_end and self.average:
            self._write(pl_module, self.average)

    @override
    def state_dict(self) -> dict[str, Any]:
        # DTensors stay as they are: a sharded checkpoint writes them through DCP, shard by shard.
        return {
            "average": {
                n: t if isinstance(t, DTensor) else t.detach().cpu()
                for n, t in zip(self.names, self.average, strict=True)
            },
            "last_step": self._last_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict["average"])
        self._last_step = int(state_dict["last_step"])
        if self.average:
            # Strategies that restore after setup (FSDP2: the DCP load needs the sharded model) do it after
            # on_fit_start, which built the average: replace it now.
            self._use_loaded()

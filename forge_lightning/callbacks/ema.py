"""``EMA``: an exponential moving average of the trainable weights, for evaluation and export.

After every optimizer step (from ``start_step`` on, every ``update_every`` steps)::

    ema <- decay * ema + (1 - decay) * weight            (in fp32, whatever the weights' dtype)

Validation, test and predict run on the averaged weights when ``evaluate_with_ema``: they are swapped in at the
start and the training weights swapped back at the end. The average lives in the checkpoint (callback state), so
a resumed run continues the same average; ``apply_at_end`` copies it into the model when training ends (e.g. for
an HF export or a policy evaluation after ``fit``).

The weights are those the strategy trains (:func:`~forge_lightning.contracts.trained_parameters`): the module's
own parameters under the native strategies, the twin's chunks under ``MegatronStrategy`` (which never trains the
module's own parameters; see ``MegatronStrategy.trained_parameters``).

Under a strategy that shards parameters (FSDP2 / HSDP, with or without TP: the parameters are DTensors) the
average is a DTensor sharded exactly like its parameter: each rank averages, swaps and applies only its local
shard, and nothing is gathered. Such a strategy's sharded checkpoint saves the average through
``torch.distributed.checkpoint`` (see ``forge_lightning.strategies.distributed_checkpoint``), so it resumes at
another world size too. Under ``MegatronStrategy`` the average is this rank's TP / PP shards of the twin's
parameters, and its dist-checkpoint saves them sharded like the parameters (the average is keyed by the strategy's
parameter names: per-parameter callback state, see :class:`~forge_lightning.contracts.TrainedParameters`), so it
resumes at another layout too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.tensor import DTensor
from typing_extensions import override

from forge_lightning.contracts import (
    ParameterResync,
    TrainedParameters,
    complete_parameter_gather,
    trained_parameters,
)


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

    Works under every strategy: where ranks hold whole parameters (single device, DDP, ZeRO-1) the average is
    whole too; under FSDP2 / HSDP (DTensor parameters) it is sharded like the parameters and kept in fp32, updated
    and swapped shard by shard; under MegatronStrategy it averages the twin's parameters this rank holds (its TP /
    PP shards; in bf16 runs the bf16 model weights, averaged in fp32). Its state is a callback state: in
    ``meta.pt`` / the ``.ckpt`` file for whole parameters, in the DCP shards for DTensors (``FSDP2Strategy``'s
    checkpoints, which reshard on load), in the dist-checkpoint's shards under MegatronStrategy.

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
        params = trained_parameters(trainer.strategy, pl_module)
        self.names, self._params = [n for n, _ in params], [p for _, p in params]
        self.average = [p.detach().float().clone() for p in self._params]
        if self._loaded is not None:
            self._use_loaded()
        sharded = sum(isinstance(p, DTensor) for p in self._params)
        where = f" ({sharded} sharded: averaged shard by shard)" if sharded else ""
        if isinstance(trainer.strategy, TrainedParameters):
            where = f" of {type(trainer.strategy).__name__}'s trained parameters (this rank's shards)"
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
        complete_parameter_gather(trainer.strategy)  # weights gathered lazily are stale between steps
        with torch.no_grad():
            average = [_local(a) for a in self.average]
            weights = [_local(p).float() for p in self._params]  # a copy only for low-precision weights
            if step <= self.start_step:
                torch._foreach_copy_(average, weights)
            elif step % self.update_every == 0:
                torch._foreach_lerp_(average, weights, 1.0 - self.decay)

    def _write(self, trainer: Trainer, pl_module: LightningModule, values: Sequence[torch.Tensor]) -> None:
        """Copy ``values`` (whole tensors or local shards) into the parameters this rank holds."""
        _reshard(pl_module)
        with torch.no_grad():
            torch._foreach_copy_([_local(p) for p in self._params], [_local(v) for v in values])
        if isinstance(trainer.strategy, ParameterResync):  # FSDP2Strategy's delta-FP8 all-gather
            trainer.strategy.parameters_changed()

    def _swap_in(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        """Write the average into the trained weights, keeping a copy of them; whether it did (not when already
        swapped in or before the average exists)."""
        if not self.average or self._backup is not None:
            return False
        complete_parameter_gather(trainer.strategy)
        self._backup = [_local(p).clone() for p in self._params]
        self._write(trainer, pl_module, self.average)
        return True

    def _swap_out(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._backup is None:
            return
        self._write(trainer, pl_module, self._backup)
        self._backup = None

    @contextmanager
    def averaged(self, trainer: Trainer, pl_module: LightningModule) -> Iterator[None]:
        """Within it, the trained weights hold the average (e.g. to export it: ``full_model_state_dict``,
        ``save_pretrained``, which every rank then calls); the training weights are back afterwards. From
        ``on_fit_start`` on; within an evaluation on the average it changes nothing."""
        swapped = self._swap_in(trainer, pl_module)
        try:
            yield
        finally:
            if swapped:
                self._swap_out(trainer, pl_module)

    def _evaluation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.evaluate_with_ema:
            self._swap_in(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_start(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(trainer, pl_module)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_start(trainer, pl_module)

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_start(trainer, pl_module)

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.apply_at_end and self.average:
            self._write(trainer, pl_module, self.average)

    @override
    def state_dict(self) -> dict[str, Any]:
        # DTensors stay as they are: a sharded checkpoint writes them through DCP, shard by shard. Under
        # MegatronStrategy the average is per-parameter state (keyed by its trained-parameter names), which its
        # dist-checkpoint writes sharded like the parameters.
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

"""``EMA``: an exponential moving average of the trainable weights, for evaluation and export.

After every optimizer step (from ``start_step`` on, every ``update_every`` steps)::

    ema <- decay * ema + (1 - decay) * weight            (in fp32, whatever the weights' dtype)

Validation (and test / predict) runs on the averaged weights when ``evaluate_with_ema``: they are swapped in at the
start and the training weights swapped back at the end. The average lives in the checkpoint (callback state), so
a resumed run continues the same average; ``apply_at_end`` copies it into the model when training ends (e.g. for
an HF export or a policy evaluation after ``fit``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class EMA(Callback):
    """Exponential moving average of the trainable parameters.

    Works where every rank holds whole parameters (single device, DDP, ZeRO-1); under a strategy that shards
    parameters it refuses to start (the average would be sharded too, and checkpoints keep callback state whole).

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
        self.average: list[torch.Tensor] = []
        self._loaded: dict[str, torch.Tensor] | None = None
        self._backup: list[torch.Tensor] | None = None
        self._last_step = -1

    def _params(self, module: LightningModule) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        params = self._params(pl_module)
        if any(type(p.data).__name__ == "DTensor" for _, p in params):
            raise ValueError(
                "EMA needs whole parameters on every rank; this strategy shards them. Use DDPStrategy or "
                "ZeRO1Strategy (or no data parallelism) with the EMA callback"
            )
        self.names = [n for n, _ in params]
        if self._loaded is not None:
            missing = sorted(set(self.names) - set(self._loaded))
            if missing:
                raise ValueError(
                    f"the checkpoint's EMA state lacks {len(missing)} parameters, e.g. {missing[:3]}"
                )
            self.average = [self._loaded[n].to(p.device, torch.float32) for n, p in params]
            self._loaded = None
        else:
            self.average = [p.detach().float().clone() for _, p in params]
        rank_zero_info(f"EMA: {len(self.average)} parameter tensors, decay {self.decay}")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step or not self.average:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_step = step
        weights = [p.detach().float() for _, p in self._params(pl_module)]
        if step <= self.start_step:
            torch._foreach_copy_(self.average, weights)
        elif step % self.update_every == 0:
            torch._foreach_lerp_(self.average, weights, 1.0 - self.decay)

    def _swap_in(self, pl_module: LightningModule) -> None:
        if not self.evaluate_with_ema or not self.average or self._backup is not None:
            return
        params = [p for _, p in self._params(pl_module)]
        self._backup = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, avg in zip(params, self.average, strict=True):
                p.copy_(avg)

    def _swap_out(self, pl_module: LightningModule) -> None:
        if self._backup is None:
            return
        with torch.no_grad():
            for (_, p), saved in zip(self._params(pl_module), self._backup, strict=True):
                p.copy_(saved)
        self._backup = None

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_in(pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.apply_at_end and self.average:
            with torch.no_grad():
                for (_, p), avg in zip(self._params(pl_module), self.average, strict=True):
                    p.copy_(avg)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "average": {n: t.detach().cpu() for n, t in zip(self.names, self.average, strict=True)},
            "last_step": self._last_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict["average"])
        self._last_step = int(state_dict["last_step"])

"""Progress bars whose training bar counts optimizer steps, the unit of ``trainer.max_steps``.

Lightning's bars count micro-batches: with ``accumulate_grad_batches: 2`` and ``max_steps: 40`` they end at
``80/40``, and training by steps (``max_epochs`` -1) shows ``Epoch 0/-2``. Here the training bar shows

- training by ``max_steps`` (``max_epochs`` -1 / ``None``): ``Epoch 1  20/40``, the global step of the whole
  run against ``max_steps`` (a resumed run starts at the restored global step);
- training by ``max_epochs``: ``Epoch 1/3  7/10``, the optimizer steps of this epoch against the steps of an
  epoch (Lightning steps every ``accumulate_grad_batches`` micro-batches and on the epoch's last one, so a
  partial last window is one step), or fewer when ``max_steps`` ends the epoch early.

Epochs are counted from 1 here (checkpoint names keep Lightning's 0-based ``epoch=0``). Validation, test and
predict bars are Lightning's.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from typing_extensions import override


def train_bar_counts(trainer: Trainer, batches: int) -> tuple[int | float, int]:
    """The training bar's ``(total, completed)`` optimizer steps after ``batches`` micro-batches of this epoch.

    Args:
        trainer: the running trainer.
        batches: micro-batches of the current epoch done so far (``batch_idx + 1``; counts on from a restored
            checkpoint's position when resuming mid-epoch).
    """
    if trainer.max_epochs in (None, -1) and trainer.max_steps > 0:
        return trainer.max_steps, trainer.global_step
    accumulate = trainer.accumulate_grad_batches
    epoch_batches = trainer.num_training_batches
    last = batches >= epoch_batches or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    done = math.ceil(batches / accumulate) if last else batches // accumulate
    total = math.ceil(epoch_batches / accumulate) if math.isfinite(epoch_batches) else epoch_batches
    if trainer.max_steps > 0:  # max_steps may end this epoch before its last batch
        total = min(total, trainer.max_steps - (trainer.global_step - done))
    return total, done


def epoch_description(trainer: Trainer) -> str:
    """``Epoch 2`` when training by steps, ``Epoch 2/3`` when by ``max_epochs`` (counted from 1)."""
    epoch = trainer.current_epoch + 1
    return f"Epoch {epoch}" if trainer.max_epochs in (None, -1) else f"Epoch {epoch}/{trainer.max_epochs}"


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, its training bar counting optimizer steps (see the module docstring).

    Takes :class:`~lightning.pytorch.callbacks.RichProgressBar`'s arguments; ``forge`` adds one with
    ``leave=True`` unless ``trainer.callbacks`` has a progress bar or ``trainer.enable_progress_bar`` is false.
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        # Padded to the validation bar's description so that the columns do not shift between the two.
        return f"{epoch_description(self.trainer):{len(self.validation_description)}}"

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._show_steps(trainer, batches=0)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # resumed mid-epoch: no on_train_epoch_start
        self._show_steps(trainer, batches=batch_idx + 1)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def _show_steps(self, trainer: Trainer, batches: int) -> None:
        if self.progress is None or self.is_disabled or self.train_progress_bar_id is None:
            return
        total, done = train_bar_counts(trainer, batches)
        self.progress.update(self.train_progress_bar_id, total=total, completed=done)
        self.refresh()


class StepTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar, its training bar counting optimizer steps (see the module docstring).

    For runs that choose tqdm (``trainer.callbacks: [forge_lightning.callbacks.StepTQDMProgressBar]``); takes
    :class:`~lightning.pytorch.callbacks.TQDMProgressBar`'s arguments.
    """

    @override
    def on_train_start(self, trainer: Trainer, *_: Any) -> None:
        super().on_train_start(trainer)
        self._reset_train_bar(trainer)  # a run resumed mid-epoch gets no on_train_epoch_start

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self._reset_train_bar(trainer)

    def _reset_train_bar(self, trainer: Trainer) -> None:
        total, done = train_bar_counts(trainer, batches=0)
        bar = self.train_progress_bar
        bar.reset(total=convert_inf(total))
        bar.initial = bar.n = done  # tqdm's rate counts from `initial`
        bar.set_description(epoch_description(trainer))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        total, done = train_bar_counts(trainer, batches=batch_idx + 1)
        bar = self.train_progress_bar
        bar.total = convert_inf(total)
        if bar.disable or done == bar.n or not self._should_update(done, bar.total):
            return
        bar.n = done
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

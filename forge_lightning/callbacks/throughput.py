"""Throughput, TFLOP/s, MFU, data-wait and peak-memory logging for any LightningModule.

A module reports what a batch holds by implementing ``batch_stats(batch) -> dict`` with any of ``samples``,
``tokens`` and ``flops`` (training FLOPs of the micro-batch: forward + backward). The callback times whole
optimizer steps over a window and logs per-device and global rates. The global counts are summed over the
data-parallel ranks (the ranks of one tensor-parallel group share their data rank's batch), and the per-device
rates are the global ones over all processes. Devices are the strategy's (``root_device``): under
``MegatronStrategy`` the LightningModule's own parameters stay on the CPU while the twin trains on the GPU.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from forge_lightning.accelerators.capabilities import capabilities
from forge_lightning.contracts import MeasuredDevices, MeasuredModule

_KEYS = ("samples", "tokens", "flops")


class ThroughputMonitor(Callback):
    """Logs ``throughput/*`` (samples/s, tokens/s, TFLOP/s, MFU, data-wait %) and ``memory/peak_gb``.

    Args:
        peak_tflops: the per-device peak used for MFU. ``None`` uses the device platform's dense bf16 peak
            (``forge_lightning.accelerators.capabilities``: 989 TFLOP/s, H100 / H200, on NVIDIA GPUs) and logs no
            MFU where the platform has none (Kunlun XPUs, the CPU).
        window: optimizer steps per measurement window (the first window after start-up is skipped as warm-up).
        log_summary: print the mean of all measured windows when training ends.
    """

    def __init__(self, peak_tflops: float | None = None, window: int = 10, log_summary: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window ({window}) must be >= 1")
        self.peak_tflops = peak_tflops
        self.window = window
        self.log_summary = log_summary
        self._reset_window()
        self._history: list[dict[str, float]] = []
        self._warm = False

    def _reset_window(self) -> None:
        self._counts = dict.fromkeys(_KEYS, 0.0)
        self._start_step: int | None = None
        self._data_wait = 0.0
        self._window_start: float | None = None
        self._last_batch_end: float | None = None

    def _peak(self, device: torch.device) -> float | None:
        if self.peak_tflops is not None:
            return self.peak_tflops
        return capabilities(device).peak_bf16_tflops

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._window_start is None:
            _synchronize(trainer)
            self._window_start = time.perf_counter()
            self._start_step = trainer.global_step
        elif self._last_batch_end is not None:
            self._data_wait += now - self._last_batch_end
        stats = pl_module.batch_stats(batch) if isinstance(pl_module, MeasuredModule) else {}
        for key in self._counts:
            self._counts[key] += float(stats.get(key, 0.0))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._last_batch_end = time.perf_counter()
        steps = trainer.global_step - (self._start_step or 0)
        if steps < self.window:
            return
        _synchronize(trainer)
        elapsed = time.perf_counter() - self._window_start
        metrics = self._rates(trainer, pl_module, elapsed, steps)
        if self._warm:
            self._history.append(metrics)
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step - 1)
        self._warm = True
        self._reset_window()

    def _rates(
        self, trainer: Trainer, pl_module: LightningModule, elapsed: float, steps: int
    ) -> dict[str, float]:
        world = trainer.world_size
        # Summed by the strategy's reduce, over its data-parallel ranks: the TP ranks of one replica count its batch
        # once (FSDP2Strategy reduces over its data-parallel group; DDP over all processes).
        local = torch.tensor(
            [self._counts[k] for k in _KEYS], dtype=torch.float64, device=trainer.strategy.root_device
        )
        counts = dict(zip(_KEYS, trainer.strategy.reduce(local, reduce_op="sum").tolist(), strict=True))
        metrics = {"throughput/step_time_s": elapsed / steps}
        for key in ("samples", "tokens"):
            if counts[key]:
                metrics[f"throughput/{key}_per_sec_per_device"] = counts[key] / world / elapsed
                metrics[f"throughput/{key}_per_sec"] = counts[key] / elapsed
        if counts["flops"]:
            tflops = counts["flops"] / world / elapsed / 1e12
            metrics["throughput/tflops_per_device"] = tflops
            peak = self._peak(trainer.strategy.root_device)
            if peak:
                metrics["throughput/mfu"] = tflops / peak
        metrics["throughput/data_wait_pct"] = 100.0 * self._data_wait / elapsed
        peak_gb = _peak_memory_gb(trainer)
        if peak_gb is not None:
            metrics["memory/peak_gb"] = peak_gb
        return metrics

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not (self.log_summary and self._history):
            return
        keys = self._history[0].keys()
        mean = {k: sum(h[k] for h in self._history) / len(self._history) for k in keys}
        parts = [f"{k.split('/')[-1]}={v:.4g}" for k, v in mean.items()]
        rank_zero_info(
            f"throughput over {len(self._history)} windows of {self.window} steps: " + ", ".join(parts)
        )


def _synchronize(trainer: Trainer) -> None:
    device = trainer.strategy.root_device
    if isinstance(trainer.accelerator, MeasuredDevices):  # e.g. Kunlun: through the accelerator's runtime
        trainer.accelerator.synchronize(device)
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_gb(trainer: Trainer) -> float | None:
    device = trainer.strategy.root_device
    if isinstance(trainer.accelerator, MeasuredDevices):
        peak = trainer.accelerator.peak_memory_bytes(device)
        return None if peak is None else peak / 1e9
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    # ru_maxrss is KiB on Linux, bytes on macOS: the process's peak resident set.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9

"""``RouterLoadRecorder``: each MoE layer's tokens per expert at every optimizer step, for the placement simulator.

The routers already count their assignments (:attr:`MoEBlock.stats.tokens_per_expert`); the recorder reads them
after every micro-batch (no numerics change), sums the micro-batches of an optimizer step and the data-parallel
ranks, and on rank zero writes ``loads`` ``[steps, layers, experts]`` with ``steps`` (the optimizer step of each
row) and a ``meta`` JSON string to one ``.npz`` file when training ends
(``python -m forge_lightning.tools.moe_placement`` replays it). It also logs the load imbalance: ``moe/load_max_
over_mean`` (per expert, mean over layers) and, with ``ep_size``, ``moe/ep_rank_load_max_over_mean``: that of the
ranks of plain expert parallelism.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from forge_lightning.atomic_io import write_file
from forge_lightning.modules.layers.moe import MoEBlock


class RouterLoadRecorder(Callback):
    """Records and logs the routers' per-expert loads of every optimizer step.

    Args:
        path: the ``.npz`` file to write when training ends (``None``: log only).
        ep_size: expert-parallel ranks to log plain EP's per-rank imbalance for (``None``: not logged).
        description: what the run is (stored in the file's ``meta``).
    """

    def __init__(
        self, path: str | Path | None = None, *, ep_size: int | None = None, description: str = ""
    ) -> None:
        if ep_size is not None and ep_size < 1:
            raise ValueError(f"ep_size ({ep_size}) must be a positive number of ranks")
        self.path = None if path is None else Path(path)
        self.ep_size, self.description = ep_size, description
        self.rows: list[np.ndarray] = []
        self.steps: list[int] = []
        self._pending: torch.Tensor | None = None
        self._step = 0

    @staticmethod
    def blocks(module: torch.nn.Module) -> list[MoEBlock]:
        """The MoE blocks of ``module`` in module order."""
        return [m for m in module.modules() if isinstance(m, MoEBlock)]

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.blocks(pl_module):
            raise ValueError("RouterLoadRecorder needs a model with MoE layers; this one has none")
        self._step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = [block.stats for block in self.blocks(pl_module)]
        if any(s is None for s in stats):
            raise ValueError(
                "RouterLoadRecorder: the model's MoE blocks ran no forward in this step; it reads the native "
                "MoEBlock routers, so it cannot record a run whose MoE layers run elsewhere (MegatronStrategy "
                "trains the megatron-core twin: drop the recorder there)"
            )
        load_LE = torch.stack([s.tokens_per_expert.detach().float() for s in stats])
        self._pending = load_LE if self._pending is None else self._pending + load_LE
        if trainer.global_step > self._step:  # this micro-batch closed an optimizer step
            self._step = trainer.global_step
            load_LE = trainer.strategy.reduce(self._pending, reduce_op="sum")
            self._pending = None
            self.rows.append(load_LE.cpu().numpy())
            self.steps.append(self._step)
            self._log(pl_module, load_LE)

    def _log(self, pl_module: LightningModule, load_LE: torch.Tensor) -> None:
        mean_L = load_LE.mean(-1).clamp(min=1e-12)
        pl_module.log("moe/load_max_over_mean", (load_LE.amax(-1) / mean_L).mean(), rank_zero_only=True)
        if self.ep_size is not None and load_LE.shape[-1] % self.ep_size == 0:
            rank_LR = load_LE.view(load_LE.shape[0], self.ep_size, -1).sum(-1)
            imbalance = (rank_LR.amax(-1) / rank_LR.mean(-1).clamp(min=1e-12)).mean()
            pl_module.log("moe/ep_rank_load_max_over_mean", imbalance, rank_zero_only=True)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.path is None or not trainer.is_global_zero or not self.rows:
            return
        block = self.blocks(pl_module)[0]
        meta = {
            "description": self.description,
            "num_layers": len(self.rows[0]),
            "num_experts": int(self.rows[0].shape[-1]),
            "top_k": int(block.stats.indices.shape[-1]) if block.stats is not None else None,
            "hidden_size": int(block.experts.gate_up_proj.shape[-1]),
            "intermediate_size": int(block.experts.down_proj.shape[-1]),
            "world_size": trainer.world_size,
        }
        save_trace(self.path, np.stack(self.rows), np.asarray(self.steps), meta)


def save_trace(path: str | Path, loads: np.ndarray, steps: np.ndarray, meta: dict[str, Any]) -> Path:
    """Writes a router-load trace: ``loads`` ``[steps, layers, experts]``, ``steps`` and ``meta`` (JSON).

    Args:
        path: the ``.npz`` file.
        loads: tokens per expert of each step and layer.
        steps: the optimizer step of each row.
        meta: what the trace is (``description``, sizes).
    """
    if loads.ndim != 3 or len(steps) != len(loads):
        raise ValueError(f"loads must be [steps, layers, experts] with one step each; got {loads.shape}")
    arrays = {
        "loads": loads.astype(np.float32),
        "steps": np.asarray(steps, dtype=np.int64),
        "meta": json.dumps(meta),
    }
    write_file(path, lambda stream: np.savez_compressed(stream, **arrays))
    return Path(path)


def load_trace(path: str | Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Reads a trace :func:`save_trace` wrote: ``(loads [steps, layers, experts], steps, meta)``.

    Args:
        path: the ``.npz`` file.
    """
    with np.load(path) as data:
        missing = {"loads", "steps", "meta"} - set(data.files)
        if missing:
            raise ValueError(f"{path} is not a router-load trace: it lacks {', '.join(sorted(missing))}")
        return data["loads"].astype(np.float64), data["steps"], json.loads(str(data["meta"]))

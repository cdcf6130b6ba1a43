"""Deterministic, resumable, data-parallel loading of micro-batches grouped into optimizer steps.

One rule for every strategy: ``batch_size`` is the micro-batch per data-parallel rank and ``accumulate`` the
micro-batches per optimizer step. Global micro-batch ``j`` of an epoch is the slice
``order[j*W*B : (j+1)*W*B]`` of the epoch's sample order, rank ``r`` taking the ``r``-th block of ``B``; so one
process with batch ``W*B`` and ``W`` processes with batch ``B`` see the same samples in every step.

Each training micro-batch carries ``step_tokens``: the trainable tokens (labels != ignore_index) of all the
micro-batches of its optimizer step on this rank, counted by reading the whole step ahead. Summed over ranks,
it is the global normaliser of the loss, so gradient accumulation and data parallelism leave the loss unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class StepLoader:
    """Iterable of micro-batches for one data-parallel rank, with a ``state_dict`` for exact resumption.

    The position advances only through :meth:`mark_consumed` (called once a batch reaches the model), so the
    batches the trainer prefetched but never trained on are not counted as seen.

    Args:
        dataset: map-style dataset of samples (dicts of tensors).
        batch_size: micro-batch per rank.
        num_replicas: data-parallel world size.
        rank: this rank's data-parallel index.
        accumulate: micro-batches per optimizer step (an epoch is cut to a whole number of steps).
        seed: seed of the per-epoch shuffle.
        shuffle: shuffle samples each epoch (``False``: dataset order).
        num_workers: DataLoader worker processes.
        pin_memory: pin host memory for faster host-to-device copies.
        collate_fn: collate function (default: torch's).
        prefetch_factor: batches each worker loads ahead (``None``: torch's default; needs ``num_workers > 0``).
        label_key: the batch key holding labels, for ``step_tokens``; ``None`` adds no ``step_tokens``.
        ignore_index: label value excluded from the loss.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        accumulate: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_factor: int | None = None,
        label_key: str | None = "labels",
        ignore_index: int = -100,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank ({rank}) must be in [0, num_replicas={num_replicas})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.accumulate = accumulate
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.collate_fn = collate_fn
        if prefetch_factor is not None and num_workers == 0:
            raise ValueError(f"prefetch_factor ({prefetch_factor}) needs num_workers > 0")
        self.prefetch_factor = prefetch_factor
        self.label_key = label_key
        self.ignore_index = ignore_index
        self.epoch = 0
        self.consumed = 0
        if len(self) == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} samples, fewer than one optimizer step needs "  # type: ignore[arg-type]
                f"(batch_size {batch_size} x data-parallel size {num_replicas} x accumulate {accumulate}): "
                "use more data or a smaller batch"
            )

    def __len__(self) -> int:
        global_batch = self.batch_size * self.num_replicas
        micro_batches = len(self.dataset) // global_batch  # type: ignore[arg-type]
        return micro_batches // self.accumulate * self.accumulate

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _batch_indices(self, epoch: int, start: int) -> list[list[int]]:
        order = self._epoch_order(epoch)
        width = self.batch_size * self.num_replicas
        offset = self.rank * self.batch_size
        return [
            order[j * width + offset : j * width + offset + self.batch_size].tolist()
            for j in range(start, len(self))
        ]

    def __iter__(self) -> Iterator[Any]:
        start = self.consumed
        loader = DataLoader(
            self.dataset,
            batch_sampler=self._batch_indices(self.epoch, start),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            collate_fn=self.collate_fn,
            prefetch_factor=self.prefetch_factor,
        )
        batches = iter(loader)
        j = start
        while j < len(self):
            group = [next(batches) for _ in range(self.accumulate - j % self.accumulate)]
            if self.label_key is not None:
                tokens = sum(int((b[self.label_key] != self.ignore_index).sum()) for b in group)
                for batch in group:
                    batch["step_tokens"] = torch.tensor(tokens, dtype=torch.long)
            yield from group
            j += len(group)

    def mark_consumed(self) -> None:
        """Record that one more micro-batch reached the model; rolls over to the next epoch at the end."""
        self.consumed += 1
        if self.consumed >= len(self):
            self.epoch += 1
            self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        """Position of the next micro-batch to train on, plus what must match on resume."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "global_batch": self.batch_size * self.num_replicas,
            "accumulate": self.accumulate,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the position saved by :meth:`state_dict`."""
        for key in ("seed", "global_batch", "accumulate"):
            current = self.state_dict()[key]
            if key in state and state[key] != current:
                raise ValueError(
                    f"the checkpoint's data loader has {key}={state[key]} but this run has {key}={current}: "
                    "resume with the same data seed, global batch (batch_size x data-parallel size) and "
                    "accumulate_grad_batches, or start a new run"
                )
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])


class ShardedLoader:
    """Fixed-order evaluation loader: rank ``r`` takes samples ``r, r+W, r+2W, ...`` in micro-batches.

    Every rank gets the same number of samples and batches (collectives inside the forward, such as DDP's buffer
    broadcast, stay matched): the last ``len(dataset) % W`` samples are left out. No sample is duplicated, so
    metrics summed over ranks are exact token means.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        usable = len(dataset) // num_replicas * num_replicas  # type: ignore[arg-type]
        indices = list(range(rank, usable, num_replicas))
        self._batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
        self._loader = DataLoader(
            dataset,
            batch_sampler=self._batches,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn,
        )

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)

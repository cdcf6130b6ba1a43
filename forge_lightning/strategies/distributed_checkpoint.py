"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), shared by the native strategies.

A checkpoint is a directory: DCP's shard files and ``.metadata`` for the model (``state_dict``) and each
optimizer (``optimizer_0`` ...), plus ``meta.pt`` holding everything else Lightning saves (loop counters, the
data loader position as plain ints, scheduler and callback states), and ``forge-manifest.json`` with the size and
hash of every file (each rank hashes the shards it wrote; :mod:`forge_lightning.manifest`), checked on load. DCP reshards on load, so a checkpoint
written by N processes loads on M. The directory is written beside the target and renamed into place, so an
interrupted save leaves the previous checkpoint intact.

Callback states may hold DTensors (e.g. the EMA callback's sharded average). Those go through DCP too, one
entry per tensor under ``callbacks/<state key>/<path in the state>``; ``meta.pt`` keeps that key in their place::

    checkpoint["callbacks"]["EMA"]["average"]["w"]  (DTensor)
      -> DCP entry "callbacks/EMA/average/w";  meta.pt: "dcp:callbacks/EMA/average/w"

On load each such entry is read into a template: an empty tensor like the one the live callback's
``state_dict()`` holds at the same path (the strategies restore after setup, so by then a callback that keeps
sharded state has built it, placed like the parameters). DCP reshards into it, and the callback's
``load_state_dict`` receives DTensors of this run's layout.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor

from forge_lightning.atomic_io import replace
from forge_lightning.manifest import verify_before_load_collective, write_directory_manifest_collective
from forge_lightning.strategies.checkpoint_io import atomic_torch_save

# Files each rank writes in parallel. On one H200 machine (benchmarks/results/run_endings.json), the 1B FSDP2 recipe's
# last checkpoint (15.9 GB, fsync'd) was written at 0.49 GB/s by one writer and 0.71-0.87 GB/s by eight.
CHECKPOINT_WRITERS = 8
METADATA_FILE = "meta.pt"  # the name Lightning's ModelParallelStrategy uses, so either can read the other's
_IN_DCP = "dcp:"  # meta.pt's stand-in for a callback tensor saved through DCP: this prefix + its DCP key


def save_distributed_checkpoint(
    checkpoint: dict[str, Any],
    path: Path,
    barrier: Callable[[], None],
    *,
    is_global_zero: bool,
    writers: int = CHECKPOINT_WRITERS,
) -> None:
    """Write Lightning's ``checkpoint`` dict as a sharded DCP directory at ``path``. Collective.

    Args:
        checkpoint: Lightning's checkpoint; ``state_dict`` and ``optimizer_states`` hold sharded state dicts;
            DTensors in ``callbacks`` are saved through DCP as well.
        path: the checkpoint directory (replaced if it exists).
        barrier: the strategy's barrier.
        is_global_zero: whether this is global rank 0 (which writes ``meta.pt`` and renames).
        writers: files this rank writes in parallel (DCP's writer threads); every file is fsync'd.
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    tmp = _fresh_temporary(path, barrier, is_global_zero=is_global_zero)
    state, meta = _split(checkpoint)
    save(state, storage_writer=FileSystemWriter(tmp, thread_count=writers, sync_files=True))
    _complete(tmp, path, meta, barrier, is_global_zero=is_global_zero, writers=writers)


def _fresh_temporary(path: Path, barrier: Callable[[], None], *, is_global_zero: bool) -> Path:
    """The empty temporary directory beside ``path`` that a save writes into (a killed save's is removed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    if is_global_zero and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    return tmp


def _split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what DCP writes: model, optimizers, callback DTensors; what ``meta.pt`` holds: everything else)."""
    meta = dict(checkpoint)
    state = {"state_dict": meta.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(meta.pop("optimizer_states", []))})
    if "callbacks" in meta:
        meta["callbacks"] = _take_dtensors(meta["callbacks"], "callbacks", state)
    return state, meta


def _complete(
    tmp: Path,
    path: Path,
    meta: dict[str, Any],
    barrier: Callable[[], None],
    *,
    is_global_zero: bool,
    writers: int,
) -> None:
    """Once every rank's shards are in ``tmp``: ``meta.pt``, the manifest, then the rename into place. Collective.

    The manifest's collectives order the steps: rank 0 hashes ``meta.pt`` after writing it, and every rank leaves
    only once rank 0 has written the manifest."""
    if is_global_zero:
        atomic_torch_save(meta, tmp / METADATA_FILE)
    write_directory_manifest_collective(tmp, threads=writers)
    if is_global_zero:
        replace(tmp, path)
    barrier()


@dataclass
class _SaveInFlight:
    future: Future
    tmp: Path
    path: Path
    meta: dict[str, Any]


class AsyncDistributedCheckpoint:
    """DCP saves that overlap training, as atomic and verified as :func:`save_distributed_checkpoint`'s.

    A save copies this rank's shards to host memory (pinned on a GPU, reused from save to save) during the step
    that saves, then DCP's writer threads write them while training goes on, over a gloo process group of their
    own (so their collectives never interleave with the training's). The checkpoint is completed (``meta.pt``,
    manifest, rename into place) by :meth:`wait`: at the next save, before a load, and when the strategy tears
    down. Until then it is a hidden ``.<name>.tmp`` directory, and checkpoints ``ModelCheckpoint`` removes meanwhile
    are removed after it is complete, so a run never has fewer complete checkpoints than it keeps.

    Args:
        writers: files each rank writes in parallel.
    """

    def __init__(self, writers: int = CHECKPOINT_WRITERS) -> None:
        self.writers = writers
        self._group: Any = None
        self._stager: Any = None
        self._in_flight: _SaveInFlight | None = None
        self._removals: list[Callable[[], None]] = []

    @property
    def in_flight(self) -> bool:
        """Whether a save is being written."""
        return self._in_flight is not None

    def save(
        self, checkpoint: dict[str, Any], path: Path, barrier: Callable[[], None], *, is_global_zero: bool
    ) -> None:
        """Start writing ``checkpoint`` to ``path`` (after completing the save in flight). Collective."""
        from torch.distributed.checkpoint import FileSystemWriter, async_save

        self.wait(barrier, is_global_zero=is_global_zero)
        tmp = _fresh_temporary(path, barrier, is_global_zero=is_global_zero)
        state, meta = _split(checkpoint)
        meta = copy.deepcopy(meta)  # written when the save completes, after training went on
        future = async_save(
            state,
            storage_writer=FileSystemWriter(tmp, thread_count=self.writers, sync_files=True),
            process_group=self._process_group(),
            async_stager=self._host_stager(),
        )
        self._in_flight = _SaveInFlight(future, tmp, path, meta)

    def remove_after_save(self, remove: Callable[[], None]) -> None:
        """Run ``remove`` (a checkpoint's removal) once the save in flight is complete, or now if none is."""
        if self._in_flight is None:
            remove()
        else:
            self._removals.append(remove)

    def wait(self, barrier: Callable[[], None], *, is_global_zero: bool) -> None:
        """Finish the save in flight, if any: wait for every rank's writes, then complete it. Collective.

        Raises:
            RuntimeError: a rank's writes failed (every rank raises, naming the ranks); the previous checkpoints
                are untouched and the temporary directory is removed at the next start.
        """
        if self._in_flight is None:
            return
        flight, self._in_flight = self._in_flight, None
        error = None
        try:
            flight.future.result()
        except Exception as err:  # reported on every rank below, so no rank waits for the others forever
            error = f"{type(err).__name__}: {err}"
        failed = _ranks_failed(error)
        if failed:
            raise RuntimeError(
                f"asynchronous checkpoint {flight.path} failed on rank(s) {[rank for rank, _ in failed]}: "
                f"{failed[0][1]}. It was not completed; the previous checkpoints are intact"
            )
        _complete(
            flight.tmp, flight.path, flight.meta, barrier, is_global_zero=is_global_zero, writers=self.writers
        )
        removals, self._removals = self._removals, []
        for remove in removals:
            remove()

    def abandon(self) -> None:
        """After an error: wait for this rank's writes (no collective), and leave the save incomplete."""
        if self._in_flight is not None:
            flight, self._in_flight = self._in_flight, None
            with contextlib.suppress(
                Exception
            ):  # the run is failing already; the next start removes the temporary
                flight.future.result()
        self._removals.clear()

    def close(self) -> None:
        """Release the pinned staging buffers and the writers' process group (after :meth:`wait`)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
            self._group = None

    def _process_group(self) -> Any:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: the first save runs on every rank
        return self._group

    def _host_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager


def _ranks_failed(error: str | None) -> list[tuple[int, str]]:
    """Every rank's error (``None``: it succeeded), gathered: the ranks that failed, with their errors."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [(0, error)] if error else []
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return [(rank, e) for rank, e in enumerate(errors) if e is not None]


def _take_dtensors(tree: Any, key: str, out: dict[str, Any]) -> Any:
    """``tree`` with each DTensor moved into ``out`` under its DCP key (``key/<path>``) and replaced by its stand-in."""
    if isinstance(tree, DTensor):
        out[key] = tree
        return _IN_DCP + key
    if isinstance(tree, dict):
        return {k: _take_dtensors(v, f"{key}/{k}", out) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        items = [_take_dtensors(v, f"{key}/{i}", out) for i, v in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint directory written by :func:`save_distributed_checkpoint`."""
    path = Path(path)
    return path.is_dir() and (path / METADATA_FILE).is_file() and (path / ".metadata").is_file()


def load_distributed_checkpoint(
    path: Path,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Load model and optimizer shards in place (resharding to this run's layout); return the rest.

    Args:
        path: a directory written by :func:`save_distributed_checkpoint`.
        model: the parallelised module (its parameters may be DTensors).
        optimizers: the optimizers, in the order they were saved.
        callbacks: the run's callbacks; the DTensors of their saved states are read into tensors shaped and
            placed like those their ``state_dict()`` holds now.

    Returns:
        The checkpoint's other entries (loops, data loader position, schedulers, callbacks...), callback
        DTensors included.
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not is_distributed_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a sharded checkpoint directory (expected DCP's .metadata and {METADATA_FILE}); "
            "strategies with sharded checkpoints save and resume from directories"
        )
    verify_before_load_collective(path)
    state = {"state_dict": get_model_state_dict(model)}
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"])
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: get_optimizer_state_dict(model, optimizer)}
        load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key])
    meta = torch.load(path / METADATA_FILE, map_location="cpu", weights_only=True)
    _load_callback_dtensors(meta, path, callbacks)
    return meta


_DROPPED = object()


def _load_callback_dtensors(meta: dict[str, Any], path: Path, callbacks: Sequence[Callback]) -> None:
    """Put the callback tensors saved through DCP back in place of their stand-ins in ``meta["callbacks"]``."""
    from torch.distributed.checkpoint import load

    states = meta.get("callbacks") or {}
    wanted: dict[str, torch.Tensor] = {}
    unmatched: list[str] = []
    for callback in callbacks:
        key = callback.state_key
        if key in states:
            live = callback.state_dict()
            states[key] = _templates(states[key], live, f"callbacks/{key}", wanted, unmatched)
    if unmatched:
        rank_zero_warn(
            f"{len(unmatched)} sharded callback tensors in {path} were not loaded (e.g. {unmatched[:3]}): their "
            "callbacks hold no tensor at that place to load them into. Callbacks with sharded state (EMA) build "
            "it when fit starts, so only `fit(ckpt_path=...)` restores it"
        )
    if wanted:
        load(wanted, checkpoint_id=path)  # in place, into the templates the states now hold


def _templates(saved: Any, live: Any, key: str, wanted: dict[str, torch.Tensor], unmatched: list[str]) -> Any:
    """``saved`` with each stand-in replaced by an empty tensor like ``live``'s at the same place (recorded in
    ``wanted`` for DCP to fill); stand-ins with no tensor there are dropped (recorded in ``unmatched``)."""
    if isinstance(saved, str) and saved == _IN_DCP + key:
        if isinstance(live, torch.Tensor):
            wanted[key] = torch.empty_like(live)  # a DTensor stays a DTensor on the same mesh and placements
            return wanted[key]
        unmatched.append(key)
        return _DROPPED
    if isinstance(saved, dict):
        live = live if isinstance(live, dict) else {}
        items = {k: _templates(v, live.get(k), f"{key}/{k}", wanted, unmatched) for k, v in saved.items()}
        return {k: v for k, v in items.items() if v is not _DROPPED}
    if isinstance(saved, list | tuple):
        live = live if isinstance(live, list | tuple) else ()
        items = [
            _templates(v, live[i] if i < len(live) else None, f"{key}/{i}", wanted, unmatched)
            for i, v in enumerate(saved)
        ]
        items = [None if v is _DROPPED else v for v in items]
        return items if isinstance(saved, list) else tuple(items)
    return saved


def full_model_state_dict(root: nn.Module, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The full state dict of ``module`` (a submodule of ``root``; default ``root``) on CPU, on global rank 0.

    Sharded parameters are gathered one at a time and moved to host memory (``full_state_dict`` with
    ``cpu_offload``), so no accelerator ever holds the whole model; other ranks receive an empty dict.
    Collective: call it on every rank.

    Args:
        root: the module the strategy parallelised.
        module: the submodule to export; keys are relative to it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    prefix = ""
    if module is not None and module is not root:
        names = [name for name, sub in root.named_modules() if sub is module]
        if not names:
            raise ValueError(f"{type(module).__name__} is not a submodule of {type(root).__name__}")
        prefix = names[0] + "."
    full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix(prefix): v for k, v in full.items() if k.startswith(prefix)}

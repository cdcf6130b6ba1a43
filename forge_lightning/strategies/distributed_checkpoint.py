"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), shared by the native strategies.

A checkpoint is a directory: DCP's shard files and ``.metadata`` for the model (``state_dict``) and each
optimizer (``optimizer_0`` ...), plus ``meta.pt`` holding everything else Lightning saves (loop counters, the
data loader position as plain ints, scheduler and callback states). DCP reshards on load, so a checkpoint
written by N processes loads on M. The directory is written beside the target and renamed into place, so an
interrupted save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forge_lightning.strategies.checkpoint_io import atomic_torch_save

METADATA_FILE = "meta.pt"  # the name Lightning's ModelParallelStrategy uses, so either can read the other's


def save_distributed_checkpoint(
    checkpoint: dict[str, Any], path: Path, barrier: Callable[[], None], *, is_global_zero: bool
) -> None:
    """Write Lightning's ``checkpoint`` dict as a sharded DCP directory at ``path``. Collective.

    Args:
        checkpoint: Lightning's checkpoint; ``state_dict`` and ``optimizer_states`` hold sharded state dicts.
        path: the checkpoint directory (replaced if it exists).
        barrier: the strategy's barrier.
        is_global_zero: whether this is global rank 0 (which writes ``meta.pt`` and renames).
    """
    from torch.distributed.checkpoint import save

    tmp = path.with_name(f".{path.name}.tmp")
    if is_global_zero and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    checkpoint = dict(checkpoint)
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    save(state, checkpoint_id=tmp)
    if is_global_zero:
        atomic_torch_save(checkpoint, tmp / METADATA_FILE)
    barrier()
    if is_global_zero:
        _replace(tmp, path)
    barrier()


def _replace(tmp: Path, path: Path) -> None:
    if path.is_dir():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
        return
    if path.exists():
        path.unlink()
    os.replace(tmp, path)


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint directory written by :func:`save_distributed_checkpoint`."""
    path = Path(path)
    return path.is_dir() and (path / METADATA_FILE).is_file() and (path / ".metadata").is_file()


def load_distributed_checkpoint(
    path: Path, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
) -> dict[str, Any]:
    """Load model and optimizer shards in place (resharding to this run's layout); return the rest.

    Args:
        path: a directory written by :func:`save_distributed_checkpoint`.
        model: the parallelised module (its parameters may be DTensors).
        optimizers: the optimizers, in the order they were saved.

    Returns:
        The checkpoint's other entries (loops, data loader position, schedulers, callbacks...).
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
    state = {"state_dict": get_model_state_dict(model)}
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"])
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: get_optimizer_state_dict(model, optimizer)}
        load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key])
    return torch.load(path / METADATA_FILE, map_location="cpu", weights_only=True)


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

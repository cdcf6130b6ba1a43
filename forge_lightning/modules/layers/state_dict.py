"""Strict copies of checkpoint tensors into a module, with every mismatch named, into materialised modules and into
modules built on the meta device alike.

A module built under ``torch.device("meta")`` holds no memory; :func:`assign_weights` makes the checkpoint's tensors
its parameters (cast to each parameter's dtype: no copy when the dtypes agree, so the host holds about one copy of
the weights) and then computes what the checkpoint does not hold: the non-persistent buffers (rotary frequencies),
by the ``reset_parameters`` of the parameter-free module that owns them. Tied parameters stay tied.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn


def load_exact(
    module: nn.Module,
    weights: Mapping[str, Tensor],
    *,
    what: str,
    owner: str = "encoder",
) -> None:
    """Copy ``weights`` (named as in ``module.state_dict()``) into ``module``.

    Args:
        module: the component to fill.
        weights: its tensors.
        what: what the tensors are, for the error message.
        owner: what ``module`` is, for the error message.

    Raises:
        ValueError: entries are missing, unexpected or of another shape (the message names up to 8 of each).
    """
    own = module.state_dict()
    missing, unexpected = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
    reshaped = [
        f"{k} {list(weights[k].shape)} ({owner}: {list(own[k].shape)})"
        for k in sorted(own.keys() & weights.keys())
        if weights[k].shape != own[k].shape
    ]
    if missing or unexpected or reshaped:
        problems = {"missing": missing, "unexpected": unexpected, "of another shape": reshaped}
        detail = "; ".join(f"{kind}: {', '.join(keys[:8])}" for kind, keys in problems.items() if keys)
        raise ValueError(f"{what} do not fit the {owner}'s config ({detail})")
    assign_weights(module, weights)


def assign_weights(module: nn.Module, weights: Mapping[str, Tensor]) -> None:
    """Fill ``module`` with ``weights`` (its whole state dict, names and shapes checked by the caller), strictly.

    A materialised module copies them into its tensors. A module with tensors on the meta device takes them as its
    parameters and persistent buffers (cast to the dtype each was built with), keeps its tied parameters tied, and
    rebuilds its non-persistent buffers by the ``reset_parameters`` of the parameter-free modules that own them
    (:class:`~forge_lightning.modules.layers.rope.RotaryEmbedding`), on the device of the weights.

    Raises:
        ValueError: a meta buffer that no parameter-free module with ``reset_parameters`` owns, or tensors still on
            the meta device afterwards (named); ``RuntimeError`` from ``load_state_dict`` for missing or unexpected
            keys.
    """
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        module.load_state_dict(weights)
        return
    own = module.state_dict(keep_vars=True)
    aliases = _tied_parameters(module)
    # Checked before anything is assigned, so a refusal leaves the module as it was.
    derived = _derived_buffers(module)
    unbuilt = [f"{name}: {type(owner).__name__}" for name, owner, rebuilds in derived if not rebuilds]
    if unbuilt:
        raise ValueError(
            "these buffers are not in the checkpoint and their module cannot rebuild them (it holds parameters or "
            f"has no reset_parameters): {', '.join(unbuilt[:8])}"
        )
    cast = {k: v.to(own[k].dtype) if k in own and v.dtype != own[k].dtype else v for k, v in weights.items()}
    module.load_state_dict(cast, strict=True, assign=True)
    for first, *others in aliases:
        for name in others:
            _set(module, name, module.get_parameter(first))
    device = next(iter(weights.values())).device if weights else torch.device("cpu")
    owners = {id(owner): owner for _, owner, _ in derived}  # each once: it rebuilds all of its buffers
    for owner in owners.values():
        owner.to_empty(device=device, recurse=False)
        owner.reset_parameters()
    left = [n for n, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"tensors left on the meta device after loading: {', '.join(left[:8])}")


def _tied_parameters(module: nn.Module) -> list[list[str]]:
    """The names of each parameter that appears under several names (tied weights), first name first."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _derived_buffers(module: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """``(name, owner, rebuildable)`` of each meta buffer outside the state dict: its owner can rebuild it if it has
    a ``reset_parameters`` and no parameters of its own (which that would redraw)."""
    saved = module.state_dict(keep_vars=True).keys()
    out = []
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer.is_meta and _join(prefix, name) not in saved:
                resets = callable(getattr(sub, "reset_parameters", None))
                out.append((_join(prefix, name), sub, resets and not any(sub.parameters(recurse=False))))
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _set(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner_name), attr, param)


def write_safetensors_shards(
    tensors: Mapping[str, Tensor], out: Path, max_bytes: int, weights_file: str
) -> None:
    """``tensors`` in ``out`` as Hugging Face writes them: one ``weights_file`` when they fit in ``max_bytes``,
    else shards ``<stem>-00001-of-0000N.safetensors`` of at most ``max_bytes`` each (a larger tensor alone) and
    ``<weights_file>.index.json`` naming each tensor's shard."""
    shards: list[dict[str, Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], out / weights_file, metadata={"format": "pt"})
        return
    stem = weights_file.removesuffix(".safetensors")
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / f"{weights_file}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

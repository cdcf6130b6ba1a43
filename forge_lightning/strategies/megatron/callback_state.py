"""Callbacks' per-parameter state (the ``EMA`` callback's average) in ``MegatronStrategy``'s dist-checkpoints.

Under MegatronStrategy a rank holds shards of the twin's parameters (its TP / PP / EP part); a callback that keeps
one tensor per trained parameter (:meth:`MegatronStrategy.trained_parameters`) holds shards too, which ``meta.pt``
(written by global rank 0 alone) cannot store. So on save each such mapping in a callback's ``state_dict()``
becomes sharded tensors laid out like the parameters they belong to (megatron-core's optimizer-state helper),
stored in the dist-checkpoint under ``callbacks.<state key>.<path>``, and ``meta.pt`` keeps a stand-in string;
on load the live callbacks' current state is the template (this run's names and shards, whatever layout wrote the
checkpoint) and the stand-ins are replaced by what was loaded::

    callback state {"average": {"model0.decoder...weight": tensor, ...}}   ─ save ─▶  dist-checkpoint tensors
                                                                                   meta.pt: "megatron-sharded:..."
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from forge_lightning.strategies.megatron.checkpoint import (
    CALLBACKS_KEY,
    COMPONENTS_KEY,
    inner_chunk,
    sharded_state_dict,
)

_SHARDED_STAND_IN = "megatron-sharded:"  # meta.pt's stand-in for per-parameter callback state (+ its prefix)


def trained_parameters(
    chunks: Sequence[nn.Module], components: Mapping[str, nn.Module] | None = None
) -> list[tuple[str, nn.Parameter]]:
    """This rank's trainable parameters, named by their place in :func:`sharded_state_dict`: ``model<i>.<name>`` in
    chunk ``i`` (this rank's TP / PP / EP shards), ``components.<component>.<name>`` on a composed model's encoder
    side."""
    named = [
        (f"model{i}.{name}", param)
        for i, chunk in enumerate(chunks)
        for name, param in inner_chunk(chunk).named_parameters()
        if param.requires_grad
    ]
    for component, module in (components or {}).items():
        named += [
            (f"{COMPONENTS_KEY}.{component}.{name}", param)
            for name, param in module.named_parameters()
            if param.requires_grad
        ]
    return named


def parameter_shards(
    chunks: Sequence[nn.Module], components: Mapping[str, nn.Module] | None = None
) -> dict[str, Any]:
    """Each trained parameter's entry of :func:`sharded_state_dict` (a ``ShardedTensor`` or a factory: its global
    key, global shape and this rank's slice), by its :func:`trained_parameters` name."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    named = trained_parameters(chunks, components)
    state = sharded_state_dict(chunks, None, is_loading=False, components=components)
    by_index = get_param_id_to_sharded_param_map(state, [param for _, param in named])
    missing = [name for i, (name, _) in enumerate(named) if i not in by_index]
    if missing:
        raise RuntimeError(f"no sharded state dict entry for the trained parameters {missing[:4]}")
    return {name: by_index[i] for i, (name, _) in enumerate(named)}


def _local_shape(entry: Any) -> tuple[int, ...]:
    """The shape of this rank's tensor behind a sharded state dict entry."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return tuple(entry.data.shape) if isinstance(entry, ShardedTensorFactory) else tuple(entry.local_shape)


def _per_parameter(value: Any, shards: Mapping[str, Any]) -> bool:
    """Whether ``value`` is per-parameter state: a non-empty mapping from trained-parameter names to tensors of
    those parameters' local shapes."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(
            name in shards and torch.is_tensor(t) and tuple(t.shape) == _local_shape(shards[name])
            for name, t in value.items()
        )
    )


def _like_parameters(state: Mapping[str, Any], shards: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Sharded tensors of per-parameter ``state``, each sharded like its parameter, under ``prefix.<its key>``."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    return {name: make_sharded_optimizer_tensor(shards[name], t, prefix) for name, t in state.items()}


def take_callback_state(
    states: Mapping[str, Any], shards: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's callback states split into what ``meta.pt`` keeps and the sharded tensors of their per-parameter
    state (see the module docstring).

    Args:
        states: ``checkpoint["callbacks"]``: each callback's ``state_dict()`` by its state key.
        shards: :func:`parameter_shards`.

    Returns:
        ``(states with stand-ins, {prefix: {name: sharded tensor}})``.
    """
    out: dict[str, Any] = {}

    def take(tree: Any, prefix: str) -> Any:
        if _per_parameter(tree, shards):
            out[prefix] = _like_parameters(tree, shards, prefix)
            return _SHARDED_STAND_IN + prefix
        if isinstance(tree, Mapping):
            return {k: take(v, f"{prefix}.{k}") for k, v in tree.items()}
        return tree

    kept = {key: take(state, f"{CALLBACKS_KEY}.{key}") for key, state in states.items()}
    return kept, out


def callback_templates(
    saved: Mapping[str, Any], live: Mapping[str, Any], shards: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """What to load of the per-parameter callback state a checkpoint holds: for each stand-in in ``saved``, empty
    tensors like those the live callback's state holds at the same place (this run's names, sharded like this
    run's parameters).

    Args:
        saved: the checkpoint's ``callbacks`` (from ``meta.pt``).
        live: each callback's ``state_dict()`` now, by its state key.
        shards: :func:`parameter_shards`.

    Returns:
        ``({prefix: {name: sharded tensor}}, the prefixes with no such state in the live callbacks)``.
    """
    wanted: dict[str, Any] = {}
    unmatched: list[str] = []

    def visit(tree: Any, now: Any, prefix: str) -> None:
        if isinstance(tree, str) and tree == _SHARDED_STAND_IN + prefix:
            if _per_parameter(now, shards):
                wanted[prefix] = _like_parameters(
                    {name: torch.empty_like(t) for name, t in now.items()}, shards, prefix
                )
            else:
                unmatched.append(prefix)
        elif isinstance(tree, Mapping):
            now = now if isinstance(now, Mapping) else {}
            for k, v in tree.items():
                visit(v, now.get(k), f"{prefix}.{k}")

    for key, state in saved.items():
        visit(state, live.get(key), f"{CALLBACKS_KEY}.{key}")
    return wanted, unmatched


def put_callback_state(states: dict[str, Any], loaded: Mapping[str, Any]) -> None:
    """Replace the stand-ins in the checkpoint's callback ``states`` by the loaded per-parameter state (an empty
    mapping where nothing was loaded), in place."""

    def put(tree: Any, prefix: str) -> Any:
        if isinstance(tree, str) and tree == _SHARDED_STAND_IN + prefix:
            return dict(loaded.get(prefix, {}))
        if isinstance(tree, dict):
            return {k: put(v, f"{prefix}.{k}") for k, v in tree.items()}
        return tree

    for key in list(states):
        states[key] = put(states[key], f"{CALLBACKS_KEY}.{key}")

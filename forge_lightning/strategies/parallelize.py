"""Shared helpers that turn a module's :class:`~forge_lightning.contracts.ParallelPlan` into parallelism, in
the one fixed order every native strategy uses::

    tensor parallelism ─ FP8 ─ kernels ─ activation checkpointing ─ torch.compile ─ FSDP / DDP
    apply_tensor_parallel  forge_lightning.performance.apply_performance          (the strategy's wrapping)

The tensor-parallel degree is checked against the plan first, before the weights are built
(:func:`check_tensor_parallel_plan`).

Each helper reads only the plan (components, their blocks, the TP styles, the frozen flags), never a model
family, logs one line and renames no parameter, so state-dict keys stay those of the plain model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forge_lightning.contracts import Component, ParallelPlan

ROOT_PREFIX = "<root>."
TP_STYLES = ("colwise", "rowwise", "sequence", "rowwise_embedding", "colwise_output")


def _tp_style(style: str, sequence_parallel: bool) -> object | None:
    """The DTensor ``ParallelStyle`` of a plan style name (``None``: leave the module replicated)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    # With sequence parallelism the residual stream between blocks is sharded on the sequence (dim 1): norms
    # run on their slice, the first column-parallel matmul of a block all-gathers it and the last row-parallel
    # one reduce-scatters back (Korthikanti et al., 2022, "Reducing Activation Recomputation").
    stream = Shard(1) if sequence_parallel else Replicate()
    if style == "colwise":
        return ColwiseParallel(input_layouts=stream)
    if style == "rowwise":
        return RowwiseParallel(output_layouts=stream)
    if style == "sequence":
        return SequenceParallel(use_local_output=True) if sequence_parallel else None
    if style == "rowwise_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if style == "colwise_output":
        return ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    raise ValueError(f"unknown tensor-parallel style {style!r}; known styles: {TP_STYLES}")


def _split_tp_plan(tp_plan: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(per-block entries, root entries with the ``<root>.`` prefix removed)."""
    block = {k: v for k, v in tp_plan.items() if not k.startswith(ROOT_PREFIX)}
    root = {k.removeprefix(ROOT_PREFIX): v for k, v in tp_plan.items() if k.startswith(ROOT_PREFIX)}
    return block, root


def _styles(entries: dict[str, str], sequence_parallel: bool) -> dict[str, object]:
    styles = {name: _tp_style(style, sequence_parallel) for name, style in entries.items()}
    return {name: style for name, style in styles.items() if style is not None}


def check_tensor_parallel_plan(
    plan: ParallelPlan,
    size: int,
    *,
    skip: Iterable[str] = (),
) -> None:
    """Raise ``ValueError`` unless ``tensor_parallel_size`` ``size`` fits the plan: it splits at least one
    component and divides every size those components advertise (``tp_dims``).

    Args:
        plan: the module's parallel plan.
        size: ``tensor_parallel_size``.
        skip: components kept out of tensor parallelism (unsharded or replicated ones).
    """
    if size == 1:
        return
    skipped = set(skip)
    split = [c.name for c in plan if c.name not in skipped and c.tp_plan]
    if not split:
        candidates = [c.name for c in plan if c.name not in skipped]
        why = (
            f"none of the components it would split ({', '.join(candidates)}) declares tensor-parallel styles in "
            "the module's parallel plan"
            if candidates
            else f"every component is kept out of it (unsharded or replicated: {', '.join(sorted(skipped))})"
        )
        raise ValueError(
            f"tensor_parallel_size ({size}) splits no component of the model: {why}, so every tensor-parallel "
            "rank would compute the same; set tensor_parallel_size: 1 and use the ranks for data parallelism"
        )
    plan.check_tensor_parallel(size, option="tensor_parallel_size", components=split)


def apply_tensor_parallel(
    plan: ParallelPlan, tp_mesh: DeviceMesh, *, sequence_parallel: bool, skip: Iterable[str] = ()
) -> None:
    """Shard each component's blocks (and, with sequence parallelism, its root modules) over ``tp_mesh``.

    Without sequence parallelism the residual stream stays replicated: only the block entries are applied
    (column-parallel in, row-parallel out with an all-reduce) and the modules around the blocks (embedding,
    final norm, output head) stay whole, so a loss that reads the head's weight directly keeps working.

    Args:
        plan: the module's parallel plan.
        tp_mesh: the 1-D tensor-parallel mesh.
        sequence_parallel: shard norms and the residual stream on the sequence dimension.
        skip: component names left unsharded.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    for comp in plan:
        if comp.name in set(skip) or not comp.tp_plan:
            continue
        block_entries, root_entries = _split_tp_plan(comp.tp_plan)
        block_styles = _styles(block_entries, sequence_parallel)
        for block in comp.blocks:
            parallelize_module(block, tp_mesh, block_styles)
        applied_root = 0
        if sequence_parallel and root_entries:
            tied = _shared_parameters(comp.module)
            parallelize_module(comp.module, tp_mesh, _styles(root_entries, sequence_parallel))
            _retie(comp.module, tied)
            applied_root = len(root_entries)
        rank_zero_info(
            f"tensor parallel: {comp.name}: {len(comp.blocks)} blocks x {len(block_styles)} styles, {applied_root} "
            f"root modules over TP={tp_mesh.size()} (sequence parallel {'on' if sequence_parallel else 'off'})"
        )


def _shared_parameters(module: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, attribute) that hold one shared parameter (tied weights)."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, param in mod.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((mod_name, attr))
    return [group for group in owners.values() if len(group) > 1]


def _retie(module: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Point every owner of a tied parameter at the first owner's (distributed) parameter again.

    ``parallelize_module`` replaces each module's parameters separately, which would split a tied embedding /
    output head into two parameters whose updates diverge.
    """
    for group in groups:
        first = getattr(module.get_submodule(group[0][0]), group[0][1])
        for mod_name, attr in group[1:]:
            other = getattr(module.get_submodule(mod_name), attr)
            if other is first:
                continue
            if getattr(other, "placements", None) != getattr(first, "placements", None):
                raise ValueError(
                    f"tied parameter {group[0][0]}.{group[0][1]} and {mod_name}.{attr} got different tensor-"
                    "parallel placements: give both modules styles that shard the weight the same way"
                )
            setattr(module.get_submodule(mod_name), attr, first)


def trainable_components(plan: ParallelPlan) -> list[Component]:
    """Components whose parameters the optimizer updates."""
    return [c for c in plan if not c.frozen]


def check_components(plan: ParallelPlan, names: Iterable[str]) -> list[str]:
    """``names`` if each is a component of ``plan``; a clear error otherwise."""
    known = {c.name for c in plan}
    for name in names:
        if name not in known:
            raise ValueError(f"component {name!r} is not in the module's plan, which has {sorted(known)}")
    return list(names)


def check_unsharded(plan: ParallelPlan, unsharded: Iterable[str]) -> list[Component]:
    """The components named in ``unsharded``; each must exist in the plan and be frozen.

    A trainable component left out of FSDP would get no gradient synchronisation, so it is refused.
    """
    names = {c.name for c in plan}
    chosen = []
    for name in unsharded:
        if name not in names:
            raise ValueError(f"unsharded_components names {name!r}, but the plan has only {sorted(names)}")
        comp = plan.component(name)
        if not comp.frozen:
            raise ValueError(
                f"component {name!r} is trainable: only frozen components can be left unsharded (a trainable one "
                "would get no gradient synchronisation); shard it or freeze it"
            )
        chosen.append(comp)
    return chosen


def parameters_of(components: Iterable[Component]) -> set[torch.nn.Parameter]:
    """All parameters of ``components``."""
    return {p for comp in components for p in comp.module.parameters()}

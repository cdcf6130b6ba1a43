"""Which parameters Muon takes, and the parameter groups of a Muon optimizer.

Muon takes the trainable 2-D weight matrices that are not ``nn.Embedding`` tables and do not match
``optimizer.muon.adamw_params``, and the 3-D matrix stacks a module declares (MoE experts ``[E, m, n]``, each
matrix orthogonalised on its own). ``optimizer.muon.muon_params`` forces parameters onto Muon. Everything else
(embeddings, output heads, norms, biases, convolutions) goes to AdamW groups with the usual decay rule.

A module declares its stacks and fused matrices with :class:`MatrixParts`; a fused matrix (``gate_up_proj``) is
orthogonalised part by part when ``optimizer.muon.split_fused``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from forge_lightning.optim.muon_options import MuonOptions


@runtime_checkable
class MatrixParts(Protocol):
    """A module whose parameters are stacks of matrices or matrices fused from parts."""

    def matrix_parts(self) -> dict[str, tuple[int, ...]]:
        """Row-block sizes (along dim -2) of the parts of each listed parameter, by its name in this module.

        A listed 3-D parameter is a stack of matrices ``[E, m, n]`` (one size ``(m,)`` when not fused); a listed
        2-D parameter with several sizes is fused from those row blocks.
        """
        ...


@dataclass(frozen=True)
class ParamChoice:
    """Where one trainable parameter goes.

    Args:
        name: its name (``<component>.<name>`` under per-component groups).
        param: the parameter.
        use_muon: updated by Muon, else by AdamW.
        kind: ``matrix``, ``stack`` (Muon); ``embedding`` (an ``nn.Embedding`` table), ``1-D``, ``N-D`` (not a
            declared stack) or ``by name`` (a matrix that ``adamw_params`` sends to AdamW).
        parts: row-block sizes of a fused matrix to orthogonalise separately (Muon, ``split_fused``), else None.
        decayed: AdamW applies weight decay to it (Muon parameters always decay with Muon's rate).
    """

    name: str
    param: Tensor
    use_muon: bool
    kind: str
    parts: tuple[int, ...] | None
    decayed: bool


def _matching(name: str, patterns: Iterable[str]) -> str | None:
    return next((p for p in patterns if fnmatchcase(name, p)), None)


def _declared_parts(model: nn.Module) -> dict[int, tuple[int, ...]]:
    parts: dict[int, tuple[int, ...]] = {}
    for module in model.modules():
        if isinstance(module, MatrixParts):
            for name, sizes in module.matrix_parts().items():
                try:
                    param = module.get_parameter(name)
                except AttributeError:  # a transform replaced it (LoRA's frozen base_layer): nothing to split
                    continue
                parts[id(param)] = tuple(sizes)
    return parts


def _check_forced(name: str, param: Tensor, pattern: str, stack: bool) -> None:
    shape = list(param.shape)
    if param.ndim < 2:
        raise ValueError(
            f"optimizer.muon.muon_params pattern {pattern!r} matches {name} of shape {shape}: Muon updates "
            "matrices only; narrow the pattern so that it leaves out vectors (norms, biases)"
        )
    if param.ndim > 2 and not stack:
        raise ValueError(
            f"optimizer.muon.muon_params pattern {pattern!r} matches {name} of shape {shape}: Muon does not "
            "flatten convolutions or other N-D tensors (only declared matrix stacks such as MoE experts); "
            "narrow the pattern so that AdamW keeps it"
        )


def choose_params(
    named: Iterable[tuple[str, nn.Module]], options: MuonOptions, decay_all: bool = False
) -> list[ParamChoice]:
    """Where each trainable parameter of the ``(prefix, module)`` pairs goes (tied weights counted once).

    Args:
        named: modules with the prefix of their parameter names (``""`` for a whole model, ``"<component>."``).
        options: ``optimizer.muon``.
        decay_all: AdamW decays norms, biases and embeddings too (``decay_norms_biases_embeddings``).

    Raises:
        ValueError: a ``muon_params`` pattern matches a parameter Muon cannot take, or matches none.
    """
    choices: list[ParamChoice] = []
    seen: set[int] = set()
    unmatched = set(options.muon_params)
    for prefix, model in named:
        tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        declared = _declared_parts(model)
        for local, param in model.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            name = prefix + local
            sizes = declared.get(id(param))
            stack = param.ndim == 3 and sizes is not None
            embedding = id(param) in tables
            forced = _matching(name, options.muon_params)
            by_name = _matching(name, options.adamw_params)
            if forced is not None:
                _check_forced(name, param, forced, stack)
                unmatched -= {p for p in unmatched if fnmatchcase(name, p)}
            if forced is not None or (by_name is None and not embedding and (param.ndim == 2 or stack)):
                fused = sizes if options.split_fused and sizes is not None and len(sizes) > 1 else None
                kind = "stack" if stack else "matrix"
                choices.append(ParamChoice(name, param, True, kind, fused, True))
                continue
            kind = (
                "embedding"
                if embedding
                else "1-D"
                if param.ndim < 2
                else "N-D"
                if param.ndim > 2 and not stack
                else "by name"
            )
            decayed = decay_all or (param.ndim >= 2 and not embedding)
            choices.append(ParamChoice(name, param, False, kind, None, decayed))
    if unmatched:
        raise ValueError(
            f"optimizer.muon.muon_params patterns {sorted(unmatched)} match no trainable parameter: check the "
            "names (full parameter names, e.g. 'model.layers.*.mlp.gate.weight') or remove them"
        )
    return choices


def muon_groups(
    choices: Sequence[ParamChoice],
    *,
    lr: float,
    muon_lr: float,
    weight_decay: float,
    muon_weight_decay: float,
    prefix: str = "",
) -> list[dict[str, Any]]:
    """The Muon group and the AdamW decay / no-decay groups of ``choices`` (empty ones left out), named
    ``<prefix>muon``, ``<prefix>decay`` and ``<prefix>no_decay``.

    The Muon group's ``row_splits`` (the parts of each fused matrix, else None) are for
    :func:`~forge_lightning.optim.param_groups.optimizer_for_groups`, which removes them before building the
    optimizer (they are not hyper-parameters and stay out of its state dict).
    """
    muon = [c for c in choices if c.use_muon]
    decay = [c for c in choices if not c.use_muon and c.decayed]
    no_decay = [c for c in choices if not c.use_muon and not c.decayed]
    groups = []
    for suffix, members, use_muon, group_lr, wd in (
        ("muon", muon, True, muon_lr, muon_weight_decay),
        ("decay", decay, False, lr, weight_decay),
        ("no_decay", no_decay, False, lr, 0.0),
    ):
        if not members:
            continue
        group = {
            "params": [c.param for c in members],
            "param_names": [c.name for c in members],
            "use_muon": use_muon,
            "lr": group_lr,
            "weight_decay": wd,
            "name": prefix + suffix,
        }
        if use_muon:
            group["row_splits"] = [None if c.parts is None else list(c.parts) for c in members]
        groups.append(group)
    return groups


def _abbreviated(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit})" if len(names) > limit else "")


def _millions(count: int) -> str:
    return f"{count / 1e6:.2f}M"


def muon_summary(groups: Sequence[dict[str, Any]]) -> str:
    """A start-up report of a Muon optimizer's groups: the Muon matrices by shape, the AdamW tensors by kind.

    Example::

        Muon: 14 tensors (42 matrices), 0.12M params: [64, 64] x4, [32, 64] x4, [8, 64, 64] x2 (stack), ...
          parts orthogonalised separately: 2 fused (model.layers.0.mlp.experts.gate_up_proj, ...)
        AdamW: 7 tensors, 0.03M params: 2-D (embeddings, heads) 2 (model.embed_tokens.weight, lm_head.weight); ...
    """
    shapes: dict[tuple[int, ...], int] = {}
    muon_count = matrices = muon_numel = adamw_count = adamw_numel = 0
    fused: list[str] = []
    kinds: dict[str, list[str]] = {}
    for group in groups:
        count = len(group["params"])
        splits = group.get("row_splits") or [None] * count
        names = group.get("param_names") or [f"{group.get('name', 'group')}[{j}]" for j in range(count)]
        for name, param, split in zip(names, group["params"], splits, strict=True):
            if group["use_muon"]:
                muon_count += 1
                matrices += param.shape[0] if param.ndim == 3 else 1
                muon_numel += param.numel()
                shape = tuple(param.shape)
                shapes[shape] = shapes.get(shape, 0) + 1
                if split is not None:
                    fused.append(name)
            else:
                adamw_count += 1
                adamw_numel += param.numel()
                kinds.setdefault(_adamw_kind(param), []).append(name)
    by_shape = ", ".join(
        f"{list(s)} x{n}" + (" (stack)" if len(s) == 3 else "")
        for s, n in sorted(shapes.items(), key=lambda item: -item[1])
    )
    lines = [
        f"Muon: {muon_count} tensors ({matrices} matrices), {_millions(muon_numel)} params: {by_shape or '-'}"
    ]
    if fused:
        lines.append(f"  parts orthogonalised separately: {len(fused)} fused ({_abbreviated(fused)})")
    by_kind = "; ".join(f"{k} {len(v)} ({_abbreviated(v)})" for k, v in kinds.items())
    lines.append(f"AdamW: {adamw_count} tensors, {_millions(adamw_numel)} params: {by_kind or '-'}")
    return "\n".join(lines)


def _adamw_kind(param: Tensor) -> str:
    if param.ndim < 2:
        return "1-D (norms, biases)"
    return "2-D (embeddings, heads)" if param.ndim == 2 else "N-D (convolutions, tables)"

"""Optimizer construction: weight-decay groups, fused AdamW where the device supports it, and Muon."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from forge_lightning.accelerators.capabilities import capabilities
from forge_lightning.optim.muon import Muon, SplitRows
from forge_lightning.optim.muon_groups import choose_params, muon_groups, muon_summary
from forge_lightning.optim.muon_options import MuonOptions

_OPTIMIZERS = ("adamw", "adam", "sgd", "muon")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer settings.

    Args:
        name: ``adamw``, ``adam``, ``sgd`` or ``muon`` (Muon for hidden matrices, AdamW for the rest, in one
            optimizer: see :class:`~forge_lightning.optim.muon_options.MuonOptions`).
        lr: peak learning rate (under ``muon``: AdamW's, and Muon's unless ``muon.lr``).
        weight_decay: decoupled weight decay for matrices (under ``muon``: AdamW's, and Muon's unless
            ``muon.weight_decay``).
        betas: Adam betas.
        eps: Adam epsilon.
        decay_norms_biases_embeddings: apply weight decay to norms, biases and embeddings too (off by default,
            as in GPT-3 / Llama recipes).
        momentum: SGD momentum.
        muon: Muon's settings (used when ``name`` is ``muon``).
    """

    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    decay_norms_biases_embeddings: bool = False
    momentum: float = 0.0
    muon: MuonOptions = field(default_factory=MuonOptions)

    def __post_init__(self) -> None:
        if isinstance(self.muon, Mapping):  # from YAML or saved hyper-parameters
            self.muon = MuonOptions(**self.muon)
        if self.name not in _OPTIMIZERS:
            raise ValueError(f"optimizer.name ({self.name!r}) must be one of {_OPTIMIZERS}")
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr ({self.lr}) must be positive")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay ({self.weight_decay}) must be >= 0")
        if self.name != "muon" and self.muon != MuonOptions():
            warnings.warn(
                f"optimizer.muon is set but optimizer.name is {self.name!r}: the muon section has no effect "
                "(set optimizer.name: muon, or remove the section)",
                stacklevel=2,
            )

    @property
    def muon_lr(self) -> float:
        """Muon's peak learning rate (``muon.lr``, else ``lr``)."""
        return self.lr if self.muon.lr is None else self.muon.lr

    @property
    def muon_weight_decay(self) -> float:
        """Muon's weight decay (``muon.weight_decay``, else ``weight_decay``)."""
        return self.weight_decay if self.muon.weight_decay is None else self.muon.weight_decay


def param_groups(model: nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict[str, object]]:
    """Split trainable parameters into a decayed group (matrices) and a non-decayed one.

    Norm weights, biases and embedding tables are not decayed unless ``decay_all``. A parameter is a matrix when it
    has two or more dimensions and does not belong to an ``nn.Embedding``; tied weights are counted once.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        is_matrix = param.ndim >= 2 and id(param) not in embedding_params
        (decay if decay_all or is_matrix else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")


def build_optimizer(
    model: nn.Module, config: OptimizerConfig, *, implementation: str = "auto"
) -> torch.optim.Optimizer:
    """Build the optimizer for the trainable parameters of ``model``.

    Args:
        model: the module whose trainable parameters are optimised (parameters must already sit on their device).
        config: optimizer settings.
        implementation: ``fused`` (one kernel per step), ``foreach`` or ``for_loop`` Adam(W); ``auto``: fused
            when every trainable parameter is on CUDA, foreach otherwise (``performance.optimizer`` in YAML).
            Muon's AdamW part always steps with torch's functional (foreach) AdamW.
    """
    if config.name == "muon":
        choices = choose_params([("", model)], config.muon, config.decay_norms_biases_embeddings)
        if not choices:
            raise ValueError("the model has no trainable parameters: check which components are frozen")
        groups = muon_groups(
            choices,
            lr=config.lr,
            muon_lr=config.muon_lr,
            weight_decay=config.weight_decay,
            muon_weight_decay=config.muon_weight_decay,
        )
        return optimizer_for_groups(groups, config, implementation=implementation)
    groups = param_groups(model, config.weight_decay, config.decay_norms_biases_embeddings)
    if not groups:
        raise ValueError("the model has no trainable parameters: check which components are frozen")
    return optimizer_for_groups(groups, config, implementation=implementation)


def component_param_groups(
    components: Iterable[Any], config: OptimizerConfig, learning_rates: Mapping[str, float] | None = None
) -> list[dict[str, Any]]:
    """Parameter groups per trainable component of a parallel plan: its decayed matrices and the rest, each named
    ``<component>/decay`` or ``<component>/no_decay``, with the component's own learning rate.

    Under ``optimizer.name: muon`` each component also gets a ``<component>/muon`` group (see
    :func:`~forge_lightning.optim.muon_groups.choose_params`; parameter names are ``<component>.<name>``), whose
    learning rate is Muon's scaled by the component's ratio ``learning_rates[name] / config.lr``.

    Args:
        components: the plan's :class:`~forge_lightning.contracts.Component` s (frozen ones are left out).
        config: optimizer settings (weight decay, the default learning rate).
        learning_rates: peak learning rate by component name (others use ``config.lr``).

    Raises:
        ValueError: no component has a trainable parameter.
    """
    rates = dict(learning_rates or {})
    components = list(components)
    if config.name == "muon":
        return _muon_component_groups(components, config, rates)
    groups, names = [], []
    for comp in components:
        names.append(comp.name)
        if comp.frozen:
            continue
        lr = rates.get(comp.name, config.lr)
        # Split with a unit decay so the two groups stay distinguishable when weight_decay is 0.
        for group in param_groups(comp.module, 1.0, config.decay_norms_biases_embeddings):
            decayed = group["weight_decay"] > 0
            name = f"{comp.name}/{'decay' if decayed else 'no_decay'}"
            wd = config.weight_decay if decayed else 0.0
            groups.append({"params": group["params"], "weight_decay": wd, "lr": lr, "name": name})
    if not groups:
        raise ValueError(f"no component of {names} has a trainable parameter: nothing to train")
    return groups


def _muon_component_groups(
    components: list[Any], config: OptimizerConfig, rates: Mapping[str, float]
) -> list[dict[str, Any]]:
    trainable = [c for c in components if not c.frozen]
    # One pass over every component, so tied weights are counted once and muon_params are checked as a whole.
    choices = choose_params(
        [(f"{c.name}.", c.module) for c in trainable], config.muon, config.decay_norms_biases_embeddings
    )
    groups = []
    for comp in trainable:
        lr = rates.get(comp.name, config.lr)
        mine = [c for c in choices if c.name.startswith(f"{comp.name}.")]
        groups += muon_groups(
            mine,
            lr=lr,
            muon_lr=config.muon_lr * lr / config.lr,
            weight_decay=config.weight_decay,
            muon_weight_decay=config.muon_weight_decay,
            prefix=f"{comp.name}/",
        )
    if not groups:
        raise ValueError(
            f"no component of {[c.name for c in components]} has a trainable parameter: nothing to train"
        )
    return groups


def optimizer_for_groups(
    groups: list[dict[str, Any]], config: OptimizerConfig, *, implementation: str = "auto"
) -> torch.optim.Optimizer:
    """The optimizer of ``config.name`` over parameter ``groups`` (see :func:`build_optimizer` for
    ``implementation``); a group's own ``lr`` / ``weight_decay`` take precedence over ``config``'s.

    Under ``muon`` the groups must carry ``use_muon`` (those of :func:`build_optimizer` /
    :func:`component_param_groups` do); a Muon group's ``row_splits`` become the optimizer's matrix splits.
    """
    if config.name == "muon":
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(
                f"optimizer implementation ({implementation!r}) must be one of {_IMPLEMENTATIONS}"
            )
        return _muon(groups, config)
    if config.name == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"optimizer implementation ({implementation!r}) must be one of {_IMPLEMENTATIONS}")
    if implementation == "auto":
        devices = {p.device.type for g in groups for p in g["params"]}
        fused = len(devices) == 1 and capabilities(devices.pop()).fused_optimizer
        implementation = "fused" if fused else "foreach"
    kwargs = {"lr": config.lr, "betas": tuple(config.betas), "eps": config.eps}
    if implementation == "for_loop":
        kwargs["foreach"] = False
    else:
        kwargs[implementation] = True
    cls = torch.optim.AdamW if config.name == "adamw" else torch.optim.Adam
    return cls(groups, **kwargs)


def _muon(groups: list[dict[str, Any]], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The Muon optimizer over ``groups``, with the fused matrices' splits set and its summary logged."""
    missing = [g.get("name", i) for i, g in enumerate(groups) if "use_muon" not in g]
    if missing:
        raise ValueError(
            f"parameter groups {missing} have no 'use_muon': build Muon's groups with build_optimizer or "
            "component_param_groups"
        )
    splits = [
        (param, sizes)
        for g in groups
        if "row_splits" in g
        for param, sizes in zip(g["params"], g["row_splits"], strict=True)
        if sizes is not None
    ]
    rank_zero_info(muon_summary(groups))
    options = config.muon
    optimizer = Muon(
        [{k: v for k, v in g.items() if k != "row_splits"} for g in groups],
        lr=config.muon_lr,
        weight_decay=config.muon_weight_decay,
        momentum=options.momentum,
        nesterov=options.nesterov,
        ns_coefficients=tuple(options.ns_coefficients),
        eps=options.eps,
        ns_steps=options.ns_steps,
        adjust_lr_fn=options.adjust_lr_fn,
        ns_dtype=getattr(torch, options.ns_dtype),
        betas=tuple(config.betas),
        adam_eps=config.eps,
    )
    for param, sizes in splits:
        optimizer.set_matrix_split(param, SplitRows(sizes))
    return optimizer

"""Optimizer construction: weight-decay groups and fused AdamW where the device supports it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer settings.

    Args:
        name: ``adamw``, ``adam`` or ``sgd``.
        lr: peak learning rate.
        weight_decay: decoupled weight decay for matrices.
        betas: Adam betas.
        eps: Adam epsilon.
        decay_norms_biases_embeddings: apply weight decay to norms, biases and embeddings too (off by default,
            as in GPT-3 / Llama recipes).
        momentum: SGD momentum.
    """

    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    decay_norms_biases_embeddings: bool = False
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            raise ValueError(f"optimizer.name ({self.name!r}) must be one of {_OPTIMIZERS}")
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr ({self.lr}) must be positive")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay ({self.weight_decay}) must be >= 0")


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
    """
    groups = param_groups(model, config.weight_decay, config.decay_norms_biases_embeddings)
    if not groups:
        raise ValueError("the model has no trainable parameters: check which components are frozen")
    return optimizer_for_groups(groups, config, implementation=implementation)


def component_param_groups(
    components: Iterable[Any], config: OptimizerConfig, learning_rates: Mapping[str, float] | None = None
) -> list[dict[str, Any]]:
    """Parameter groups per trainable component of a parallel plan: its decayed matrices and the rest, each named
    ``<component>/decay`` or ``<component>/no_decay``, with the component's own learning rate.

    Args:
        components: the plan's :class:`~forge_lightning.contracts.Component` s (frozen ones are left out).
        config: optimizer settings (weight decay, the default learning rate).
        learning_rates: peak learning rate by component name (others use ``config.lr``).

    Raises:
        ValueError: no component has a trainable parameter.
    """
    rates = dict(learning_rates or {})
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


def optimizer_for_groups(
    groups: list[dict[str, Any]], config: OptimizerConfig, *, implementation: str = "auto"
) -> torch.optim.Optimizer:
    """The optimizer of ``config.name`` over parameter ``groups`` (see :func:`build_optimizer` for
    ``implementation``); a group's own ``lr`` / ``weight_decay`` take precedence over ``config``'s."""
    if config.name == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"optimizer implementation ({implementation!r}) must be one of {_IMPLEMENTATIONS}")
    if implementation == "auto":
        devices = {p.device.type for g in groups for p in g["params"]}
        implementation = "fused" if devices == {"cuda"} else "foreach"
    kwargs = {"lr": config.lr, "betas": tuple(config.betas), "eps": config.eps}
    if implementation == "for_loop":
        kwargs["foreach"] = False
    else:
        kwargs[implementation] = True
    cls = torch.optim.AdamW if config.name == "adamw" else torch.optim.Adam
    return cls(groups, **kwargs)

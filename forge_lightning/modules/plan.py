"""The parallel plan: what a model declares so that strategies can apply parallelism generically.

A LightningModule returns a :class:`ParallelPlan` from ``parallel_plan()``. Strategies never know a model family:
they read the plan's components, the repeated blocks inside each (the unit for FSDP wrapping, activation
checkpointing and ``torch.compile``), the tensor-parallel plan and which components are frozen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn


@dataclass(kw_only=True)
class Component:
    """One part of a model (e.g. ``llm``, ``vision``, ``action_expert``) and how it may be parallelised.

    Args:
        name: component name used in strategy options (per-component meshes, components left unsharded).
        module: the component's root module.
        blocks: the repeated blocks inside ``module`` (e.g. decoder layers), in forward order.
        tp_plan: tensor-parallel styles keyed by module-name pattern relative to one block
            (``"self_attn.q_proj": "colwise"``), plus ``"<root>.name"`` entries for modules outside the blocks.
        frozen: whether the component's parameters are excluded from training.
    """

    name: str
    module: nn.Module
    blocks: list[nn.Module] = field(default_factory=list)
    tp_plan: dict[str, str] = field(default_factory=dict)
    frozen: bool = False


@dataclass(kw_only=True)
class ParallelPlan:
    """All components of a model; see :class:`Component`."""

    components: list[Component]

    def __post_init__(self) -> None:
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique, got {names}")

    def __iter__(self) -> Iterator[Component]:
        return iter(self.components)

    def component(self, name: str) -> Component:
        for comp in self.components:
            if comp.name == name:
                return comp
        raise KeyError(f"no component named {name!r}; the plan has {[c.name for c in self.components]}")

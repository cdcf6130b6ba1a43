"""The parallel plan: what a model declares so that strategies can apply parallelism generically.

A LightningModule returns a :class:`ParallelPlan` from ``parallel_plan()``. Strategies never know a model family:
they read the plan's components, the repeated blocks inside each (the unit for FSDP wrapping, activation
checkpointing and ``torch.compile``), the tensor-parallel plan with the sizes a tensor-parallel degree must divide,
and which components are frozen. A model made of several components that feed one decoder (a VLM: vision encoder ->
projector -> LLM) also declares its :class:`Composition`, so that a strategy which rebuilds the decoder
(``MegatronStrategy``, through the module's megatron-core model) can run the rest as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor, nn

if TYPE_CHECKING:
    from forge_lightning.distributed.expert_parallel import ExpertParallel


@runtime_checkable
class ExpertStack(Protocol):
    """The routed experts of one MoE layer, which a strategy may spread over expert-parallel ranks.

    ``enable_expert_parallel(ep)`` keeps the module's share of the ``num_experts`` experts (its parameters become
    that slice of the full stacks: call it after they are initialised) and from then on exchanges tokens with the
    other ranks of ``ep`` in every forward
    (:class:`~forge_lightning.distributed.expert_parallel.ExpertParallel`). Every parameter of the module is
    expert-sharded, so a strategy wraps it as its own FSDP unit on the expert data-parallel mesh.
    """

    num_experts: int

    def enable_expert_parallel(self, ep: ExpertParallel) -> None: ...


@dataclass(kw_only=True)
class Component:
    """One part of a model (e.g. ``llm``, ``vision``, ``action_expert``) and how it may be parallelised.

    Args:
        name: component name used in strategy options (per-component meshes, components left unsharded).
        module: the component's root module.
        blocks: the repeated blocks inside ``module`` (e.g. decoder layers), in forward order.
        tp_plan: tensor-parallel styles keyed by module-name pattern relative to one block
            (``"self_attn.q_proj": "colwise"``), plus ``"<root>.name"`` entries for modules outside the blocks.
        tp_dims: the sizes that a tensor-parallel degree splitting this component must divide, by the config
            field they come from (``{"num_heads": 32, "num_kv_heads": 8, "vocab_size": 128256}``); checked once, by
            :meth:`ParallelPlan.check_tensor_parallel`, before anything is sharded.
        frozen: whether the component's parameters are excluded from training.
        activation_checkpointing: this component's blocks' mode (``none``, ``full``, ``selective``) in place of the
            run's ``performance.activation_checkpointing``; ``None``: the run's.
        compile: whether to ``torch.compile`` this component's blocks in place of the run's
            ``performance.compile``; ``None``: the run's.
        experts: the routed-expert stacks inside the blocks (:class:`ExpertStack`), one per MoE layer, for expert
            parallelism; empty for a dense component.
    """

    name: str
    module: nn.Module
    blocks: list[nn.Module] = field(default_factory=list)
    tp_plan: dict[str, str] = field(default_factory=dict)
    tp_dims: dict[str, int] = field(default_factory=dict)
    frozen: bool = False
    activation_checkpointing: str | None = None
    compile: bool | None = None
    experts: list[nn.Module] = field(default_factory=list)

    def __post_init__(self) -> None:
        bad = [type(m).__name__ for m in self.experts if not isinstance(m, ExpertStack)]
        if bad:
            raise ValueError(
                f"component {self.name!r}: experts must implement ExpertStack (num_experts, "
                f"enable_expert_parallel(ep)); got {bad}"
            )


def take_samples(batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The samples ``rows`` of ``batch``: every tensor whose first dimension is the batch size (that of
    ``input_ids``) indexed by ``rows``, everything else as it is."""
    batch_size = batch["input_ids"].shape[0]
    return {
        k: v.index_select(0, rows.to(v.device))
        if isinstance(v, Tensor) and v.ndim and len(v) == batch_size
        else v
        for k, v in batch.items()
    }


@dataclass(kw_only=True)
class Composition:
    """How the components of a composed model feed its decoder LM::

        batch ──encode──> encoded [b, N, H] ─┐
        input_ids ──decoder's embedding──────┴─merge──> decoder inputs [b, T, H], labels [b, T] ──> decoder LM

    The native forward and every strategy use the same two functions, so a strategy may run the decoder as
    another implementation (``MegatronStrategy``: the megatron-core model the module provides for it) and the
    other components as they are.

    Args:
        decoder: name of the decoder component (the one a strategy may rebuild; its family's megatron-core
            model stands for it).
        encode: ``encode(batch) -> encoded``: runs every other component on the batch's samples and returns one
            tensor whose first dimension is the samples. Each sample must be encoded independently of the others
            (no batch statistics): a strategy may encode a micro-batch's samples in parts on different ranks and
            concatenate the results (the parts taken by ``select``), so the other dimensions must not depend on
            which samples a part holds.
        merge: ``merge(token_embeds_BSH, encoded, batch) -> (inputs_BTH, labels_BT)``: the decoder's input
            embeddings from the token embeddings of ``batch["input_ids"]`` and ``encode``'s output, and the labels
            of those ``T`` positions (``ignore_index`` where no token is predicted, e.g. on encoder positions).
        select: ``select(batch, rows) -> batch``: the batch of the samples ``rows`` (``[n]`` indices into the batch,
            repeats allowed), for ``encode``. Default :func:`take_samples`: every tensor whose first dimension is the
            batch size is indexed; a batch whose inputs are not laid out per sample (a VLM's images of all samples
            in one tensor) gives its own.
        position_ids: ``position_ids(batch) -> positions``: the decoder's RoPE positions of the whole batch
            (``[b, T]``, or ``[3, b, T]`` for multimodal RoPE), computed from the batch alone (under pipeline
            parallelism every stage computes them: later stages hold no encoder output). ``None``: ``0 .. T-1``.
        layer_residuals: ``layer_residuals(encoded, batch) -> [residual_BTH, ...]``: tensors added to the outputs of
            the decoder's first layers, one each, taken from ``encode``'s output (Qwen3-VL's DeepStack). ``None``:
            none.
    """

    decoder: str
    encode: Callable[[dict[str, Tensor]], Tensor]
    merge: Callable[[Tensor, Tensor, dict[str, Tensor]], tuple[Tensor, Tensor]]
    select: Callable[[dict[str, Tensor], Tensor], dict[str, Tensor]] = take_samples
    position_ids: Callable[[dict[str, Tensor]], Tensor] | None = None
    layer_residuals: Callable[[Tensor, dict[str, Tensor]], list[Tensor]] | None = None


@dataclass(kw_only=True)
class ParallelPlan:
    """All components of a model; see :class:`Component`.

    Args:
        components: the model's components.
        composition: for a model whose components feed one decoder LM (encoder -> projector -> LLM), how they do;
            ``None`` for a model of one component or whose components no strategy needs to recompose.
    """

    components: list[Component]
    composition: Composition | None = None

    def __post_init__(self) -> None:
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique, got {names}")
        if self.composition is not None and self.composition.decoder not in names:
            raise ValueError(
                f"composition.decoder ({self.composition.decoder!r}) must be one of the components {names}"
            )

    def __iter__(self) -> Iterator[Component]:
        return iter(self.components)

    def component(self, name: str) -> Component:
        for comp in self.components:
            if comp.name == name:
                return comp
        raise KeyError(f"no component named {name!r}; the plan has {[c.name for c in self.components]}")

    def check_tensor_parallel(
        self, size: int, *, option: str, components: Iterable[str] | None = None
    ) -> None:
        """Raise ``ValueError`` unless ``size`` divides every ``tp_dims`` entry of the components it splits.

        Args:
            size: the tensor-parallel degree.
            option: the option that set it, for the message (``tensor_parallel_size``, ...).
            components: the names of the components it splits (default: all).

        Raises:
            ValueError: naming every size ``size`` does not divide, with its component and field, and the degrees
                that divide them all.
        """
        if size == 1:
            return
        names = {c.name for c in self.components} if components is None else set(components)
        dims = {
            f"{comp.name}.{field_name}": value
            for comp in self.components
            if comp.name in names
            for field_name, value in comp.tp_dims.items()
        }
        bad = [f"{name} ({value})" for name, value in dims.items() if value % size]
        if bad:
            raise ValueError(
                f"{option} ({size}) must divide the model's {', '.join(bad)}: each tensor-parallel rank holds an "
                f"equal share of them; set {option} to one of {common_divisors(*dims.values())}, which divide every "
                f"one of {', '.join(f'{k} ({v})' for k, v in dims.items())}"
            )


def common_divisors(*values: int) -> list[int]:
    """The degrees that divide every one of ``values`` (positive integers), in increasing order: the choices to
    offer for a degree that must divide them all."""
    common = math.gcd(*values)
    small = [d for d in range(1, math.isqrt(common) + 1) if common % d == 0]
    return sorted({*small, *(common // d for d in small)})

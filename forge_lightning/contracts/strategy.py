"""What modules, datamodules, callbacks and the CLI may ask of a strategy.

A forge strategy declares its :class:`StrategyTraits` as a class attribute ``traits`` (read before the strategy is
built: the CLI decides from them how to build the module and which checkpoint I/O to add) and implements the
protocols below where they apply. Lightning's own strategies implement none of them; the helper functions give
their behaviour (the whole world is data-parallel, the module's own state dict is the full model)::

    traits                   owns_checkpoint_io, reads_pretrained_shards, applies_performance
    DataParallelLayout       data_parallel_size / data_parallel_rank     samplers, the loss normalisation, metrics
    TensorParallelLayout     tensor_parallel_size                        callbacks that run the module's layers
    StateGatherer            full_model_state_dict(module)               export of sharded weights
    SeparateWeights          module_weights()                            running the module itself (generation)
    TrainedParameters        trained_parameters()                        callbacks that average or write the trained
                                                                         weights in place (EMA), their checkpoints
    ParameterResync          parameters_changed()                        callbacks that write parameters (EMA)
    GradientGate             nonfinite_gradients(optimizer),             the non-finite guard: check the step's
                             skip_optimizer_step(optimizer)              gradients, leave the step unapplied
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyTraits:
    """What a strategy does itself, declared on its class.

    Args:
        owns_checkpoint_io: writes its own (sharded) checkpoints; the CLI adds no single-file checkpoint I/O.
        reads_pretrained_shards: builds its model from the module's ``pretrained`` directory itself, each rank
            reading its own shards; the CLI builds the module under
            :func:`~forge_lightning.contracts.deferred_pretrained`.
        applies_performance: applies the module's ``performance`` section itself (after its own tensor
            parallelism, or to the model it trains), so the module's ``configure_model`` does not.
        shards_model: the model's parameters are split over ranks (no rank holds the whole model).
    """

    owns_checkpoint_io: bool = False
    reads_pretrained_shards: bool = False
    applies_performance: bool = False
    shards_model: bool = False


_LIGHTNING_DEFAULTS = StrategyTraits()


def traits_of(strategy: Any) -> StrategyTraits:
    """The traits of a strategy instance or class (Lightning's own strategies: all off)."""
    traits = getattr(strategy, "traits", None)
    return traits if isinstance(traits, StrategyTraits) else _LIGHTNING_DEFAULTS


@runtime_checkable
class DataParallelLayout(Protocol):
    """A strategy whose data-parallel ranks are fewer than its processes (tensor / pipeline / context parallel
    ranks of one replica share a data rank)."""

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def data_parallel_rank(self) -> int: ...


def data_parallel(strategy: Any) -> tuple[int, int]:
    """``(data-parallel size, data-parallel rank)`` under ``strategy``: its declared layout, else every process is
    a data rank (Lightning's DDP and single-device strategies)."""
    if isinstance(strategy, DataParallelLayout):
        return strategy.data_parallel_size, strategy.data_parallel_rank
    return strategy.world_size, strategy.global_rank


@runtime_checkable
class TensorParallelLayout(Protocol):
    """A strategy that splits the module's own layers over tensor-parallel ranks (FSDP2Strategy with TP)."""

    @property
    def tensor_parallel_size(self) -> int: ...


def tensor_parallel_size(strategy: Any) -> int:
    """How many ranks split the module's own layers (its :class:`TensorParallelLayout`, else 1)."""
    return strategy.tensor_parallel_size if isinstance(strategy, TensorParallelLayout) else 1


@runtime_checkable
class StateGatherer(Protocol):
    """A strategy whose ranks hold parts of the trained weights (or another copy of them than the module's)."""

    def full_model_state_dict(self, module: nn.Module | None = None) -> dict[str, Tensor]:
        """The full state dict of ``module`` (``None``: the LightningModule) under its own ``state_dict()`` names,
        on CPU on global rank 0 (empty elsewhere). Collective: every rank calls it."""
        ...


def full_state_dict(strategy: Any, module: nn.Module) -> dict[str, Tensor] | None:
    """``module``'s trained weights gathered by ``strategy`` (see :class:`StateGatherer`), or ``None`` when the
    strategy keeps whole weights in the module itself (read ``module.state_dict()``)."""
    if isinstance(strategy, StateGatherer):
        return strategy.full_model_state_dict(module)
    return None


@runtime_checkable
class SeparateWeights(Protocol):
    """A strategy that trains another model than the module's own (``MegatronStrategy``: the megatron-core twin),
    so the module's parameters are not the trained weights until the strategy copies them in."""

    def module_weights(self) -> AbstractContextManager[None]:
        """Within it, the LightningModule's own parameters hold the trained weights, whole, on every rank's
        device (collective on entry: every rank enters it)."""
        ...


def module_weights(strategy: Any) -> AbstractContextManager[None]:
    """A context in which the LightningModule itself holds the trained weights (to generate with it, or read
    them): the strategy's :meth:`SeparateWeights.module_weights`, else nothing to do (the module's own parameters,
    sharded or not, are what the strategy trains)."""
    return strategy.module_weights() if isinstance(strategy, SeparateWeights) else contextlib.nullcontext()


@runtime_checkable
class TrainedParameters(Protocol):
    """A strategy whose optimizer steps other tensors than the LightningModule's own parameters (``MegatronStrategy``:
    the twin's chunks), so code that reads or writes the trained weights in place asks it for them.

    Per-parameter callback state: a mapping, anywhere in a callback's ``state_dict()``, from these names to tensors
    of the named parameters' shapes (the EMA callback's average) is saved by such a strategy's checkpoints sharded
    like the parameters themselves (each rank writes its shards; a resume at another layout reads its own), and
    comes back to the callback's ``load_state_dict`` under this run's names.
    """

    def trained_parameters(self) -> list[tuple[str, Tensor]]:
        """This rank's trained tensors by name, after the strategy's setup (from ``on_fit_start`` on).

        Names are unique on the rank and the same throughout a fit (not across layouts); tensors are this rank's
        shards where the model is split, keep their identity throughout the fit, and hold the weights the next
        forward runs with (after the last optimizer step). Writing into them in place (under ``no_grad``) changes
        those weights; a writer also tells a :class:`ParameterResync` strategy.
        """
        ...


def trained_parameters(strategy: Any, module: nn.Module) -> list[tuple[str, Tensor]]:
    """The tensors ``strategy``'s optimizer trains, by name (see :class:`TrainedParameters`); else ``module``'s own
    parameters that require gradients, under their ``named_parameters()`` names (sharded DTensors under FSDP2)."""
    if isinstance(strategy, TrainedParameters):
        return strategy.trained_parameters()
    return [(name, param) for name, param in module.named_parameters() if param.requires_grad]


@runtime_checkable
class LazyParameterGather(Protocol):
    """A strategy that may defer gathering the updated parameters into the next forward (``MegatronStrategy`` with
    ``overlap_param_gather``: between steps each data-parallel rank holds the new weights only in its own slice of
    every parameter). Code that reads or writes the trained weights between steps completes the gather first."""

    def complete_parameter_gather(self) -> None:
        """Finish (or run) the pending all-gather, so that every rank's parameters hold the newest weights.
        Collective over the data-parallel group; a no-op when nothing is deferred."""
        ...


def complete_parameter_gather(strategy: Any) -> None:
    """:meth:`LazyParameterGather.complete_parameter_gather` where ``strategy`` defers it; else nothing."""
    if isinstance(strategy, LazyParameterGather):
        strategy.complete_parameter_gather()


@runtime_checkable
class ParameterResync(Protocol):
    """A strategy that caches something derived from the parameters (FSDP2's delta-FP8 all-gather keeps the last
    reconstruction): code that writes parameters outside the optimizer tells it."""

    def parameters_changed(self) -> None: ...


@runtime_checkable
class GradientGate(Protocol):
    """A strategy whose gradients are not the parameters' ``.grad`` (megatron-core's gradient buffers), or whose
    optimizer step is its own: it counts the step's non-finite gradients and can leave the step unapplied."""

    def nonfinite_gradients(self, optimizer: Any) -> Tensor:
        """This rank's number of gradient tensors holding NaN / inf (a 0-d tensor; no host sync)."""
        ...

    def skip_optimizer_step(self, optimizer: Any) -> None:
        """Leave the coming optimizer step unapplied: weights and optimizer state unchanged."""
        ...


def _optimizer_parameters(optimizer: Any) -> list[Tensor]:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    return [p for group in inner.param_groups for p in group["params"]]


def nonfinite_gradients(strategy: Any, optimizer: Any) -> Tensor:
    """This rank's number of gradients with NaN / inf: the strategy's (:class:`GradientGate`), or those of the
    optimizer's parameters (a DTensor's local shard)."""
    if isinstance(strategy, GradientGate):
        return strategy.nonfinite_gradients(optimizer)
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in _optimizer_parameters(optimizer) if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if not local:
        return torch.zeros((), device=strategy.root_device)
    flags = [~torch.isfinite(g).all() for g in local if g.numel()]
    return torch.stack(flags).sum().float() if flags else torch.zeros((), device=strategy.root_device)


def skip_optimizer_step(strategy: Any, optimizer: Any) -> None:
    """Leave the coming optimizer step unapplied: the strategy's way (:class:`GradientGate`), or the parameters'
    gradients dropped (torch's optimizers step only parameters that have one, so nothing changes)."""
    if isinstance(strategy, GradientGate):
        strategy.skip_optimizer_step(optimizer)
        return
    for parameter in _optimizer_parameters(optimizer):
        parameter.grad = None

"""What strategies, callbacks and the CLI may ask of a LightningModule, and how a module's pretrained weights may be
left for the strategy to read.

Each protocol is ``runtime_checkable``: code that needs one checks ``isinstance(module, Protocol)`` and says
what is missing, instead of probing attributes. A family's module implements the ones it supports::

    PlannedModule      parallel_plan()            every strategy (components, blocks, TP plan, frozen parts)
    MeasuredModule     batch_stats(batch)         ThroughputMonitor (samples, tokens, training FLOPs)
    TunedModule        performance, performance_switches
                                                  strategies apply the switches; the module applies its own
    GenerativeModule   generate(input_ids, ...)   TextSample, GenerationMetric
    VideoGenerativeModule  generate(prompts, ...), decode_latents(latents), decodes_video
                                                  VideoSamplingCallback, VideoPredictionWriter
    ExportableModule   save_pretrained(path)      HFExport
    MegatronModule     megatron_model(build)      MegatronStrategy (see contracts/megatron.py)
    ContextParallelModule  enable_context_parallel(cp)
                                                  native strategies with context_parallel_size > 1
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from forge_lightning.contracts.plan import ParallelPlan
    from forge_lightning.distributed.context_parallel import ContextParallel
    from forge_lightning.performance import PerformanceConfig


@runtime_checkable
class PlannedModule(Protocol):
    """A module that declares its components, repeated blocks, tensor-parallel plan and frozen parts."""

    def parallel_plan(self) -> ParallelPlan: ...


@runtime_checkable
class ContextParallelModule(Protocol):
    """A module that can split each sample's token sequence over context-parallel ranks.

    The strategy calls ``enable_context_parallel`` once, after tensor parallelism and before the performance
    transforms and sharding, with this rank's group (and algorithm) in a
    :class:`~forge_lightning.distributed.context_parallel.ContextParallel`. From then on every rank of the group
    receives the same samples; the module's forwards keep one slice of the sequence per rank, and its loss (on the
    gathered output, or per slice) must give gradients that, summed over the group, are ``cp.size`` times one
    process's (the strategy averages gradients over the data-parallel x context-parallel ranks).
    """

    def enable_context_parallel(self, cp: ContextParallel) -> None: ...


@runtime_checkable
class MeasuredModule(Protocol):
    """A module that counts what a micro-batch holds: any of ``samples``, ``tokens`` and ``flops`` (training FLOPs,
    forward + backward)."""

    def batch_stats(self, batch: Any) -> dict[str, float]: ...


@runtime_checkable
class TunedModule(Protocol):
    """A module with the run's ``performance`` section.

    ``performance_switches`` names the switches the module applies itself (dotted field names of
    :class:`~forge_lightning.performance.PerformanceConfig`, e.g. ``kernels.cross_entropy``: its loss kernel); the
    strategy applies the others it supports, and any changed switch nobody applies is refused
    (:func:`~forge_lightning.performance.check_applied`).
    """

    performance: PerformanceConfig
    performance_switches: ClassVar[frozenset[str]]


@runtime_checkable
class StepLoss(Protocol):
    """A module that gives, before the optimizer step, this rank's ``[loss sum, item count]`` of the step's
    micro-batches (``None`` when none were recorded): the non-finite guard checks the step's loss from them."""

    def step_loss_sums(self) -> Tensor | None: ...


@runtime_checkable
class ConfiguredModule(Protocol):
    """A module built from a model config dataclass it keeps as ``config`` (resolved: a preset or a ``config.json``
    read into its fields), which the run's checkpoints record and a resume compares."""

    config: Any


@runtime_checkable
class SkippedStepAware(Protocol):
    """A module that updates state of its own at the optimizer step (besides its weights), told when the coming step
    is left out, so that the update is left out with it (e.g. the MoE selection bias of auxiliary-loss-free
    balancing). The non-finite guard calls it before the module's ``on_before_optimizer_step``."""

    def optimizer_step_skipped(self) -> None: ...


@runtime_checkable
class GenerativeModule(Protocol):
    """A module that continues token sequences (greedy or sampled, with a KV cache)."""

    def generate(self, input_ids: Tensor, **kwargs: Any) -> Tensor: ...


@runtime_checkable
class VideoGenerativeModule(Protocol):
    """A module that generates videos from prompts: ``generate(prompts, seed=[...], decode=False, ...)`` gives
    latents (a model forward per sampling step: collective under a strategy that shards the model), and
    ``decode_latents`` turns them into RGB ``[B, 3, F, H, W]`` in ``[-1, 1]``, which needs ``decodes_video`` (its
    decoder, e.g. a VAE, is configured)."""

    @property
    def decodes_video(self) -> bool: ...

    def generate(self, prompts: Any, **kwargs: Any) -> Tensor: ...

    def decode_latents(self, latents: Tensor) -> Tensor: ...


@runtime_checkable
class ExportableModule(Protocol):
    """A module that writes its weights in its reference format (a Hugging Face directory). Collective under a
    strategy that shards parameters: every rank calls it."""

    def save_pretrained(self, path: str | Path, dtype: Any = None, overwrite: bool = False) -> None: ...


_DEFER_PRETRAINED: ContextVar[bool] = ContextVar("defer_pretrained", default=False)


@contextmanager
def deferred_pretrained() -> Iterator[None]:
    """Within it, modules built with a ``pretrained`` directory leave the weights in the files: their native model
    is built on the meta device, and a strategy that builds its own model from the directory (one whose
    ``traits.reads_pretrained_shards`` is set, ``MegatronStrategy``) reads on each rank only that rank's shards.

    The CLI enters it when the configured strategy reads its shards itself; a module that cannot defer (LoRA
    adapters on the native model) loads as usual.
    """
    token = _DEFER_PRETRAINED.set(True)
    try:
        yield
    finally:
        _DEFER_PRETRAINED.reset(token)


def pretrained_deferred() -> bool:
    """Whether modules built now should leave their pretrained weights for the strategy (see
    :func:`deferred_pretrained`)."""
    return _DEFER_PRETRAINED.get()

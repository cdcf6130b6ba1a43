"""The contract between ``MegatronStrategy`` and a family: the strategy owns megatron-core's processes, schedule,
DDP, optimizer and checkpoints; the family owns the megatron-core model that stands for its module.

::

    MegatronStrategy                                   a family's module (MegatronModule)
      MegatronDims.validate(world)  ─ parallel state
      MegatronBuild(dims, device, ...) ──────────────▶ module.megatron_model(build) -> MegatronTwin
                                                          twin.build_chunks()      this rank's model chunks
      megatron DDP, optimizer, LR schedule
      per step: the schedule over N micro-batches ───▶ twin.forward_step(batch, chunk) -> (output, loss_fn)
                                                          loss_fn(output) -> (loss sum, count, {LOSS_AND_COUNT})
                sums of the step (this data rank) ───▶ twin.after_schedule(...)  the module records and logs
      checkpoints (dist-checkpoint) ─────────────────▶ twin.hf_config(), twin.check_checkpoint_config(saved)
      full_model_state_dict ─────────────────────────▶ twin.state_dict(chunks)  under the module's own names

``strategies/`` imports no family: everything a family knows (its megatron-core model, weight mapping, loss,
metrics) is behind :class:`MegatronTwin`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from forge_lightning.contracts.plan import Composition
    from forge_lightning.optim import OptimizerConfig, SchedulerConfig
    from forge_lightning.performance import PerformanceConfig

CP_COMM_TYPES = ("a2a", "p2p", "a2a+p2p")
"""Context-parallel attention, megatron-core's names: Ulysses all-to-all, ring, and Ulysses inside ring groups."""

LOSS_AND_COUNT = "loss_and_count"
"""Key of a twin's loss function's logging dict: ``[loss sum, count]`` (float64, detached) of the micro-batch."""

RECOMPUTE = ("none", "full")
"""Activation recompute of the twin's layers (``full``: megatron's full recompute of every layer)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronDims:
    """MegatronStrategy's parallel layout in megatron-core's names, validated once against the world size
    (:meth:`validate`, before any process group is built; every message names every degree) and against the data's
    sequence length (:meth:`check_sequence_length`). The model's sizes are checked by the strategy from the plan
    (TP divisors) and by the family's twin (layers per stage, experts, heads per context-parallel rank).

    Args:
        tensor_model_parallel_size: TP ranks.
        pipeline_model_parallel_size: pipeline stages.
        virtual_pipeline_model_parallel_size: model chunks per stage (``None``: one).
        context_parallel_size: CP ranks sharing each sequence.
        cp_comm_type: one of :data:`CP_COMM_TYPES`.
        hierarchical_context_parallel_sizes: ``[a2a, p2p]`` group sizes of ``a2a+p2p``.
        expert_model_parallel_size: EP ranks splitting the routed experts.
        expert_tensor_parallel_size: ranks splitting each expert's width (``None``: TP).
        sequence_parallel: shard norms / dropout / residual stream on the sequence (needs TP > 1).
        use_distributed_optimizer: shard optimizer state over data-parallel ranks.
        overlap_param_gather: overlap the distributed optimizer's all-gather with the next forward.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    cp_comm_type: str = "a2a"
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False

    def __post_init__(self) -> None:
        sizes = self.hierarchical_context_parallel_sizes
        if sizes is not None:
            object.__setattr__(self, "hierarchical_context_parallel_sizes", tuple(sizes))

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def vpp(self) -> int:
        """Model chunks per stage (1 when not interleaved)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        """The experts' tensor-parallel size (TP unless set)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def ulysses_size(self) -> int:
        """The ranks Ulysses attention splits the heads over: CP for ``a2a``, the first hierarchical group for
        ``a2a+p2p``, 1 for ring attention."""
        if self.cp_comm_type == "a2a":
            return self.cp
        if self.cp_comm_type == "a2a+p2p":
            return (
                self.hierarchical_context_parallel_sizes[0] if self.hierarchical_context_parallel_sizes else 1
            )
        return 1

    @property
    def experts_apart(self) -> bool:
        """Whether the routed experts' gradients are reduced over a group of their own (see :func:`experts_apart`)."""
        return experts_apart(self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        """The degrees by megatron-core's option names (as checkpoints record the layout)."""
        out = dataclasses.asdict(self)
        if out["hierarchical_context_parallel_sizes"] is not None:
            out["hierarchical_context_parallel_sizes"] = list(out["hierarchical_context_parallel_sizes"])
        return out

    def describe(self, world_size: int | None = None) -> str:
        """Every degree, ``name=value``, for messages."""
        named = ", ".join(f"{k}={v}" for k, v in self.as_dict().items())
        return named if world_size is None else f"{named}, world size={world_size}"

    def validate(self, world_size: int) -> int:
        """Check the degrees against ``world_size`` and each other; return the data-parallel size
        ``world / (TP x PP x CP)``.

        Raises:
            ValueError: inconsistent degrees, all of them named in the message.
            ImportError: ``a2a+p2p`` without einops (megatron-core builds its hierarchical groups with it).
        """
        tp, pp, cp, ep, etp = self.tp, self.pp, self.cp, self.ep, self.etp
        vpp = self.virtual_pipeline_model_parallel_size
        named = self.describe(world_size)
        if min(tp, pp, cp, ep, etp) < 1 or (vpp is not None and vpp < 1):
            raise ValueError(f"every parallel degree must be at least 1: {named}")
        if world_size % (tp * pp * cp):
            raise ValueError(
                f"tensor x pipeline model parallel x context parallel size must divide the world size: {named}"
            )
        if (world_size // pp) % (ep * etp):
            # megatron-core lays the experts out on a grid of its own over each pipeline stage's TP x DP x CP
            # ranks: ETP ranks split an expert's width, EP ranks split the experts, the rest replicate them (expert
            # data parallelism). With ETP = TP (the default) that is: EP divides DP x CP.
            raise ValueError(
                f"expert_model_parallel_size ({ep}) x expert_tensor_parallel_size ({etp}) must divide the ranks of "
                f"a pipeline stage, tensor x data x context parallel size = world / pipeline model parallel size = "
                f"{world_size // pp}: {named}"
            )
        if vpp is not None and vpp > 1 and pp == 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1: {named}"
            )
        if self.sequence_parallel and tp == 1:
            raise ValueError(f"sequence_parallel needs tensor_model_parallel_size > 1: {named}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(f"overlap_param_gather needs use_distributed_optimizer: {named}")
        self._check_context_parallel()
        return world_size // (tp * pp * cp)

    def check_sequence_length(self, length: int, *, what: str = "data.seq_length") -> None:
        """Raise ``ValueError`` unless the layout can split sequences of ``length`` tokens: context parallelism
        cuts each into ``2 x CP`` equal chunks (megatron's load-balanced causal layout), and sequence parallelism
        gives each TP rank an equal share of a context-parallel rank's ``length / CP`` positions.

        Args:
            length: tokens per sequence.
            what: where ``length`` comes from, for the message.
        """
        tp, cp = self.tp, self.cp
        if cp > 1 and length % (2 * cp):
            raise ValueError(
                f"context_parallel_size ({cp}) splits each sequence into 2 x {cp} = {2 * cp} equal chunks (megatron's "
                f"causal load-balanced layout): {what} ({length}) must be divisible by {2 * cp}; use sequences of a "
                f"multiple of {2 * cp} tokens"
            )
        if self.sequence_parallel and (length // cp) % tp:
            per_rank = f"{what} ({length}) / context_parallel_size ({cp}) = {length // cp}" if cp > 1 else ""
            raise ValueError(
                f"sequence_parallel: {per_rank or f'{what} ({length})'} must be divisible by "
                f"tensor_model_parallel_size ({tp}): each tensor-parallel rank holds an equal share of the "
                f"sequence; use sequences of a multiple of {math.lcm(2 * cp if cp > 1 else 1, cp * tp)} tokens or "
                "set sequence_parallel: false"
            )

    def _check_context_parallel(self) -> None:
        comm_type, sizes, cp = self.cp_comm_type, self.hierarchical_context_parallel_sizes, self.cp
        if comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type ({comm_type!r}) must be one of {', '.join(CP_COMM_TYPES)}")
        if comm_type != "a2a+p2p":
            if sizes:
                raise ValueError(
                    f"hierarchical_context_parallel_sizes ({list(sizes)}) is only read with cp_comm_type "
                    f"'a2a+p2p', got {comm_type!r}"
                )
            return
        if not sizes or len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
            raise ValueError(
                f"cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes [a2a, p2p] whose product is "
                f"context_parallel_size ({cp}), got {None if sizes is None else list(sizes)}"
            )
        if importlib.util.find_spec("einops") is None:
            raise ImportError(
                "cp_comm_type 'a2a+p2p' needs einops (megatron-core's hierarchical groups): pip install einops"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoECommOverlap:
    """megatron-core's MoE communication overlap options, by its names (``TransformerConfig`` fields), checked up
    front: against the layout and run here (:meth:`check`, at strategy setup, before any process group or model is
    built) and against the model by the family's twin (it has MoE layers, shared experts, a layer spec that can).

    Args:
        overlap_moe_expert_parallel_comm: overlap the expert-parallel all-to-all of one micro-batch with the
            computation of another (megatron-core's combined 1F1B schedule: forward of micro-batch i+1 beside the
            backward of micro-batch i, on separate CUDA streams).
        delay_wgrad_compute: with ``overlap_moe_expert_parallel_comm``, compute the weight gradients after the
            data gradients, so that the all-to-all also overlaps them (TransformerEngine's linears).
        moe_shared_expert_overlap: run the shared experts on a CUDA stream of their own beside the token
            dispatcher's all-to-all.
    """

    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    moe_shared_expert_overlap: bool = False

    @property
    def enabled(self) -> bool:
        """Whether any of the options is on."""
        return any(dataclasses.astuple(self))

    def transformer_config_fields(self) -> dict[str, bool]:
        """The options as ``TransformerConfig`` keyword arguments."""
        return dataclasses.asdict(self)

    def check(
        self,
        dims: MegatronDims,
        *,
        device: torch.device | None = None,
        bf16: bool | None = None,
        recompute: str | None = None,
    ) -> None:
        """Raise ``ValueError`` naming the option and the fix for a precondition megatron-core sets (its
        ``TransformerConfig`` asserts, or code that needs CUDA streams) that the run does not meet.

        ``device``, ``bf16`` and ``recompute`` are checked when given (the strategy knows them once the trainer is
        set up); the layout always.
        """
        if self.delay_wgrad_compute and not self.overlap_moe_expert_parallel_comm:
            raise ValueError(
                "delay_wgrad_compute needs overlap_moe_expert_parallel_comm=True (megatron-core delays the weight "
                "gradients only in its combined 1F1B schedule): set both, or neither"
            )
        if self.overlap_moe_expert_parallel_comm:
            self._check_expert_overlap(dims, bf16=bf16, recompute=recompute)
        if device is not None and self.enabled and device.type != "cuda":
            on = [name for name, value in dataclasses.asdict(self).items() if value]
            raise ValueError(
                f"{' and '.join(on)} {'needs' if len(on) == 1 else 'need'} a CUDA device (megatron-core runs the "
                f"overlapped work on CUDA streams), the run's is {device.type!r}: set "
                f"{'it' if len(on) == 1 else 'them'} to false on this machine"
            )

    def _check_expert_overlap(self, dims: MegatronDims, *, bf16: bool | None, recompute: str | None) -> None:
        named = f"overlap_moe_expert_parallel_comm with {dims.describe()}"
        if dims.ep < 2:
            raise ValueError(
                f"{named}: it overlaps the expert-parallel all-to-all, so it needs expert_model_parallel_size > 1"
            )
        if dims.pp > 1 and dims.virtual_pipeline_model_parallel_size is None:
            raise ValueError(
                f"{named}: with pipeline_model_parallel_size > 1 megatron-core overlaps within the interleaved "
                "schedule only; set virtual_pipeline_model_parallel_size (e.g. 2)"
            )
        if self.moe_shared_expert_overlap:
            raise ValueError(
                "overlap_moe_expert_parallel_comm and moe_shared_expert_overlap exclude each other (the combined "
                "1F1B schedule places the shared experts itself): set moe_shared_expert_overlap to false"
            )
        if bf16 is False:
            raise ValueError(
                "overlap_moe_expert_parallel_comm runs bf16 models only (megatron-core asserts it): set "
                "trainer.precision to bf16-mixed or bf16-true"
            )
        if recompute not in (None, "none"):
            raise ValueError(
                f"overlap_moe_expert_parallel_comm does not run with activation recompute ({recompute!r}): set "
                "performance.activation_checkpointing and the components' recompute to 'none'"
            )


def experts_apart(layout: Mapping[str, Any]) -> bool:
    """Whether the routed experts' gradients are reduced over megatron's expert data-parallel group rather than the
    data-parallel one: with expert parallelism, or an expert tensor-parallel size other than TP (the TP ranks then
    hold whole or differently split experts and route different tokens to them).

    Args:
        layout: degrees by megatron-core's names (:meth:`MegatronDims.as_dict`, or a checkpoint's recorded layout).
    """
    etp = layout.get("expert_tensor_parallel_size")
    return layout.get("expert_model_parallel_size", 1) > 1 or (
        etp is not None and etp != layout.get("tensor_model_parallel_size", 1)
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronBuild:
    """What MegatronStrategy hands :meth:`MegatronModule.megatron_model`.

    Args:
        dims: the validated parallel layout (megatron's parallel state is initialised with it).
        device: where the chunks live.
        bf16: bf16 parameters (megatron's ``Float16Module``; the optimizer keeps fp32 main weights), else fp32.
        use_transformer_engine: TransformerEngine layers (``None``: when importable and the twin supports them).
        recompute: the twin's activation recompute, one of :data:`RECOMPUTE` (from ``performance`` or the
            strategy's ``components`` option).
        performance: the module's performance settings; the twin applies those it names in
            :attr:`MegatronTwin.performance_switches` and raises for values it cannot honour.
        composition: set when the twin stands for the decoder of a composed model (encoder -> projector ->
            decoder): the twin merges ``encode``'s output into its inputs with ``composition.merge``.
        encode: the composition's encoder side for one micro-batch, run by the strategy (shared over the TP group,
            under the run's autocast); ``None`` without composition.
        moe_overlap: megatron-core's MoE communication overlap options (checked against the layout and run by the
            strategy); the twin passes them into its ``TransformerConfig`` and refuses those its model cannot run.
    """

    dims: MegatronDims
    device: torch.device
    bf16: bool
    use_transformer_engine: bool | None = None
    recompute: str = "none"
    performance: PerformanceConfig | None = None
    composition: Composition | None = None
    encode: Callable[[dict[str, Tensor]], Tensor] | None = None
    moe_overlap: MoECommOverlap = MoECommOverlap()


LossFunction = Callable[[Any], tuple[Tensor, Tensor, dict[str, Tensor]]]
"""megatron's loss function of one micro-batch (``calculate_per_token_loss``): ``(loss sum, count, logging)``;
megatron divides the step's gradients by the count summed over the step's micro-batches and data-parallel ranks."""


@runtime_checkable
class MegatronTwin(Protocol):
    """A family's megatron-core model for one module, built from a :class:`MegatronBuild`.

    It stands for one component of the module's plan: the composition's decoder, or the plan's only component.
    """

    performance_switches: frozenset[str]
    """The ``performance`` switches (dotted field names) the twin applies; the strategy applies ``optimizer``,
    ``attention.sdpa`` and ``compile: false`` and refuses any other changed switch."""

    def build_chunks(self) -> list[nn.Module]:
        """This rank's model chunks (one per virtual pipeline stage), holding the module's weights, not yet wrapped
        in megatron's DDP.

        Each chunk is what megatron-core's DDP, schedule and dist-checkpointing take: a ``MegatronModule`` whose
        ``config`` is a ``TransformerConfig`` with ``calculate_per_token_loss=True`` (the schedule then divides the
        gradients by the step's count; the strategy checks it), with megatron's ``model_type`` and
        ``set_input_tensor``, and whose ``sharded_state_dict()`` gives each tensor-parallel parameter as a split
        ``ShardedTensor`` (megatron's own parallel layers do; a plain submodule holding one would be saved whole).
        """
        ...

    def forward_step(self, batch: dict[str, Tensor], chunk: nn.Module) -> tuple[Any, LossFunction]:
        """The chunk's output on one micro-batch (the same batch on every rank of a model replica) and the loss
        function of that micro-batch; the loss function's logging dict holds :data:`LOSS_AND_COUNT`.

        A twin that accepts ``MegatronBuild.moe_overlap.overlap_moe_expert_parallel_comm`` also takes a keyword
        ``schedule_plan=True`` (megatron-core's combined 1F1B schedule passes it): it then returns the chunk's
        schedule plan (``GPTModel.build_schedule_plan``) in place of its output."""
        ...

    def after_schedule(
        self, chunks: list[nn.Module], sums: Tensor, *, training: bool, num_micro_batches: int
    ) -> None:
        """Called on every rank after each run of the schedule with ``[loss sum, count]`` (float64) of this rank's
        micro-batches (equal on every pipeline stage): the module records them and logs what the family logs.
        Collective."""
        ...

    def micro_batch_shape(self, batch: dict[str, Tensor]) -> tuple[int, int]:
        """``(micro-batch size, sequence length)`` of a micro-batch: megatron's pipeline schedule sizes the
        tensors it sends between stages from them."""
        ...

    def padding_batch(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """A micro-batch shaped like ``batch`` that adds no loss and no count (fills the interleaved schedule's
        groups in evaluation)."""
        ...

    def state_dict(self, chunks: list[nn.Module]) -> dict[str, Tensor]:
        """The full state of the component the twin stands for, under that component's own ``state_dict()`` names,
        on CPU on global rank 0 (empty elsewhere). Collective."""
        ...

    def hf_config(self) -> dict[str, Any]:
        """The model's Hugging Face config (written as a checkpoint's ``config.json``)."""
        ...

    def check_checkpoint_config(self, saved: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming each architecture field on which a checkpoint's config differs."""
        ...


@runtime_checkable
class MegatronModule(Protocol):
    """A LightningModule that trains under MegatronStrategy: it provides its megatron-core model and the optimizer
    and schedule settings the strategy builds megatron's optimizer from."""

    optimizer_config: OptimizerConfig
    scheduler_config: SchedulerConfig

    def megatron_model(self, build: MegatronBuild) -> MegatronTwin: ...

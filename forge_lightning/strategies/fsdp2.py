"""``FSDP2Strategy``: FSDP2 / HSDP (``fully_shard``) with optional tensor parallelism, from the module's plan.

The device mesh has four named dimensions::

    dp_replicate × dp_shard × cp × tp     (data_parallel_size = dp_replicate × dp_shard)
    HSDP: parameters sharded over dp_shard × cp, replicated over dp_replicate; TP shards inside each block
    CP: the ranks of one cp group read the same samples and split each sample's token sequence (the module's
        ``enable_context_parallel``, contracts.ContextParallelModule); FSDP shards parameters over dp_shard × cp
        flattened (as torchtitan does), so gradients are reduced over the cp ranks too

Transforms follow the one fixed order: TP (``forge_lightning.strategies.parallelize``) → the module's
``performance`` settings (FP8, kernels, activation checkpointing, per-block ``torch.compile``; see
``forge_lightning.performance``) → ``fully_shard`` of every block, then of the LightningModule as the root.
The root's step methods (``training_step`` ...) and ``generate`` are registered as FSDP forward methods, so the
parameters outside the blocks (embedding, final norm, output head) are gathered for the whole step (or the whole
generation) even when the module calls submodule methods other than ``forward`` or reads a weight directly (a
fused linear + cross-entropy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from forge_lightning.contracts import (
    ContextParallelModule,
    ParallelPlan,
    PlannedModule,
    StrategyTraits,
    TunedModule,
    common_divisors,
    device_mesh_type,
    process_group_backend,
)
from forge_lightning.distributed.context_parallel import ContextParallel
from forge_lightning.distributed.expert_parallel import ExpertParallel
from forge_lightning.performance import (
    PerformanceConfig,
    apply_performance,
    check_applied,
    mark_applied,
    module_switches,
)
from forge_lightning.strategies import expert_parallel as ep_par
from forge_lightning.strategies import parallelize as par
from forge_lightning.strategies.comm import FSDPCommHandles, apply_fsdp_comm_options, check_fsdp_comm_options
from forge_lightning.strategies.distributed_checkpoint import (
    CHECKPOINT_WRITERS,
    AsyncDistributedCheckpoint,
    full_model_state_dict,
    load_distributed_checkpoint,
    save_distributed_checkpoint,
)
from forge_lightning.strategies.materialize import materialize_module

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# The module's entry points that run forwards: Lightning's steps, and ``generate`` (the generative-module
# contract, called by TextSample / GenerationMetric outside any step, e.g. at the end of training). Each is
# registered as an FSDP forward method of the root, so the root's own parameters (embedding, final norm, head) are
# gathered while it runs; otherwise a call outside a step sees them as sharded DTensors ("aten.embedding.default
# got mixed torch.Tensor and DTensor").
_FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step", "generate")
# context_parallel_type -> ContextParallel.comm_type (megatron-core's cp_comm_type names).
CONTEXT_PARALLEL_TYPES = {"ulysses": "a2a", "ring": "p2p", "hybrid": "a2a+p2p"}


def _dtype(name: str | None, option: str) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"{option} must be one of {sorted(_DTYPES)} or null, got {name!r}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDPDims:
    """FSDP2Strategy's parallel layout, validated once against the world size (:meth:`validate`, before any process
    group is built); every message names every degree. The degrees are checked against the model by
    :func:`~forge_lightning.strategies.parallelize.check_tensor_parallel_plan`, before its weights are built.

    Args:
        data_parallel_size: data-parallel ranks (replicas x shards; ``"auto"``: world size / TP size).
        data_parallel_replicate_size: HSDP replica groups (must divide the data-parallel size).
        tensor_parallel_size: tensor-parallel ranks per data-parallel rank.
        context_parallel_size: context-parallel ranks sharing each sample's token sequence.
        context_parallel_type: ``ulysses``, ``ring`` or ``hybrid``.
        context_parallel_ulysses_size: ``hybrid`` only: the Ulysses group size (divides the context-parallel size;
            rings run across the groups).
        sequence_parallel: not supported yet (refused); see FSDP2Strategy.
        reshard_after_forward: ``True`` / ``False``, or the ranks each block is resharded to after forward (must
            divide the shard size, ``data_parallel_size / data_parallel_replicate_size``).
        expert_parallel_size: ranks of each expert-parallel group, carved out of the shard dimension (must divide
            the shard size; no tensor or context parallelism with it).
    """

    data_parallel_size: int | str = "auto"
    data_parallel_replicate_size: int = 1
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    context_parallel_type: str = "ulysses"
    context_parallel_ulysses_size: int | None = None
    sequence_parallel: bool = False
    reshard_after_forward: bool | int = True
    expert_parallel_size: int = 1

    def validate(self, world_size: int) -> int:
        """Check the degrees against ``world_size``; return the resolved data-parallel size.

        Raises:
            ValueError: inconsistent degrees, all of them named in the message.
        """
        tp, replicate, cp = (
            self.tensor_parallel_size,
            self.data_parallel_replicate_size,
            self.context_parallel_size,
        )
        auto = self.data_parallel_size == "auto"
        dp = world_size // max(tp * cp, 1) if auto else int(self.data_parallel_size)
        ulysses = self.context_parallel_ulysses_size
        degrees = (
            f"data_parallel_size={self.data_parallel_size} (resolved {dp}), data_parallel_replicate_size="
            f"{replicate}, context_parallel_size={cp} ({self.context_parallel_type}"
            f"{'' if ulysses is None else f', ulysses size {ulysses}'}), tensor_parallel_size={tp}, "
            f"expert_parallel_size={self.expert_parallel_size}, world size={world_size}"
        )
        if min(dp, replicate, tp, cp) < 1:
            raise ValueError(f"every parallel degree must be at least 1: {degrees}")
        if dp * cp * tp != world_size:
            raise ValueError(
                "data_parallel_size x context_parallel_size x tensor_parallel_size must equal the world size: "
                f"{degrees}"
            )
        if dp % replicate != 0:
            raise ValueError(f"data_parallel_replicate_size must divide data_parallel_size: {degrees}")
        self._validate_context_parallel(degrees)
        self._validate_expert_parallel(dp // replicate, degrees)
        if self.sequence_parallel:
            # Attention and the layers the plan keeps replicated (MLA, routed experts) would see only their rank's
            # share of the sequence, and nothing sums those layers' gradients over the tensor-parallel ranks.
            raise ValueError(
                "sequence_parallel is not supported by FSDP2Strategy yet: set sequence_parallel: false (tensor "
                "parallelism works without it), or use MegatronStrategy(sequence_parallel=true)"
            )
        reshard, shard = self.reshard_after_forward, dp // replicate
        if not isinstance(reshard, bool) and (reshard < 1 or shard % reshard):
            raise ValueError(
                f"reshard_after_forward ({reshard}) must divide the shard size, data_parallel_size / "
                f"data_parallel_replicate_size = {shard}: after forward each block's parameters are resharded to "
                f"groups of that many ranks; use one of {common_divisors(shard)}, true or false: {degrees}"
            )
        return dp

    def _validate_expert_parallel(self, shard: int, degrees: str) -> None:
        ep = self.expert_parallel_size
        if ep < 1:
            raise ValueError(f"expert_parallel_size must be at least 1: {degrees}")
        if ep == 1:
            return
        if shard % ep:
            raise ValueError(
                f"expert_parallel_size ({ep}) must divide the shard size, data_parallel_size / "
                f"data_parallel_replicate_size = {shard}: expert-parallel groups are carved out of the ranks that "
                f"shard the parameters; use one of {common_divisors(shard)}: {degrees}"
            )
        if self.tensor_parallel_size > 1 or self.context_parallel_size > 1:
            raise ValueError(
                "expert_parallel_size > 1 does not combine with tensor_parallel_size or context_parallel_size > 1 "
                "in FSDP2Strategy yet (the experts' tokens would be split or repeated across those ranks): set them "
                f"to 1, or use MegatronStrategy for TP / CP with EP: {degrees}"
            )

    def _validate_context_parallel(self, degrees: str) -> None:
        cp, kind, ulysses = (
            self.context_parallel_size,
            self.context_parallel_type,
            self.context_parallel_ulysses_size,
        )
        if kind not in CONTEXT_PARALLEL_TYPES:
            raise ValueError(
                f"context_parallel_type ({kind!r}) must be one of {', '.join(CONTEXT_PARALLEL_TYPES)}: {degrees}"
            )
        if kind != "hybrid":
            if ulysses is not None:
                raise ValueError(
                    f"context_parallel_ulysses_size is for context_parallel_type 'hybrid': {degrees}"
                )
            return
        if ulysses is None or not 1 < ulysses < cp or cp % ulysses:
            raise ValueError(
                "context_parallel_type 'hybrid' needs context_parallel_ulysses_size, a divisor of "
                f"context_parallel_size between 1 and it (Ulysses inside groups of that many ranks, ring across the "
                f"groups; one of {[d for d in common_divisors(cp) if 1 < d < cp]}): {degrees}"
            )


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallelism (FSDP2), HSDP and FSDP × TP, applied from the module's ``parallel_plan()``.

    Registered as ``fsdp2`` (HSDP and TP through the options). Use ``trainer.precision: 32-true`` with
    ``param_dtype: bf16`` for bf16 compute over fp32 master weights.

    Args:
        data_parallel_size: data-parallel ranks (replicas × shards); ``"auto"``: world size / TP size.
        tensor_parallel_size: tensor-parallel ranks per data-parallel rank (the mesh's innermost dimension); must
            divide every size the plan's split components advertise (``tp_dims``: heads, vocab, widths).
        data_parallel_replicate_size: HSDP replica groups; parameters are sharded over
            ``data_parallel_size / data_parallel_replicate_size`` ranks and replicated across groups.
            ``"auto"``: the number of nodes (shard within a node, replicate across nodes).
        context_parallel_size: ranks that split each sample's token sequence (context parallelism; the mesh's
            ``cp`` dimension, between ``dp_shard`` and ``tp``). They read the same samples (the data-parallel size
            excludes them) and FSDP shards parameters over ``dp_shard x cp``. The module must implement
            ``enable_context_parallel`` (:class:`~forge_lightning.contracts.ContextParallelModule`).
        context_parallel_type: ``ulysses`` (all-to-all of heads; the module's heads must divide the size),
            ``ring`` (key / value blocks passed around the ranks; any head count) or ``hybrid`` (Ulysses inside
            groups of ``context_parallel_ulysses_size`` ranks, ring across them).
        context_parallel_ulysses_size: the Ulysses group size of ``hybrid``.
        sequence_parallel: not supported yet, refused (attention and the layers the plan keeps replicated would
            see only their rank's share of the sequence); with TP the residual stream stays replicated.
        param_dtype: compute dtype of the gathered parameters (``bf16``, ``fp32``...; ``None``: as stored).
        reduce_dtype: dtype of the gradient reduce-scatter (``None``: ``param_dtype``).
        output_dtype: dtype the root's outputs are cast to (``None``: unchanged).
        reshard_after_forward: free gathered block parameters after forward (``True``), keep them until backward
            (``False``, ZeRO-2-like), or reshard to this many ranks (an ``int`` dividing the shard size).
        forward_prefetch: blocks whose all-gather is issued ahead in forward (0: FSDP2's implicit order).
        backward_prefetch: blocks prefetched in backward (1: FSDP2's default).
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        unsharded_components: frozen components kept whole and replicated on every rank (e.g. a vision encoder).
        replicated_components: trainable components kept whole on every data-parallel rank, as one unit whose
            gradients are all-reduced (a 2-D replicate x 1 mesh): no parameter all-gathers for a small encoder.
            They also stay out of tensor parallelism: with TP > 1 they run with TP = 1, data-parallel across the
            TP group (per-component TP size).
        param_all_gather: ``exact`` (FSDP2's all-gather) or ``delta_fp8``: each rank sends the block-quantized FP8
            difference between its shard and the last reconstruction (about half the bytes of bf16; every rank
            holds bit-identical parameters; see ``forge_lightning.strategies.comm.delta_fp8``).
        delta_resync_every: with ``delta_fp8``, send the exact shards every this many steps (0: never).
        delta_keep_unsharded: with ``delta_fp8``, keep parameters unsharded between steps (ZeRO-2-like): the
            reconstruction is the unsharded parameter storage itself (otherwise it costs one extra unsharded copy
            of the model per rank).
        gradient_reduce: ``exact`` (FSDP2's reduce-scatter), ``bf16`` or ``fp8`` (block-scaled e4m3 payload,
            reduced in fp32; see ``forge_lightning.strategies.comm.fp8_reduce_scatter``).
        fp8_error_feedback: with ``gradient_reduce: fp8``, add each step's quantization error to the next step's
            gradient (an fp32 buffer the size of each unit's unsharded gradient).
        fp8_block: elements per fp32 scale in the FP8 collectives.
        expert_parallel_size: ranks over which each MoE layer's routed experts are spread (each holds
            ``num_experts / expert_parallel_size``; tokens reach them by all-to-all, see
            ``forge_lightning.distributed.expert_parallel``). The groups are consecutive ranks of the shard
            dimension (it must divide ``data_parallel_size / data_parallel_replicate_size``); the experts are
            FSDP-sharded over the rest of it, every other parameter over all of it. The plan must declare expert
            stacks (``Component.experts``); the held stacks are DTensors on the ``ep`` mesh, so checkpoints and
            exports hold every expert once. Not with TP, CP, gradient clipping or the compressed collectives.
        expert_parallel_overlap: overlap each half of a micro-batch's token dispatch / combine with the other half's
            expert compute and with the shared experts (asynchronous all-to-alls); ``False``: one synchronous
            exchange each way.
        checkpoint_writers: files each rank writes in parallel when saving a checkpoint.
        async_checkpoint: write checkpoints while training goes on: the step that saves only copies the shards
            to host memory; the save is completed (manifest, rename into place) at the next save or at the end
            (:class:`~forge_lightning.strategies.distributed_checkpoint.AsyncDistributedCheckpoint`).
        process_group_backend: ``nccl``, ``gloo``...; default from the device.
        timeout: collective timeout.
    """

    strategy_name = "fsdp2"
    # Performance after TP, before fully_shard (the module's configure_model leaves it to the strategy).
    traits = StrategyTraits(owns_checkpoint_io=True, applies_performance=True, shards_model=True)

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        data_parallel_replicate_size: int | Literal["auto"] = 1,
        *,
        context_parallel_size: int = 1,
        context_parallel_type: str = "ulysses",
        context_parallel_ulysses_size: int | None = None,
        sequence_parallel: bool = False,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        output_dtype: str | None = None,
        reshard_after_forward: bool | int = True,
        forward_prefetch: int = 0,
        backward_prefetch: int = 1,
        cpu_offload: bool = False,
        unsharded_components: list[str] | None = None,
        replicated_components: list[str] | None = None,
        param_all_gather: str = "exact",
        delta_resync_every: int = 0,
        delta_keep_unsharded: bool = False,
        gradient_reduce: str = "exact",
        fp8_error_feedback: bool = True,
        fp8_block: int = 256,
        expert_parallel_size: int = 1,
        expert_parallel_overlap: bool = True,
        checkpoint_writers: int = CHECKPOINT_WRITERS,
        async_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.context_parallel = (context_parallel_size, context_parallel_type, context_parallel_ulysses_size)
        self.sequence_parallel = sequence_parallel
        self.mp_dtypes = (
            _dtype(param_dtype, "param_dtype"),
            _dtype(reduce_dtype, "reduce_dtype"),
            _dtype(output_dtype, "output_dtype"),
        )
        self.reshard_after_forward = reshard_after_forward
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        self.cpu_offload = cpu_offload
        if checkpoint_writers < 1:
            raise ValueError(f"checkpoint_writers must be at least 1, got {checkpoint_writers}")
        self.checkpoint_writers = checkpoint_writers
        self._async = AsyncDistributedCheckpoint(checkpoint_writers) if async_checkpoint else None
        self.unsharded_components = list(unsharded_components or [])
        self.replicated_components = list(replicated_components or [])
        overlap = set(self.unsharded_components) & set(self.replicated_components)
        if overlap:
            raise ValueError(
                f"components {sorted(overlap)} are in both unsharded_components and replicated_components: "
                "unsharded means frozen and outside FSDP, replicated means trained with all-reduced gradients"
            )
        check_fsdp_comm_options(
            param_all_gather, gradient_reduce, delta_resync_every, fp8_block, delta_keep_unsharded
        )
        self.comm_options = {
            "param_all_gather": param_all_gather,
            "gradient_reduce": gradient_reduce,
            "fp8_error_feedback": fp8_error_feedback,
            "delta_resync_every": delta_resync_every,
            "delta_keep_unsharded": delta_keep_unsharded,
            "fp8_block": fp8_block,
        }
        if expert_parallel_size > 1 and (param_all_gather != "exact" or gradient_reduce != "exact"):
            raise ValueError(
                f"expert_parallel_size={expert_parallel_size} needs param_all_gather: exact and gradient_reduce: "
                f"exact (got {param_all_gather!r} / {gradient_reduce!r}): the compressed collectives do not handle "
                "the expert units' own mesh yet"
            )
        self.expert_parallel = (expert_parallel_size, expert_parallel_overlap)
        self._ep_mesh: Any = None
        self._expert_stacks: list[nn.Module] = []
        self._comm: FSDPCommHandles | None = None
        self._accumulate = 1
        self._dp_group: Any = None
        self._fp8_all_gather = False

    # ----- mesh and degrees -------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        self.set_world_ranks()  # the world size, to check the degrees before any process group is built
        tp = int(self._tensor_parallel_size)
        if self.data_parallel_replicate_size == "auto":
            self.data_parallel_replicate_size = self.num_nodes
        dims = FSDPDims(
            data_parallel_size=self._data_parallel_size,
            data_parallel_replicate_size=self.data_parallel_replicate_size,
            tensor_parallel_size=tp,
            context_parallel_size=self.context_parallel[0],
            context_parallel_type=self.context_parallel[1],
            context_parallel_ulysses_size=self.context_parallel[2],
            sequence_parallel=self.sequence_parallel,
            reshard_after_forward=self.reshard_after_forward,
            expert_parallel_size=self.expert_parallel[0],
        )
        dp = dims.validate(self.world_size)
        self._setup_distributed()
        self._data_parallel_size, self._tensor_parallel_size = dp, tp
        shard, cp = dp // self.data_parallel_replicate_size, self.context_parallel[0]
        from torch.distributed.device_mesh import init_device_mesh

        self._device_mesh = init_device_mesh(
            device_mesh_type(self.accelerator, self.root_device),
            (self.data_parallel_replicate_size, shard, cp, tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"),
        )
        dp_mesh = self._device_mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self._device_mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        self._dp_group = None if tp * cp == 1 else dp_mesh.get_group()
        ep = self.expert_parallel[0]
        if ep > 1:
            self._ep_mesh = ep_par.expert_mesh(self._device_mesh, ep)
        rank_zero_info(
            f"{type(self).__name__}: mesh dp_replicate={self.data_parallel_replicate_size} x dp_shard={shard} x "
            f"cp={cp} ({self.context_parallel[1]}) x tp={tp} over {self.world_size} processes"
            + (f"; experts: ep_shard={shard // ep} x ep={ep}" if ep > 1 else "")
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def _get_process_group_backend(self) -> str:
        """The configured backend, else the accelerator's (:class:`~forge_lightning.contracts.DistributedDevices`),
        else Lightning's default for the device."""
        return self._process_group_backend or process_group_backend(self.accelerator, self.root_device)

    def _require_mesh(self, what: str) -> Any:
        if self._device_mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}.{what} is only known after the process group and device mesh are set up "
                "(Trainer.fit / validate / test set them up)"
            )
        return self._device_mesh

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel ranks (replicas × shards); ranks of one TP group share a data rank."""
        mesh = self._require_mesh("data_parallel_size")
        return mesh["dp_replicate"].size() * mesh["dp_shard"].size()

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel index, in ``[0, data_parallel_size)``."""
        mesh = self._require_mesh("data_parallel_rank")
        return (
            mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size()
            + mesh["dp_shard"].get_local_rank()
        )

    @property
    def tensor_parallel_size(self) -> int:
        """Number of tensor-parallel ranks."""
        return self._require_mesh("tensor_parallel_size")["tp"].size()

    @property
    def expert_parallel_size(self) -> int:
        """Ranks of each expert-parallel group (1: no expert parallelism)."""
        self._require_mesh("expert_parallel_size")
        return 1 if self._ep_mesh is None else self._ep_mesh["ep"].size()

    @property
    def context_parallel_size(self) -> int:
        """Number of context-parallel ranks (sharing each sample's token sequence)."""
        return self._require_mesh("context_parallel_size")["cp"].size()

    def context_parallel_groups(self) -> ContextParallel:
        """This rank's context-parallel group and algorithm (see :func:`context_parallel_of`). Collective when
        ``hybrid``."""
        _, kind, ulysses = self.context_parallel
        return context_parallel_of(self._require_mesh("context_parallel_groups"), kind, ulysses)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor | Any:
        """Reduce over the data-parallel ranks only (TP ranks of one data rank hold the same values)."""
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group if group is not None else self._dp_group, reduce_op)
        return tensor

    # ----- applying the plan ------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from lightning.fabric.utilities.optimizer import _optimizers_to_device
        from lightning.pytorch.trainer.states import TrainerFn

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.check_plan(_plan_of(self.model))  # before the weights are built
        _check_context_parallel(self.model, self.context_parallel[0])
        materialize_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._accumulate = trainer.accumulate_grad_batches
        if self.expert_parallel[0] > 1 and trainer.gradient_clip_val:
            raise ValueError(
                f"gradient_clip_val ({trainer.gradient_clip_val}) is not supported with expert_parallel_size="
                f"{self.expert_parallel[0]} yet: the gradient norm would miss the experts held by the other "
                "expert-parallel ranks; set trainer.gradient_clip_val: null"
            )
        self.parallelize(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self._comm is not None and self._comm.all_gather is not None:
                optimizer = self.optimizers[-1]
                self._comm.all_gather.attach(getattr(optimizer, "optimizer", optimizer))
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def check_plan(self, plan: ParallelPlan) -> None:
        """Check the module's plan against this strategy's options and tensor-parallel degree (after
        ``setup_environment``), before anything is built or sharded.

        Args:
            plan: the module's parallel plan.

        Raises:
            ValueError: a component named in ``unsharded_components`` / ``replicated_components`` that the plan
                lacks (or a trainable one left unsharded), or a tensor-parallel degree the plan's sizes refuse
                (see :func:`~forge_lightning.strategies.parallelize.check_tensor_parallel_plan`).
        """
        unsharded = par.check_unsharded(plan, self.unsharded_components)
        replicated = par.check_components(plan, self.replicated_components)
        par.check_tensor_parallel_plan(
            plan,
            int(self._tensor_parallel_size),
            skip=[c.name for c in unsharded] + replicated,
        )
        ep_par.check_expert_parallel(plan, self.expert_parallel[0], [c.name for c in unsharded] + replicated)

    def parallelize(self, module: nn.Module) -> None:
        """Apply TP, the module's performance settings and FSDP to ``module`` from its parallel plan."""
        plan = _plan_of(module)
        self.check_plan(plan)
        unsharded = [plan.component(name) for name in self.unsharded_components]
        replicated = [plan.component(name) for name in self.replicated_components]
        mesh = self.device_mesh
        if mesh["tp"].size() > 1:
            skip = [c.name for c in unsharded + replicated]
            par.apply_tensor_parallel(plan, mesh["tp"], sequence_parallel=self.sequence_parallel, skip=skip)
        if mesh["cp"].size() > 1:
            _check_context_parallel(module, mesh["cp"].size())
            module.enable_context_parallel(self.context_parallel_groups())
            rank_zero_info(f"context parallelism: {self.context_parallel[1]} over {mesh['cp'].size()} ranks")
        if self._ep_mesh is not None:
            ep_mesh = self._ep_mesh["ep"]
            ep = ExpertParallel(ep_mesh.get_group(), overlap=self.expert_parallel[1], mesh=ep_mesh)
            skip = [c.name for c in unsharded + replicated]
            self._expert_stacks = ep_par.apply_expert_parallel(plan, ep, skip)
        perf = module.performance if isinstance(module, TunedModule) else PerformanceConfig()
        self._fp8_all_gather = perf.fp8 is not None and perf.fp8.fsdp_all_gather
        applied = apply_performance(plan, perf, self.root_device) | {"fp8.fsdp_all_gather"}
        check_applied(perf, applied | module_switches(module), type(self).__name__)
        mark_applied(module)
        self._apply_fully_shard(module, plan, unsharded, replicated)

    def _fsdp_kwargs(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        param, reduce, output = self.mp_dtypes
        mesh = self.device_mesh
        shard = "dp_shard_cp" if mesh["cp"].size() > 1 else "dp_shard"
        dp_mesh = mesh["dp_replicate", shard] if mesh["dp_replicate"].size() > 1 else mesh[shard]
        offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.cpu_offload else None
        return {
            "mesh": dp_mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output),
            "offload_policy": offload or OffloadPolicy(),
        }

    def _replicate_mesh(self) -> Any:
        """``replicate x 1`` mesh over this rank's data-parallel peers (FSDP2 then all-reduces gradients)."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks_RSCT = self.device_mesh.mesh
        tp = ranks_RSCT.shape[3]
        ranks_TD1 = ranks_RSCT.permute(3, 0, 1, 2).reshape(tp, -1, 1)
        names = ("replicate_tp", "replicate", "replicate_shard")
        return DeviceMesh(
            device_mesh_type(self.accelerator, self.root_device), ranks_TD1, mesh_dim_names=names
        )["replicate", "replicate_shard"]

    def _apply_fully_shard(
        self, module: nn.Module, plan: ParallelPlan, unsharded: list, replicated: list
    ) -> None:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        kwargs = self._fsdp_kwargs()
        ignored = par.parameters_of(unsharded)
        if replicated:
            replicate_kwargs = {**kwargs, "mesh": self._replicate_mesh()}
            for comp in replicated:
                fully_shard(comp.module, reshard_after_forward=False, **replicate_kwargs)
        if self._expert_stacks:
            ep_kwargs = {**kwargs, "mesh": ep_par.expert_fsdp_mesh(self._ep_mesh)}
            ep_par.shard_experts(
                self._expert_stacks,
                ep_kwargs,
                self.data_parallel_size,
                force_sum=self.root_device.type != "cuda",
                reshard=self.reshard_after_forward is not False,
            )
        skip = {c.name for c in unsharded + replicated}
        sharded_blocks: list[nn.Module] = []
        for comp in plan:
            if comp.name in skip:
                continue
            for block in comp.blocks:
                fully_shard(block, reshard_after_forward=self.reshard_after_forward, **kwargs)
                sharded_blocks.append(block)
        _set_prefetch(sharded_blocks, self.forward_prefetch, self.backward_prefetch)
        # The root keeps its parameters gathered from forward to backward: it is needed first in backward.
        fully_shard(module, reshard_after_forward=False, ignored_params=ignored or None, **kwargs)
        for name in _FORWARD_METHODS:
            if callable(getattr(module, name, None)):
                register_fsdp_forward_method(module, name)
        self._apply_comm_options(module)
        param, reduce, _ = self.mp_dtypes
        rank_zero_info(
            f"fully_shard: {len(sharded_blocks)} blocks + root over {kwargs['mesh'].size()} ranks "
            f"({'HSDP' if kwargs['mesh'].ndim == 2 else 'FSDP'}); params {param or 'as stored'}, reduce "
            f"{reduce or param or 'as stored'}; reshard_after_forward={self.reshard_after_forward}; cpu_offload="
            f"{self.cpu_offload}; unsharded components {[c.name for c in unsharded]}; replicated components "
            f"{[c.name for c in replicated]}"
        )

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._fp8_all_gather:
            # torchao's FP8 all-gather needs each weight's amax / scale once per step, computed for all weights
            # in one batched pass after the update (else every all-gather computes its own).
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.lightning_module)
        return output

    def _apply_comm_options(self, module: nn.Module) -> None:
        options = dict(self.comm_options)
        if options["param_all_gather"] == "exact" and options["gradient_reduce"] == "exact":
            return
        if self._device_mesh["dp_shard"].size() == 1:
            rank_zero_warn(
                f"{type(self).__name__}: param_all_gather={options['param_all_gather']!r} / gradient_reduce="
                f"{options['gradient_reduce']!r} have no effect with a shard size of 1 (data_parallel_replicate_size "
                "equals data_parallel_size): FSDP2 then runs no all-gather or reduce-scatter to compress, and the "
                "all-reduce across replicas stays exact"
            )
            return
        if not options["delta_keep_unsharded"]:
            # Resharded, the delta all-gather runs once per micro-batch forward: count re-syncs in steps.
            options["delta_resync_every"] *= self._accumulate
        self._comm = apply_fsdp_comm_options(module, **options)
        rank_zero_info(
            f"FSDP2 collectives: parameter all-gather {options['param_all_gather']}, gradient reduce-scatter "
            f"{options['gradient_reduce']} (error feedback {'on' if options['fp8_error_feedback'] else 'off'})"
        )

    # ----- checkpoints ------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes its own checkpoints and takes no storage_options")
        path = Path(self.broadcast(str(filepath)))
        if self._async is not None:
            self._async.save(checkpoint, path, self.barrier, is_global_zero=self.is_global_zero)
            return
        save_distributed_checkpoint(
            checkpoint,
            path,
            self.barrier,
            is_global_zero=self.is_global_zero,
            writers=self.checkpoint_writers,
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint; with ``async_checkpoint``, once the save in flight is complete."""
        remove = super().remove_checkpoint
        if self._async is None:
            remove(filepath)
        else:
            self._async.remove_after_save(lambda: remove(filepath))

    @override
    def teardown(self) -> None:
        """Complete the asynchronous save in flight (after an error: only wait for this rank's writes), then
        Lightning's teardown."""
        if self._async is not None:
            module = self.lightning_module
            trainer = module.trainer if module is not None and module._trainer is not None else None
            if trainer is not None and not trainer.interrupted:
                self._async.wait(self.barrier, is_global_zero=self.is_global_zero)
            else:
                self._async.abandon()
            self._async.close()
        super().teardown()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict where its shards are: DCP copies them to host memory as it writes
        (Lightning's first copies the whole of it: 4 s for a 1B model's fp32 weights on one H200)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's sharded state dict where its shards are (Lightning's first copies it to host memory:
        10 s for a 1B model's Adam state on one H200)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(cpu_offload=False))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._async is not None:
            self._async.wait(self.barrier, is_global_zero=self.is_global_zero)
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        # Lightning restores after setup and on_fit_start here, so callbacks hold their sharded state (the
        # templates of their DTensors in the checkpoint).
        callbacks = self.lightning_module.trainer.callbacks
        checkpoint = load_distributed_checkpoint(path, self.model, self.optimizers, callbacks)
        self.parameters_changed()
        return checkpoint

    def parameters_changed(self) -> None:
        """Make the next parameter all-gathers exact after the shards were written outside the optimizer (a
        checkpoint load, the EMA callback's swap): the delta-FP8 all-gather would send the change as an FP8 delta,
        with an error of up to 1/16 of it. Collective: call on every rank."""
        if self._comm is not None and self._comm.all_gather is not None:
            self._comm.all_gather.request_resync()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    def full_model_state_dict(self, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict of ``module`` on CPU, on global rank 0 (empty elsewhere).

        Parameters are gathered one at a time and moved to host memory, so no rank ever holds the whole model on
        its accelerator. Collective: call it on every rank.
        """
        assert self.model is not None
        return full_model_state_dict(self.model, module)


def _plan_of(module: nn.Module) -> ParallelPlan:
    if not isinstance(module, PlannedModule):
        raise TypeError(
            f"{type(module).__name__} has no parallel_plan(): the native strategies apply parallelism from the "
            "module's ParallelPlan (see forge_lightning.contracts.PlannedModule)"
        )
    return module.parallel_plan()


def context_parallel_of(mesh: Any, kind: str, ulysses: int | None = None) -> ContextParallel:
    """The :class:`ContextParallel` of this rank on a ``dp_replicate x dp_shard x cp x tp`` device mesh: its ``cp``
    group (contiguous sequence chunks) and, for ``hybrid``, its Ulysses groups of ``ulysses`` consecutive cp ranks
    and rings across them (megatron's hierarchical layout: cp rank = ring rank x ``ulysses`` + Ulysses rank).
    Collective when ``hybrid``: every rank builds every sub-group.

    Args:
        mesh: the strategy's device mesh.
        kind: ``ulysses``, ``ring`` or ``hybrid`` (:data:`CONTEXT_PARALLEL_TYPES`).
        ulysses: the Ulysses group size of ``hybrid``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    comm = CONTEXT_PARALLEL_TYPES[kind]
    if kind != "hybrid":
        return ContextParallel(mesh["cp"].get_group(), comm_type=comm)
    R, S, C, T = mesh.mesh.shape
    ranks = mesh.mesh.reshape(R, S, C // ulysses, ulysses, T)
    names = ("hybrid_replicate", "hybrid_shard", "cp_ring", "cp_ulysses", "hybrid_tp")
    sub = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=names)
    return ContextParallel(
        mesh["cp"].get_group(),
        comm_type=comm,
        a2a_group=sub["cp_ulysses"].get_group(),
        p2p_group=sub["cp_ring"].get_group(),
    )


def _check_context_parallel(module: nn.Module, size: int) -> None:
    if size > 1 and not isinstance(module, ContextParallelModule):
        raise TypeError(
            f"context_parallel_size={size}, but {type(module).__name__} does not implement "
            "enable_context_parallel(cp) (forge_lightning.contracts.ContextParallelModule): it cannot split its "
            "token sequence over ranks; use context_parallel_size: 1"
        )


def _set_prefetch(blocks: list[nn.Module], forward: int, backward: int) -> None:
    """Explicit all-gather prefetching over the blocks in forward order (FSDP2's implicit order otherwise)."""
    if forward < 0 or backward < 0:
        raise ValueError(f"forward_prefetch ({forward}) and backward_prefetch ({backward}) must be >= 0")
    for i, block in enumerate(blocks):
        if forward > 0 and blocks[i + 1 : i + 1 + forward]:
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + forward])
        if backward > 1 and i > 0:
            block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - backward) : i])))

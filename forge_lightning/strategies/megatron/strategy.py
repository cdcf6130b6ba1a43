"""``MegatronStrategy``: megatron-core (TP / PP / VPP / SP / CP / EP, DDP, DistributedOptimizer) as a Lightning backend.

The LightningModule stays what it is under every strategy; this strategy asks it for its megatron-core model
through the contract (:class:`~forge_lightning.contracts.MegatronModule`: ``module.megatron_model(build)`` returns a
:class:`~forge_lightning.contracts.MegatronTwin`), which builds this rank's chunks with the module's weights (its TP
shard of its pipeline stage), and trains them. Nothing here knows a model family::

    Lightning loop, automatic optimisation, accumulate_grad_batches = N micro-batches per step
      training_step x N ──> the strategy buffers the micro-batches; on the N-th it runs megatron's schedule
                            (forward + backward of all N, pipelined; see schedule.py) with the twin's forward
                            step and loss function, then hands the step's sums to the twin (the module records
                            and logs them, as natively)
      backward            ──> nothing: the schedule did it (no double backward)
      optimizer_step      ──> the module's on_before_optimizer_step (logs train/loss), megatron optimizer.step()
                            (grad clipping, DistributedOptimizer all-gather)
      lr_scheduler.step() ──> the module's SchedulerConfig, as a LambdaLR on megatron's param groups

Checkpoints are megatron-core dist-checkpoints written through :class:`MegatronCheckpointIO` (checkpoint.py): model
chunks (and a composed model's encoder side, replicated) and optimizer sharded, Lightning's own state in a
``weights_only`` file beside them; they resume at any TP / PP / VPP / DP layout.

The one batch rule maps onto megatron's knobs: ``data.batch_size`` is megatron's micro-batch size,
``accumulate_grad_batches`` its number of micro-batches, and the global batch is their product times the
data-parallel size (world / (TP × PP × CP)). The ranks of a context-parallel group share one data rank's batch, each
with its share of every sequence.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.distributed import (
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from typing_extensions import override

from forge_lightning.contracts import (
    MegatronBuild,
    MegatronDims,
    MegatronModule,
    MegatronTwin,
    MoECommOverlap,
    ParallelPlan,
    StrategyTraits,
    TextData,
    TunedModule,
    process_group_backend,
)
from forge_lightning.performance import PerformanceConfig, apply_sdpa_backends, check_applied, resolve
from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO
from forge_lightning.strategies.materialize import materialize_module
from forge_lightning.strategies.megatron import callback_state
from forge_lightning.strategies.megatron import checkpoint as ckpt
from forge_lightning.strategies.megatron.checkpoint import MegatronCheckpointIO
from forge_lightning.strategies.megatron.components import (
    Components,
    parse_components,
    parse_placement,
)
from forge_lightning.strategies.megatron.optimizer import (
    build_megatron_optimizer,
    build_schedulers,
    chain_optimizers,
)
from forge_lightning.strategies.megatron.schedule import (
    check_interleaved_micro_batches,
    eval_micro_batches,
    run_schedule,
)
from forge_lightning.strategies.megatron.wrapping import chunk_config, connect_schedule, wrap_ddp

_PRECISIONS = {"32-true": False, "32": False, "bf16-mixed": True, "bf16-true": True}


class MegatronStrategy(ParallelStrategy):
    """megatron-core as a Lightning strategy, with megatron-core's option names.

    Registered as ``megatron``. Data parallelism is what the world has left: ``world / (TP × PP × CP)`` ranks.

    Args:
        tensor_model_parallel_size: TP ranks (keep within a node); must divide heads, key/value heads, vocab, the
            MLP widths and, unless ``expert_tensor_parallel_size`` is set, ``moe.intermediate_size``.
        pipeline_model_parallel_size: pipeline stages (1F1B schedule); PP x VPP must divide the layers.
        virtual_pipeline_model_parallel_size: model chunks per stage (interleaved 1F1B; ``accumulate_grad_batches``
            must be a multiple of PP); ``None``: one.
        sequence_parallel: with TP, shard norms / dropout / residual stream on the sequence; TP must divide each
            context-parallel rank's share of the sequence length.
        context_parallel_size: CP ranks sharing each sequence (megatron's load-balanced layout: ``2 × CP`` chunks,
            rank ``r`` holding ``r`` and ``2·CP − 1 − r``); ``2 × CP`` must divide the sequence length.
        cp_comm_type: context-parallel attention, megatron-core's names: ``a2a`` (Ulysses all-to-all; CP must divide
            the query heads per TP rank), ``p2p`` (ring attention; no head constraint) or ``a2a+p2p`` (Ulysses
            inside groups of ``hierarchical_context_parallel_sizes[0]`` ranks, ring across them).
        hierarchical_context_parallel_sizes: ``[a2a, p2p]`` group sizes of ``a2a+p2p`` (product: CP); megatron-core
            builds the groups (needs einops).
        expert_model_parallel_size: EP ranks splitting each MoE layer's routed experts (all-to-all token
            dispatch); EP × ETP must divide TP × DP × CP, EP must divide ``moe.num_experts``. 1 for dense models.
        expert_tensor_parallel_size: ETP ranks splitting each routed expert's width (``None``: TP, megatron-core's
            default); e.g. 1 with TP = 2 keeps experts whole and lays EP or expert data parallelism over the TP
            ranks. Must divide the experts' ``moe.intermediate_size``.
        use_distributed_optimizer: shard optimizer state and fp32 main weights over data-parallel ranks.
        overlap_grad_reduce: overlap the gradient reduce(-scatter) with backward (bucketed).
        overlap_param_gather: overlap the DistributedOptimizer's parameter all-gather with the next forward.
        dist_ckpt_optim_fully_reshardable: save the DistributedOptimizer's state in megatron-core's
            ``fully_reshardable`` form, which resumes at any TP / PP / VPP / CP / EP / DP layout, instead of
            ``dp_reshardable`` (each rank writes its own shards, no gather; resumes at another DP size only). The
            gather runs through host memory: about 30 s more per save for a 1B model on one H200.
        overlap_moe_expert_parallel_comm: overlap the expert-parallel all-to-all of one micro-batch with another's
            computation (megatron-core's combined 1F1B schedule); needs EP > 1, bf16, CUDA, no activation recompute,
            and with PP > 1 the interleaved schedule (``virtual_pipeline_model_parallel_size``).
        delay_wgrad_compute: with ``overlap_moe_expert_parallel_comm``, compute weight gradients after the data
            gradients so the all-to-all overlaps them too (needs TransformerEngine's linears).
        moe_shared_expert_overlap: run the shared experts beside the token dispatcher's all-to-all (CUDA streams;
            a model with shared experts; not with ``overlap_moe_expert_parallel_comm``). See
            :class:`~forge_lightning.contracts.MoECommOverlap` and docs/megatron.md.
        checkpoint_writers: files each rank writes in parallel (megatron-core's writer forks one process per file).
        use_transformer_engine: TE layer spec (``None``: when TE is importable).
        components: per-component settings, ``{name: {tensor_model_parallel_size, recompute, freeze}}`` for
            components of the module's ``parallel_plan()``; a composed model (encoder -> projector -> LLM) runs its
            decoder at this strategy's TP and the other components at TP = 1, data-parallel over the decoder's TP
            group (see components.py and docs/megatron.md).
        encoder_placement: with ``pipeline_model_parallel_size > 1``, where a composed model's encoder side runs,
            apart from the schedule: ``spread`` (``None``, the default: every stage holds a replica and encodes
            its share of the step's samples, the features gathered on the first stage) or ``first_stage`` (the
            first stage encodes them all while the later stages wait); see components.py.
        process_group_backend: ``nccl``, ``gloo``...; default from the device.
        timeout: collective timeout.
    """

    strategy_name = "megatron"
    # The CLI builds the module under `deferred_pretrained`: each rank reads its shards of model.init_args.pretrained.
    # The twin applies the performance switches it supports; the native model is never trained here.
    traits = StrategyTraits(
        owns_checkpoint_io=True, reads_pretrained_shards=True, applies_performance=True, shards_model=True
    )
    # Switches the strategy applies itself (``compile: false`` is honoured: nothing is compiled); the twin names
    # the others it applies.
    performance_switches = frozenset({"optimizer", "attention.sdpa", "compile"})

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        sequence_parallel: bool = False,
        context_parallel_size: int = 1,
        cp_comm_type: str = "a2a",
        hierarchical_context_parallel_sizes: list[int] | None = None,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
        use_distributed_optimizer: bool = False,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        dist_ckpt_optim_fully_reshardable: bool = False,
        overlap_moe_expert_parallel_comm: bool = False,
        delay_wgrad_compute: bool = False,
        moe_shared_expert_overlap: bool = False,
        checkpoint_writers: int = ckpt.CHECKPOINT_WRITERS,
        use_transformer_engine: bool | None = None,
        components: dict[str, dict[str, Any]] | None = None,
        encoder_placement: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__()
        self.dims = MegatronDims(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size,
            cp_comm_type=cp_comm_type,
            hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
            expert_model_parallel_size=expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            sequence_parallel=sequence_parallel,
            use_distributed_optimizer=use_distributed_optimizer,
            overlap_param_gather=overlap_param_gather,
        )
        self.overlap_grad_reduce = overlap_grad_reduce
        self.moe_overlap = MoECommOverlap(
            overlap_moe_expert_parallel_comm=overlap_moe_expert_parallel_comm,
            delay_wgrad_compute=delay_wgrad_compute,
            moe_shared_expert_overlap=moe_shared_expert_overlap,
        )
        self.optimizer_sharding = (
            ckpt.FULLY_RESHARDABLE if dist_ckpt_optim_fully_reshardable else ckpt.DP_RESHARDABLE
        )
        self.checkpoint_writers = checkpoint_writers
        self.use_transformer_engine = use_transformer_engine
        self.components = components
        self.encoder_placement = encoder_placement
        self._components: Components | None = None
        self._twin: MegatronTwin | None = None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._parallel_ready = False
        self._chunks: list[nn.Module] = []
        self._pending: list[dict[str, torch.Tensor]] = []
        self._skip_step = False
        self._biases_before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._bf16 = False

    # ----- processes and parallel groups ------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        # The degrees against the world size, before any process group is built (against the model in setup).
        dims = self.dims
        dp = dims.validate(self.world_size)
        self.moe_overlap.check(dims, device=self.root_device)
        parse_components(self.components, dims.tp)  # names are checked in setup
        parse_placement(self.encoder_placement, dims.pp)
        backend = self._process_group_backend or process_group_backend(self.accelerator, self.root_device)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        try:
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        except ImportError as err:
            raise ImportError(
                "MegatronStrategy needs megatron-core: pip install 'forge-lightning[megatron]'"
            ) from err

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            virtual_pipeline_model_parallel_size=dims.virtual_pipeline_model_parallel_size,
            context_parallel_size=dims.cp,
            expert_model_parallel_size=dims.ep,
            expert_tensor_parallel_size=dims.expert_tensor_parallel_size,
            hierarchical_context_parallel_sizes=(
                None
                if dims.hierarchical_context_parallel_sizes is None
                else list(dims.hierarchical_context_parallel_sizes)
            ),
        )
        model_parallel_cuda_manual_seed(torch.initial_seed() % 2**31)
        self._parallel_ready = True
        rank_zero_info(
            f"{type(self).__name__}: TP={dims.tp} x PP={dims.pp} (VPP={dims.vpp}) x CP={dims.cp} x DP={dp} (EP="
            f"{dims.ep}, ETP={dims.etp}) over {self.world_size} processes; cp_comm_type={dims.cp_comm_type}, "
            f"sequence_parallel={dims.sequence_parallel}, distributed optimizer={dims.use_distributed_optimizer}"
        )

    def _require_parallel(self, what: str) -> Any:
        if not self._parallel_ready:
            raise RuntimeError(
                f"{type(self).__name__}.{what} is only known after megatron's parallel groups are set up "
                "(Trainer.fit / validate / test set them up)"
            )
        from megatron.core import parallel_state

        return parallel_state

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel ranks (world / (TP × PP × CP)); the ranks of one model replica and of one
        context-parallel group share a data rank."""
        return self._require_parallel("data_parallel_size").get_data_parallel_world_size()

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel index, in ``[0, data_parallel_size)``."""
        return self._require_parallel("data_parallel_rank").get_data_parallel_rank()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def is_distributed(self) -> bool:
        """Lightning reads this to give plain data loaders a ``DistributedSampler`` over the data-parallel ranks."""
        return True

    @override
    def barrier(self, name: str | None = None) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not torch.distributed.is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor | Any:
        """Reduce over the data- and context-parallel ranks (the TP / PP ranks of one model replica hold the same
        values; context-parallel ranks hold different tokens of the same batch, like data-parallel ones)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        dp_cp_group = self._require_parallel("reduce").get_data_parallel_group(with_context_parallel=True)
        return _sync_ddp_if_available(tensor, group if group is not None else dp_cp_group, reduce_op)

    # ----- building the twin ------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not isinstance(module, MegatronModule):
            raise TypeError(
                f"MegatronStrategy trains a module's megatron-core model: {type(module).__name__} provides none "
                "(implement megatron_model(build) -> MegatronTwin, see forge_lightning.contracts.MegatronModule), "
                "or train it with FSDP2Strategy / DDPStrategy"
            )
        perf = module.performance if isinstance(module, TunedModule) else None
        _refuse_performance(perf)
        self._bf16 = _bf16(trainer.precision)
        if perf is not None:  # process-wide, read by any twin's SDPA attention
            apply_sdpa_backends(resolve(perf, self.root_device).sdpa)
        dims = self.dims
        parts = self._components = Components(
            module,
            parse_components(self.components, dims.tp),
            dims,
            bf16=self._bf16,
            placement=parse_placement(self.encoder_placement, dims.pp),
        )
        checkpointing = perf.activation_checkpointing if perf is not None else "none"
        recompute = "none" if {checkpointing, parts.decoder_recompute()} == {"none"} else "full"
        self.moe_overlap.check(dims, bf16=self._bf16, recompute=recompute)
        datamodule = trainer.datamodule
        # A composed model's decoder input is longer than the data's sequences: its twin checks each batch.
        seq_length = (
            datamodule.seq_length if isinstance(datamodule, TextData) and not parts.composed else None
        )
        check_model_layout(
            module.parallel_plan(), dims, decoder=parts.decoder.component.name, seq_length=seq_length
        )
        build = MegatronBuild(
            dims=dims,
            device=self.root_device,
            bf16=self._bf16,
            use_transformer_engine=self.use_transformer_engine,
            recompute=parts.decoder_recompute(),
            performance=perf,
            composition=parts.composition,
            encode=parts.encode if parts.composed else None,
            moe_overlap=self.moe_overlap,
        )
        self._twin = module.megatron_model(build)
        check_applied(perf, self.performance_switches | self._twin.performance_switches, type(self).__name__)
        self._chunks = self._twin.build_chunks()
        for chunk in self._chunks:
            if not getattr(chunk_config(chunk), "calculate_per_token_loss", False):
                raise ValueError(
                    f"{type(self._twin).__name__}'s chunks need a TransformerConfig with calculate_per_token_loss=True: "
                    "megatron's schedule then divides the step's gradients by its count (the one batch rule)"
                )
        parts.prepare_decoder(self._chunks)
        self._chunks = wrap_ddp(self._chunks, dims, overlap_grad_reduce=self.overlap_grad_reduce)
        parts.wrap_encoders(self._chunks, device=self.root_device)
        if trainer.state.fn == TrainerFn.FITTING:
            check_interleaved_micro_batches(
                dims.pp, dims.virtual_pipeline_model_parallel_size, trainer.accumulate_grad_batches
            )
            self.setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        pass  # the twin is built on the device; the module's own copy of the weights stays where it is

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        clip = trainer.gradient_clip_val or 0.0
        if clip and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise NotImplementedError(
                f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} is not supported by "
                "MegatronStrategy; megatron clips by the global norm ('norm')"
            )
        options = dict(
            clip_grad=float(clip),
            bf16=_bf16(trainer.precision),
            implementation=module.performance.optimizer if isinstance(module, TunedModule) else "auto",
        )
        encoders = self._components.encoder_ddp
        dims = self.dims
        if encoders and dims.use_distributed_optimizer:
            # A composed model's encoder side reduces its gradients over TP x DP (every rank holds a replica), not
            # over the DP group the distributed optimizer shards by: it gets its own plain optimizer, chained with
            # the twin's (one global gradient norm, one step).
            optimizer = chain_optimizers(
                build_megatron_optimizer(
                    self._chunks,
                    module.optimizer_config,
                    use_distributed_optimizer=True,
                    overlap_param_gather=dims.overlap_param_gather,
                    **options,
                ),
                build_megatron_optimizer(
                    encoders,
                    module.optimizer_config,
                    use_distributed_optimizer=False,
                    overlap_param_gather=False,
                    **options,
                ),
            )
        else:
            # A composed model's encoder side (components.py) is optimised with the twin.
            optimizer = build_megatron_optimizer(
                self._chunks + encoders,
                module.optimizer_config,
                use_distributed_optimizer=dims.use_distributed_optimizer,
                overlap_param_gather=dims.overlap_param_gather,
                **options,
            )
        connect_schedule(self._chunks, optimizer, dims, self.overlap_grad_reduce)
        self._components.connect(self._chunks)
        total = module.scheduler_config.total_steps or int(trainer.estimated_stepping_batches)
        schedulers = build_schedulers(optimizer, module.scheduler_config, total)
        self.optimizers = [optimizer]
        self.lr_scheduler_configs = [LRSchedulerConfig(s, interval="step") for s in schedulers]

    # ----- training ---------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Buffer the micro-batch; on the last one of the optimizer step, run megatron's schedule over all of them
        with the twin's forward step, and hand the step's sums to the twin (the module records and logs them)."""
        self._pending.append(args[0])
        trainer = self.lightning_module.trainer
        if len(self._pending) < trainer.accumulate_grad_batches:
            return torch.zeros((), device=self.root_device)
        batches, self._pending = self._pending, []
        for chunk in self._chunks:
            chunk.zero_grad_buffer()
        self._components.zero_grad_buffers()
        self.optimizers[0].zero_grad()
        # megatron-core moves the routers' selection bias (auxiliary-loss-free balancing) inside the schedule, before
        # the optimizer step: kept, so that a step left out (skip_optimizer_step) leaves the bias out too.
        self._biases_before = [(bias, bias.clone()) for bias in self._selection_biases()]
        batches = self._components.encode_ahead(batches)  # with PP: the encoder side apart from the pipeline
        sums = run_schedule(self._chunks, batches, forward_only=False, twin=self._twin)
        self._components.backward_ahead()
        self._twin.after_schedule(self._chunks, sums, training=True, num_micro_batches=len(batches))
        return (sums[0] / sums[1].clamp_min(1)).float()  # this data rank's mean, for Lightning's outputs

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # megatron's schedule ran backward inside training_step

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        closure()  # the step's last training_step: the schedule (forward + backward of every micro-batch)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        trainer = self.lightning_module.trainer
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        if (
            self._skip_step
        ):  # a callback left the step unapplied (NonFiniteGuard); the next one zeroes the grads
            self._skip_step = False
            return False
        success, grad_norm, _ = optimizer.step()
        if grad_norm is not None:
            self.lightning_module.log("train/grad_norm", float(grad_norm), rank_zero_only=True)
        return success

    def nonfinite_gradients(self, optimizer: Any) -> torch.Tensor:
        """This rank's gradient buffers (megatron-core's DDP: the twin's chunks, a composed model's encoder side) that
        hold NaN / inf (:class:`~forge_lightning.contracts.GradientGate`)."""
        buffers = [
            buffer.grad_data
            for ddp in [*self._chunks, *self._components.encoder_ddp]
            for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]
        ]
        flags = [~torch.isfinite(grads).all() for grads in buffers if grads.numel()]
        return torch.stack(flags).sum().float() if flags else torch.zeros((), device=self.root_device)

    def skip_optimizer_step(self, optimizer: Any) -> None:
        """Leave the coming megatron optimizer step out (:class:`~forge_lightning.contracts.GradientGate`), and the
        step's move of the routers' selection bias with it."""
        self._skip_step = True
        with torch.no_grad():
            for bias, before in self._biases_before:
                bias.copy_(before)

    def _selection_biases(self) -> list[torch.Tensor]:
        """The MoE routers' selection biases (``expert_bias`` buffers) of this rank's chunks."""
        return [
            buffer
            for chunk in self._chunks
            for name, buffer in chunk.named_buffers()
            if name.endswith("expert_bias")
        ]

    # ----- evaluation -------------------------------------------------------------------------------------------
    def _eval_step(self, batch: dict[str, torch.Tensor]) -> None:
        """Forward of one evaluation batch through the schedule; the twin hands its sums to the module, which logs
        them at the end of the epoch (as natively)."""
        for chunk in self._chunks:
            chunk.eval()
        # The interleaved schedule runs micro-batches in groups of PP: split (or pad) the batch into PP of them.
        groups = self.dims.pp if len(self._chunks) > 1 else 1
        batches = eval_micro_batches(batch, groups, twin=self._twin)
        with torch.no_grad():
            batches = self._components.encode_ahead(batches)
            sums = run_schedule(self._chunks, batches, forward_only=True, twin=self._twin)
        self._twin.after_schedule(self._chunks, sums, training=False, num_micro_batches=len(batches))
        for chunk in self._chunks:
            chunk.train()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> None:
        self._eval_step(args[0])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> None:
        self._eval_step(args[0])

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "predict is not yet supported by MegatronStrategy: export the weights (full_model_state_dict or "
            "forge-convert megatron-to-hf) and predict under the default strategy"
        )

    # ----- export and teardown ----------------------------------------------------------------------------------
    def full_model_state_dict(self, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The trained weights as a full state dict on global rank 0 (CPU; empty elsewhere). Collective: call it on
        every rank.

        Under the LightningModule's own ``state_dict()`` names (the twin's component under its prefix, e.g.
        ``model.model.embed_tokens.weight``; a composed model's encoder side as it is), or with ``module`` a
        submodule's, relative to it (as the native strategies' ``full_model_state_dict``).
        """
        self.complete_parameter_gather()
        return self._components.full_state_dict(self._twin.state_dict(self._chunks), module)

    # ----- checkpoints (see checkpoint.py) ----------------------------------------------------------------------
    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = MegatronCheckpointIO(writers_per_rank=self.checkpoint_writers)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if isinstance(io, AtomicCheckpointIO) and not isinstance(io, MegatronCheckpointIO):
            # forge's CLI adds its single-file default when the strategy is given by its short name.
            rank_zero_info(f"{type(self).__name__}: writes dist-checkpoints with MegatronCheckpointIO")
            return
        if io is not None and not isinstance(io, MegatronCheckpointIO):
            raise TypeError(
                f"MegatronStrategy writes megatron-core dist-checkpoints through MegatronCheckpointIO, not "
                f"{type(io).__name__}: drop the checkpoint I/O plugin from the trainer"
            )
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint loads into the megatron chunks and optimizer, which setup builds

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored it from the dist-checkpoint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the trained weights are the chunks' (saved sharded); the module's own copy is stale

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # saved sharded with the model

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write a megatron-core dist-checkpoint directory at ``filepath`` (collective; atomic)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes its own checkpoints and takes no storage_options")
        path = self.broadcast(str(filepath))
        self.complete_parameter_gather()  # the model weights are saved as well as the optimizer's fp32 copies
        with_optimizer = "optimizer_states" in checkpoint  # absent in ModelCheckpoint(save_weights_only=True)
        optimizer = self.optimizers[0] if with_optimizer and self.optimizers else None
        checkpoint = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
        parts = self._components
        encoders = parts.encoder_modules()
        sharded = ckpt.sharded_state_dict(
            self._chunks,
            optimizer,
            is_loading=False,
            components=encoders,
            optimizer_sharding=self.optimizer_sharding,
        )
        if checkpoint.get("callbacks"):  # their per-parameter state (EMA's average) is saved sharded, too
            shards = callback_state.parameter_shards(self._chunks, encoders)
            checkpoint["callbacks"], taken = callback_state.take_callback_state(
                checkpoint["callbacks"], shards
            )
            if taken:
                sharded[ckpt.CALLBACKS_KEY] = taken
        checkpoint[ckpt.SHARDED_KEY] = sharded
        checkpoint[ckpt.HF_CONFIG_KEY] = self._twin.hf_config()  # a composed model's: its decoder's
        checkpoint[ckpt.INFO_KEY] = {
            "layout": {**self.dims.as_dict(), "data_parallel_size": self.data_parallel_size},
            "world_size": self.world_size,
            "optimizer": self._optimizer_kind() if optimizer is not None else None,
            "optimizer_sharding": self.optimizer_sharding,
            "frozen": parts.frozen(),
        }
        self.checkpoint_io.save_checkpoint(checkpoint, path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any layout into this rank's chunks (and optimizer, when fitting). Collective."""
        parts = self._components
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():
            self.checkpoint_io.verify(path)  # before any file of it is read
        meta = ckpt.check_is_checkpoint(path)
        ckpt.check_model_config(path, self._twin)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self.optimizers[0] if fitting and self.optimizers else None
        if optimizer is not None:
            ckpt.check_optimizer_kind(path, meta, self._optimizer_kind())
            ckpt.check_expert_layout(path, meta, self.dims.as_dict())
            ckpt.check_optimizer_layout(path, meta, self.dims.as_dict())
            ckpt.check_frozen(path, meta, parts.frozen())
        encoders = parts.encoder_modules()
        template = ckpt.sharded_state_dict(
            self._chunks,
            optimizer,
            is_loading=True,
            components=encoders,
            optimizer_sharding=ckpt.optimizer_sharding(meta),
        )
        # Callbacks' per-parameter state (EMA's average) loads into what the live callbacks hold now: Lightning
        # restores after setup and on_fit_start here, so they have built it, named and shaped like this run's.
        live = {cb.state_key: cb.state_dict() for cb in self.lightning_module.trainer.callbacks}
        shards = callback_state.parameter_shards(self._chunks, encoders)
        wanted, unmatched = callback_state.callback_templates(meta.get("callbacks") or {}, live, shards)
        if wanted:
            template[ckpt.CALLBACKS_KEY] = wanted
        if unmatched:
            rank_zero_warn(
                f"{type(self).__name__}: the callback state {unmatched[:3]} in {path} was not loaded: no callback "
                "holds per-parameter state at that place now. Callbacks with such state (EMA) build it when fit "
                "starts, so only `fit(ckpt_path=...)` restores it"
            )
        checkpoint = self.checkpoint_io.load_checkpoint(path, sharded_state_dict=template)
        loaded = checkpoint.pop(ckpt.SHARDED_KEY)
        ckpt.load_into(self._chunks, optimizer, loaded, components=encoders)
        callback_state.put_callback_state(
            checkpoint.get("callbacks") or {}, loaded.get(ckpt.CALLBACKS_KEY) or {}
        )
        rank_zero_info(f"{type(self).__name__}: loaded {path} ({ckpt.describe_layout(checkpoint)})")
        checkpoint[ckpt.SHARDED_KEY] = {}
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded into the chunks by load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded by load_checkpoint

    def _optimizer_kind(self) -> dict[str, bool]:
        kind = {"distributed": self.dims.use_distributed_optimizer, "bf16": self._bf16}
        if self.lightning_module.optimizer_config.name == "muon":
            kind["muon"] = (
                True  # momentum buffers, not Adam's moments; other runs' checkpoints keep their kind
            )
        return kind

    def trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's trained parameters (:class:`~forge_lightning.contracts.TrainedParameters`): its shards of the
        twin's chunks (and a composed model's trainable encoder side), named by their place in the checkpoint
        (``model<i>.<name>`` of chunk ``i``, ``components.<component>.<name>``).

        They are the model parameters, in the run's dtype: in bf16 runs the bf16 weights the forward reads, which
        megatron's optimizer sets from its fp32 main copies after every step, not those copies (the distributed
        optimizer holds them as flat slices over the data-parallel ranks, and an in-place write to them would
        change the training). Writing into them (EMA's evaluation swap) leaves the fp32 main copies as they are;
        in fp32 runs under the distributed optimizer the parameters are the main copies' storage, so a writer
        restores what it wrote over.

        With ``overlap_param_gather`` the all-gather that the next forward would wait on is completed first
        (collective over the data-parallel group: every rank calls it), so they hold the newest weights; a reader
        between later steps calls :meth:`complete_parameter_gather` again.

        Raises:
            RuntimeError: before setup.
        """
        if not self._chunks:
            raise RuntimeError(
                f"{type(self).__name__}.trained_parameters is only known once setup has built the twin's chunks "
                "(from on_fit_start on)"
            )
        self.complete_parameter_gather()
        return callback_state.trained_parameters(self._chunks, self._components.encoder_modules())

    def complete_parameter_gather(self) -> None:
        """With ``overlap_param_gather``, finish the deferred all-gather of the updated parameters (each
        data-parallel rank updated only its slice of each; the next forward would gather the rest), so every rank's
        parameters hold the weights of the last optimizer step (:class:`~forge_lightning.contracts.LazyParameterGather`;
        collective over the data-parallel group). The next forward then finds the gather done and skips it."""
        if self.dims.overlap_param_gather:
            for chunk in self._chunks:
                chunk.start_param_sync(force_sync=True)

    @contextmanager
    def module_weights(self) -> Iterator[None]:
        """Within it, the LightningModule's own parameters hold the twin's trained weights, whole, on this rank's
        device (gathered to rank 0, broadcast to every rank); afterwards they stay in the module, on the CPU.
        Collective. For callbacks that run the module itself (generation); one full copy of the model per rank."""
        module = self.lightning_module
        self._copy_into_module(self.root_device)
        try:
            yield
        finally:
            module.cpu()

    def _copy_into_module(self, device: torch.device | None) -> None:
        """Copy the twin's trained weights into the LightningModule's parameters (collective): moved to ``device``
        first, or where they are (``None``). Tensors travel one at a time, broadcast from global rank 0 on this
        rank's device."""
        module = self.lightning_module
        if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            materialize_module(module, device or self.root_device)  # deferred pretrained weights: none yet
        if device is not None:
            module.to(device)
        state = self.full_model_state_dict()
        names = self.broadcast(list(state), src=0)
        own = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name in names:
                target = own[name]
                if self.world_size > 1:
                    tensor = state[name] if name in state else torch.empty_like(target, device="cpu")
                    tensor = tensor.to(self.root_device, target.dtype)
                    torch.distributed.broadcast(tensor, src=0)
                else:
                    tensor = state[name]
                target.copy_(tensor)

    @override
    def teardown(self) -> None:
        """Copy the trained weights into the LightningModule (when it holds materialised weights), then release the
        twin, its optimizer and megatron's parallel state.

        Lightning's own teardown would first copy the optimizer state to host memory (minutes at scale, for a state
        nobody reads again: it is in the checkpoints); it is dropped instead. A module built under
        ``deferred_pretrained`` (on the meta device) keeps no weights: they are in the checkpoints and exports.
        """
        module = self.lightning_module
        trainer = module.trainer if module is not None and module._trainer is not None else None
        # Not after an error: the copy is collective, and the other ranks may be elsewhere.
        fitted = (
            trainer is not None
            and self._twin is not None
            and trainer.state.fn == TrainerFn.FITTING
            and not trainer.interrupted
        )
        meta = module is not None and any(p.is_meta for p in module.parameters())
        if fitted and not meta:
            self._copy_into_module(None)  # where the module's weights are (the CPU: the twin trained instead)
        self.optimizers, self.lr_scheduler_configs = [], []
        self._chunks, self._twin, self._pending = [], None, []
        if self._components is not None:
            self._components.encoder_ddp = []
        if meta:
            # The native model holds no data and never left the CPU, so Strategy.teardown's `module.cpu()` (which
            # cannot copy meta tensors) is skipped.
            module.cpu = lambda: module  # type: ignore[method-assign]
            try:
                super().teardown()
            finally:
                del module.cpu
        else:
            super().teardown()
        if self._parallel_ready:
            from megatron.core import parallel_state
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            parallel_state.destroy_model_parallel()
            # megatron-core's module-level router-loss tracker is sized by this model's layers: a later model in the
            # same process (another fit) starts from an empty one.
            get_moe_layer_wise_logging_tracker().clear()
            self._parallel_ready = False


def check_model_layout(
    plan: ParallelPlan, dims: MegatronDims, *, decoder: str, seq_length: int | None = None
) -> None:
    """Check the layout against the model before anything is built (the world size was checked in
    ``setup_environment``): the sizes the decoder component's plan says a TP degree must divide, and the data's
    sequence length. The twin checks the rest when the module makes it (layers per pipeline stage, experts, heads
    per context-parallel rank).

    Args:
        plan: the module's parallel plan.
        dims: the strategy's layout.
        decoder: the component the twin stands for.
        seq_length: the data's tokens per sample (``None``: unknown or variable; the twin checks each batch).

    Raises:
        ValueError: naming the degree, its value and the model's or the data's size it does not fit.
    """
    plan.check_tensor_parallel(dims.tp, option="tensor_model_parallel_size", components=[decoder])
    if seq_length is not None:
        dims.check_sequence_length(seq_length)


def _refuse_performance(perf: PerformanceConfig | None) -> None:
    """Refuse the switches megatron-core does not run here, whatever the twin (the twin refuses its own)."""
    if perf is None:
        return
    if perf.fp8 is not None:
        raise ValueError(
            "performance.fp8 is not applied under MegatronStrategy (megatron-core's FP8 runs through "
            "TransformerEngine): remove performance.fp8, or train with FSDP2Strategy / DDPStrategy"
        )
    if perf.compile is True:
        raise ValueError(
            "performance.compile (true) is not applied under MegatronStrategy: megatron-core's layers are not "
            "compiled here; set it to false or 'auto' (which is off under this strategy)"
        )


def _bf16(precision: str | None) -> bool:
    if str(precision) not in _PRECISIONS:
        raise NotImplementedError(
            f"trainer.precision={precision!r} is not supported by MegatronStrategy; use one of "
            f"{sorted(_PRECISIONS)} (bf16 keeps fp32 main weights in megatron's optimizer)"
        )
    return _PRECISIONS[str(precision)]

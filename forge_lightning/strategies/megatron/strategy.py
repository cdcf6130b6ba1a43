"""``MegatronStrategy``: megatron-core (TP / PP / VPP / SP / CP / EP, DDP, DistributedOptimizer) as a Lightning backend.

The LightningModule stays what it is under every strategy (e.g. ``CausalLM`` with its ``LLMConfig``); this
strategy builds the module's megatron-core twin (``forge_lightning.modules.llm.megatron``), copies the module's
weights into it (each rank keeps its TP shard of its pipeline stage) and trains the twin::

    Lightning loop, automatic optimisation, accumulate_grad_batches = N micro-batches per step
      training_step x N ──> the strategy buffers the micro-batches; on the N-th it runs megatron's schedule
                            (forward + backward of all N, pipelined; see schedule.py) and logs train/loss
      backward            ──> nothing: the schedule did it (no double backward)
      optimizer_step      ──> megatron optimizer.step() (grad clipping, DistributedOptimizer all-gather)
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

from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from typing_extensions import override

from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO
from forge_lightning.strategies.megatron import checkpoint as ckpt
from forge_lightning.strategies.megatron import model as twin
from forge_lightning.strategies.megatron.checkpoint import MegatronCheckpointIO
from forge_lightning.strategies.megatron.components import Components, parse_components
from forge_lightning.strategies.megatron.optimizer import (
    build_megatron_optimizer,
    build_schedulers,
    chain_optimizers,
)
from forge_lightning.strategies.megatron.schedule import (
    check_interleaved_micro_batches,
    eval_micro_batches,
    expert_load_metrics,
    forward_step,
    router_loss_metrics,
    run_schedule,
)

_PRECISIONS = {"32-true": False, "32": False, "bf16-mixed": True, "bf16-true": True}


class MegatronStrategy(ParallelStrategy):
    """megatron-core as a Lightning strategy, with megatron-core's option names.

    Registered as ``megatron``. Data parallelism is what the world has left: ``world / (TP × PP × CP)`` ranks.

    Args:
        tensor_model_parallel_size: TP ranks (keep within a node); must divide heads, key/value heads and vocab.
        pipeline_model_parallel_size: pipeline stages (1F1B schedule); must divide the layers.
        virtual_pipeline_model_parallel_size: model chunks per stage (interleaved 1F1B; ``accumulate_grad_batches``
            must be a multiple of PP); ``None``: one.
        sequence_parallel: with TP, shard norms / dropout / residual stream on the sequence.
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
        use_transformer_engine: TE layer spec (``None``: when TE is importable).
        components: per-component settings, ``{name: {tensor_model_parallel_size, recompute, freeze}}`` for
            components of the module's ``parallel_plan()``; a composed model (encoder -> projector -> LLM) runs its
            decoder at this strategy's TP and the other components at TP = 1, data-parallel over the decoder's TP
            group (see components.py and docs/megatron.md).
        process_group_backend: ``nccl``, ``gloo``...; default from the device.
        timeout: collective timeout.
    """

    strategy_name = "megatron"
    owns_checkpoint_io = True
    # The CLI builds the module under `deferred_pretrained`: each rank reads its shards of model.init_args.pretrained.
    reads_pretrained_shards = True

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
        use_transformer_engine: bool | None = None,
        components: dict[str, dict[str, Any]] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__()
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.virtual_pipeline_model_parallel_size = virtual_pipeline_model_parallel_size
        self.sequence_parallel = sequence_parallel
        self.context_parallel_size = context_parallel_size
        self.cp_comm_type = cp_comm_type
        self.hierarchical_context_parallel_sizes = hierarchical_context_parallel_sizes
        self.expert_model_parallel_size = expert_model_parallel_size
        self.expert_tensor_parallel_size = expert_tensor_parallel_size
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.use_transformer_engine = use_transformer_engine
        self.components = components
        self._components: Components | None = None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._parallel_ready = False
        self._chunks: list[nn.Module] = []
        self._pending: list[dict[str, torch.Tensor]] = []
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
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        dp = twin.validate_degrees(self.world_size, self._degrees())
        parse_components(self.components, self.tensor_model_parallel_size)  # names are checked in setup
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            hierarchical_context_parallel_sizes=self.hierarchical_context_parallel_sizes,
        )
        model_parallel_cuda_manual_seed(torch.initial_seed() % 2**31)
        self._parallel_ready = True
        rank_zero_info(
            f"{type(self).__name__}: TP={self.tensor_model_parallel_size} x PP={self.pipeline_model_parallel_size}"
            f" (VPP={self.virtual_pipeline_model_parallel_size or 1}) x CP={self.context_parallel_size} x DP={dp} (EP="
            f"{self.expert_model_parallel_size}, ETP={self.expert_tensor_parallel_size or self.tensor_model_parallel_size})"
            f" over {self.world_size} processes; cp_comm_type={self.cp_comm_type}, "
            f"sequence_parallel={self.sequence_parallel}, distributed optimizer={self.use_distributed_optimizer}"
        )

    def _degrees(self) -> dict[str, Any]:
        return {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "cp_comm_type": self.cp_comm_type,
            "hierarchical_context_parallel_sizes": self.hierarchical_context_parallel_sizes,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
            "sequence_parallel": self.sequence_parallel,
            "overlap_param_gather": self.overlap_param_gather,
            "use_distributed_optimizer": self.use_distributed_optimizer,
        }

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
        if getattr(getattr(self.lightning_module, "performance", None), "fp8", None) is not None:
            raise ValueError(
                "performance.fp8 is not applied under MegatronStrategy (megatron-core's FP8 runs through "
                "TransformerEngine): remove performance.fp8, or train with FSDP2Strategy / DDPStrategy"
            )
        self._bf16 = _bf16(trainer.precision)
        options = parse_components(self.components, self.tensor_model_parallel_size)
        parts = self._components = Components(self.lightning_module, options, self._degrees())
        self._chunks = twin.build_chunks(
            parts.decoder_source(),
            self._degrees(),
            device=self.root_device,
            bf16=self._bf16,
            use_transformer_engine=self.use_transformer_engine,
            config_overrides=parts.decoder_config_overrides(),
        )
        parts.prepare_decoder(self._chunks)
        self._chunks = twin.wrap_ddp(
            self._chunks, self._degrees(), overlap_grad_reduce=self.overlap_grad_reduce
        )
        parts.wrap_encoders(self._chunks, device=self.root_device, bf16=self._bf16)
        if trainer.state.fn == TrainerFn.FITTING:
            check_interleaved_micro_batches(
                self.pipeline_model_parallel_size,
                self.virtual_pipeline_model_parallel_size,
                trainer.accumulate_grad_batches,
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
            implementation=getattr(getattr(module, "performance", None), "optimizer", "auto"),
        )
        encoders = self._components.encoder_ddp
        if encoders and self.use_distributed_optimizer:
            # A composed model's encoder side reduces its gradients over TP x DP (every rank holds a replica), not
            # over the DP group the distributed optimizer shards by: it gets its own plain optimizer, chained with
            # the twin's (one global gradient norm, one step).
            optimizer = chain_optimizers(
                build_megatron_optimizer(
                    self._chunks,
                    module.optimizer_config,
                    use_distributed_optimizer=True,
                    overlap_param_gather=self.overlap_param_gather,
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
                use_distributed_optimizer=self.use_distributed_optimizer,
                overlap_param_gather=self.overlap_param_gather,
                **options,
            )
        twin.connect_schedule(self._chunks, optimizer, self._degrees(), self.overlap_grad_reduce)
        self._components.connect(self._chunks)
        total = module.scheduler_config.total_steps or int(trainer.estimated_stepping_batches)
        schedulers = build_schedulers(optimizer, module.scheduler_config, total)
        self.optimizers = [optimizer]
        self.lr_scheduler_configs = [LRSchedulerConfig(s, interval="step") for s in schedulers]

    # ----- training ---------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Buffer the micro-batch; on the last one of the optimizer step, run megatron's schedule over all."""
        self._pending.append(args[0])
        trainer = self.lightning_module.trainer
        if len(self._pending) < trainer.accumulate_grad_batches:
            return torch.zeros((), device=self.root_device)
        batches, self._pending = self._pending, []
        for chunk in self._chunks:
            chunk.zero_grad_buffer()
        self._components.zero_grad_buffers()
        self.optimizers[0].zero_grad()
        step = self._step_func()
        sums = run_schedule(
            self._chunks, batches, ignore_index=self._ignore_index(), forward_only=False, step_func=step
        )
        sums = self.reduce(sums, reduce_op="sum")
        loss = (sums[0] / sums[1].clamp_min(1)).float()
        self.lightning_module.log("train/loss", loss, prog_bar=True, rank_zero_only=True)
        config = twin.unwrap(self._chunks[0]).config
        device = next(self._chunks[0].parameters()).device
        metrics = {
            **router_loss_metrics(config, len(batches), device),
            **expert_load_metrics(config, self._chunks),
        }
        for name, value in metrics.items():  # MoE models only
            self.lightning_module.log(name, value, rank_zero_only=True)
        return loss

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
        success, grad_norm, _ = optimizer.step()
        if grad_norm is not None:
            self.lightning_module.log("train/grad_norm", float(grad_norm), rank_zero_only=True)
        return success

    def _ignore_index(self) -> int:
        return getattr(self.lightning_module, "ignore_index", -100)

    def _step_func(self) -> Any:
        """The schedule's forward step: a composed model's runs its encoder side first (components.py)."""
        return self._components.forward_step if self._components.composed else forward_step

    # ----- evaluation -------------------------------------------------------------------------------------------
    def _eval_step(self, prefix: str, batch: dict[str, torch.Tensor]) -> None:
        for chunk in self._chunks:
            chunk.eval()
        # The interleaved schedule runs micro-batches in groups of PP: split (or pad) the batch into PP of them.
        groups = self.pipeline_model_parallel_size if len(self._chunks) > 1 else 1
        batches = eval_micro_batches(batch, groups, ignore_index=self._ignore_index())
        with torch.no_grad():
            step = self._step_func()
            sums = run_schedule(
                self._chunks, batches, ignore_index=self._ignore_index(), forward_only=True, step_func=step
            )
        sums = self.reduce(sums, reduce_op="sum")
        for chunk in self._chunks:
            chunk.train()
        # Weighted by its tokens, Lightning's epoch mean of the per-batch means is the token mean of the epoch.
        loss = (sums[0] / sums[1].clamp_min(1)).float()
        tokens = max(int(sums[1]), 1)
        self.lightning_module.log(
            f"{prefix}/loss", loss, on_epoch=True, batch_size=tokens, rank_zero_only=True
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> None:
        self._eval_step("val", args[0])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> None:
        self._eval_step("test", args[0])

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

        A decoder LM (``CausalLM``): its Hugging Face state dict; ``module`` is accepted for the native strategies'
        signature. A composed model: the LightningModule's own ``state_dict()`` names (the decoder's tensors under
        its prefix, e.g. ``model.llm.model.embed_tokens.weight``; the encoder side's as they are), or with
        ``module`` a submodule's, relative to it (as the native strategies' ``full_model_state_dict``).
        """
        from forge_lightning.strategies.megatron.bridge import export_hf_state

        parts = self._components
        decoder = export_hf_state(self._chunks, parts.decoder_config())
        return parts.full_state_dict(decoder, module) if parts.composed else decoder

    # ----- checkpoints (see checkpoint.py) ----------------------------------------------------------------------
    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = MegatronCheckpointIO()
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
        with_optimizer = "optimizer_states" in checkpoint  # absent in ModelCheckpoint(save_weights_only=True)
        optimizer = self.optimizers[0] if with_optimizer and self.optimizers else None
        checkpoint = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
        parts = self._components
        checkpoint[ckpt.SHARDED_KEY] = ckpt.sharded_state_dict(
            self._chunks, optimizer, is_loading=False, components=parts.encoder_modules()
        )
        checkpoint[ckpt.HF_CONFIG_KEY] = parts.decoder_config().to_hf()  # a composed model's: its decoder's
        checkpoint[ckpt.INFO_KEY] = {
            "layout": {**self._degrees(), "data_parallel_size": self.data_parallel_size},
            "world_size": self.world_size,
            "optimizer": self._optimizer_kind() if optimizer is not None else None,
            "frozen": parts.frozen(),
        }
        self.checkpoint_io.save_checkpoint(checkpoint, path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any layout into this rank's chunks (and optimizer, when fitting). Collective."""
        parts = self._components
        path = Path(self.broadcast(str(checkpoint_path)))
        meta = ckpt.check_is_checkpoint(path)
        ckpt.check_model_config(path, parts.decoder_config())
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self.optimizers[0] if fitting and self.optimizers else None
        if optimizer is not None:
            ckpt.check_optimizer_kind(path, meta, self._optimizer_kind())
            ckpt.check_expert_layout(path, meta, self._degrees())
            ckpt.check_frozen(path, meta, parts.frozen())
        encoders = parts.encoder_modules()
        template = ckpt.sharded_state_dict(self._chunks, optimizer, is_loading=True, components=encoders)
        checkpoint = self.checkpoint_io.load_checkpoint(path, sharded_state_dict=template)
        ckpt.load_into(self._chunks, optimizer, checkpoint.pop(ckpt.SHARDED_KEY), components=encoders)
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
        return {"distributed": self.use_distributed_optimizer, "bf16": self._bf16}

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            # Deferred pretrained weights (see CausalLM): the native model holds no data and never left the CPU,
            # so Strategy.teardown's `module.cpu()` (which cannot copy meta tensors) is skipped.
            module.cpu = lambda: module  # type: ignore[method-assign]
            try:
                super().teardown()
            finally:
                del module.cpu
        else:
            super().teardown()
        if self._parallel_ready:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            self._parallel_ready = False
        self._chunks = []


def _bf16(precision: str | None) -> bool:
    if str(precision) not in _PRECISIONS:
        raise NotImplementedError(
            f"trainer.precision={precision!r} is not supported by MegatronStrategy; use one of "
            f"{sorted(_PRECISIONS)} (bf16 keeps fp32 main weights in megatron's optimizer)"
        )
    return _PRECISIONS[str(precision)]

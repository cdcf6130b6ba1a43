"""``WanDiffusionModule`` under ``MegatronStrategy``: the twin's model chunk is the module's own ``WanDiT`` (a copy
of it), inside a thin megatron-core ``MegatronModule`` (megatron-core has no video DiT), trained by megatron's DDP,
optimizer and schedule at TP = PP = 1, with context parallelism over megatron's CP groups::

    micro-batch m of the step (the same on the CP ranks of a data rank)
      WanDiffusionModule.prepare(batch, m)    per-sample noise, noise level, text dropout (the module's generators)
      chunk(x_t, timestep=, ...)              WanDiT, its patch tokens split over parallel_state's CP group
                                              (SplitSequence: Ulysses, ring, or Ulysses inside ring groups), the
                                              prediction gathered back whole on every CP rank
      FlowMatching.loss [B] -> (sum, B)       the module's loss, on every CP rank

megatron sums the gradients over the data- x context-parallel ranks and divides them by the counts summed over the
same ranks. Each of the ``P`` CP ranks of a data rank computes the loss of the whole gathered prediction and counts
its ``B`` samples; their gradients sum to ``P`` times one process's (the gather's backward sums each part's gradient
over the ranks, see ``split_sequence.py``) and their counts to ``P x B``, so ``P`` cancels and the step's gradient is
the one batch rule's (sum of the global batch's sample losses / its samples), as in ``training_step``.

Evaluation runs the module's fixed-sigma losses through the chunk and records them with the module (per-sigma logs
included). Refused: TP, PP, VPP, EP > 1, the strategy's recompute, and Ulysses over ranks that do not divide the heads.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from forge_lightning.contracts import LOSS_AND_COUNT, MegatronBuild, MegatronDims, common_divisors
from forge_lightning.distributed.context_parallel import ContextParallel
from forge_lightning.distributed.split_sequence import SplitSequence
from forge_lightning.modules.diffusion.flow_matching import FlowMatchingSample
from forge_lightning.modules.diffusion.wan_config import WanDiTConfig
from forge_lightning.modules.diffusion.wan_model import WanDiT

if TYPE_CHECKING:
    from forge_lightning.modules.diffusion.module import WanDiffusionModule


class DiTChunk(MegatronModule):
    """A ``WanDiT`` as megatron-core's schedule, DDP and dist-checkpointing take a model chunk: its
    ``TransformerConfig``, ``model_type`` and ``set_input_tensor``; the forward is the DiT's.

    Args:
        config: megatron's config of the chunk (``calculate_per_token_loss``, dtype, CP layout).
        dit: the DiT (its parameters keep their own names, under ``dit.``).
    """

    def __init__(self, config: TransformerConfig, dit: WanDiT) -> None:
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        self.dit = dit

    def set_input_tensor(self, input_tensor: Any) -> None:
        """megatron hands a pipeline stage the previous stage's output here; at PP = 1 it hands ``None``."""
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        if any(t is not None for t in tensors):
            raise RuntimeError(
                "the Wan DiT's megatron chunk is a whole model (PP = 1): it takes no stage input"
            )

    def forward(self, hidden_states: Tensor, **inputs: Tensor | None) -> Tensor:
        """The DiT's prediction, on the chunk's device; the inputs are moved there (the LightningModule, which
        draws the noise, stays on the CPU under MegatronStrategy) and the conditions cast to the weights' dtype
        (megatron's ``Float16Module`` casts only the positional latents)."""
        weight = self.dit.patch_embedding.weight
        moved = {k: None if v is None else v.to(weight.device) for k, v in inputs.items()}
        for name in ("encoder_hidden_states", "encoder_hidden_states_image"):
            if moved.get(name) is not None:
                moved[name] = moved[name].to(weight.dtype)
        return self.dit(hidden_states.to(weight.device), **moved)


class DiTTwin:
    """The megatron-core twin of a :class:`WanDiffusionModule` (a ``MegatronTwin``).

    Args:
        module: the LightningModule (its DiT, noise draws, loss and bookkeeping).
        build: the strategy's layout and settings.

    Raises:
        ValueError: a layout or setting the twin does not run (named, with what to use instead).
    """

    # The DiT's attention backend is the module's (built into the DiT this copies).
    performance_switches = frozenset({"attention.packed"})

    def __init__(self, module: WanDiffusionModule, build: MegatronBuild) -> None:
        check_layout(module.config, build)
        self.module = module
        self.build = build
        self._micro_batch = 0  # the micro-batch of the step (the module's batch_idx % accumulate)
        self._eval_batch = 0

    def transformer_config(self) -> TransformerConfig:
        """megatron-core's config of the chunk: the DiT's sizes, the CP layout, per-sample loss counts."""
        config, dims = self.module.config, self.build.dims
        dtype = torch.bfloat16 if self.build.bf16 else torch.float32
        cp_fields: dict[str, Any] = {}
        if dims.cp > 1:
            hierarchy = dims.hierarchical_context_parallel_sizes if dims.cp_comm_type == "a2a+p2p" else None
            cp_fields = {
                "cp_comm_type": dims.cp_comm_type,
                "hierarchical_context_parallel_sizes": None if hierarchy is None else list(hierarchy),
            }
        return TransformerConfig(
            num_layers=config.num_layers,
            hidden_size=config.dim,
            num_attention_heads=config.num_heads,
            ffn_hidden_size=config.ffn_dim,
            context_parallel_size=dims.cp,
            **cp_fields,
            calculate_per_token_loss=True,
            bf16=self.build.bf16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            use_cpu_initialization=self.build.device.type != "cuda",
        )

    def build_chunks(self) -> list[nn.Module]:
        """One chunk: a copy of the module's DiT on the build's device, its sequence split over megatron's CP
        group when CP > 1 (bf16 runs: in megatron's ``Float16Module``, the optimizer keeping fp32 main weights).
        The module's own DiT then moves to the meta device: the chunk holds the weights, and the strategy copies
        them back into the module when a callback runs it."""
        if self.module.dit.patch_embedding.weight.is_meta:
            raise RuntimeError(
                "the DiT's weights were handed to an earlier megatron twin (they live in its chunk): build one twin "
                "per module"
            )
        dit = copy.deepcopy(self.module.dit).to(self.build.device)
        self.module.dit.to("meta")
        if self.build.dims.cp > 1:
            dit.set_sequence_layout(SplitSequence(megatron_context_parallel(self.build.dims)))
        config = self.transformer_config()
        chunk = DiTChunk(config, dit)
        return [Float16Module(config, chunk) if self.build.bf16 else chunk]

    # ----- the schedule -----------------------------------------------------------------------------------------
    def forward_step(self, batch: dict[str, Tensor], chunk: nn.Module) -> tuple[Tensor, Callable]:
        """Training: the chunk's prediction on the module's noised inputs of micro-batch ``m`` of the step and the
        flow-matching loss function; evaluation: the module's fixed-sigma losses through the chunk."""
        if not chunk.training:
            return self._eval_forward_step(batch, chunk)
        module, device = self.module, _device(chunk)
        sample, text = module.prepare(batch, self._micro_batch)
        self._micro_batch += 1
        sample = _to_device(sample, device)  # the loss is computed where the prediction is
        image_inputs = tuple(None if t is None else t.to(device) for t in module.image_inputs(batch))
        pred = module.velocity(sample.x_t, sample.timestep, text.to(device), image_inputs, dit=chunk)

        def loss_function(pred: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            loss_B = module.flow.loss(pred.float(), sample)
            count = torch.tensor(loss_B.shape[0], dtype=torch.int, device=loss_B.device)
            pair = torch.stack([loss_B.sum().detach().double(), count.double()])
            return loss_B.sum(), count, {LOSS_AND_COUNT: pair}

        return pred, loss_function

    def _eval_forward_step(self, batch: dict[str, Tensor], chunk: nn.Module) -> tuple[Tensor, Callable]:
        module = self.module
        if not module.evaluation_started:  # the first batch of an evaluation (the module logs at its end)
            self._eval_batch = 0

        def predict(x_t: Tensor, **inputs: Tensor | None) -> Tensor:
            """The chunk's prediction where the module's noise and targets are."""
            return chunk(x_t, **inputs).to(x_t.device)

        losses_KB = module.fixed_sigma_losses(batch, self._eval_batch, dit=predict)
        self._eval_batch += 1
        module.record_eval_losses(losses_KB)

        def loss_function(losses_KB: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            count = torch.tensor(losses_KB.shape[1], dtype=torch.int, device=losses_KB.device)
            pair = torch.stack([losses_KB.mean(0).sum().double(), count.double()])
            return losses_KB.mean(0).sum(), count, {LOSS_AND_COUNT: pair}

        return losses_KB, loss_function

    def after_schedule(
        self, chunks: list[nn.Module], sums: Tensor, *, training: bool, num_micro_batches: int
    ) -> None:
        """Training: record the step's sums with the module's objective (it logs ``train/loss``); evaluation: the
        forward step recorded them already (with the per-sigma sums)."""
        if training:
            self._micro_batch = 0
            self.module.objective.record_train(sums)

    def micro_batch_shape(self, batch: dict[str, Tensor]) -> tuple[int, int]:
        """``(samples, patch tokens per video)`` (the module's ``batch_stats``); megatron sizes only pipeline
        messages with it, and there are none at PP = 1."""
        stats = self.module.batch_stats(batch)
        return int(stats["samples"]), int(stats["tokens"]) // int(stats["samples"])

    def padding_batch(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError(
            "the Wan DiT's megatron twin runs without virtual pipeline stages, whose evaluation pads micro-batches"
        )

    # ----- checkpoints and export -------------------------------------------------------------------------------
    def state_dict(self, chunks: list[nn.Module]) -> dict[str, Tensor]:
        """The DiT's weights under its own names on global rank 0 (every rank holds them whole), empty elsewhere."""
        if torch.distributed.get_rank() != 0:
            return {}
        dit = _unwrap(chunks[0]).dit
        return {k: v.detach().cpu() for k, v in dit.state_dict().items()}

    def hf_config(self) -> dict[str, Any]:
        """The DiT's diffusers ``config.json``."""
        return self.module.config.to_diffusers()

    def check_checkpoint_config(self, saved: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming each field on which the checkpoint's DiT differs from this one."""
        mine = self.module.config
        theirs = WanDiTConfig.from_diffusers(saved, attention_backend=mine.attention_backend)
        differ = [
            f"{f.name} ({getattr(theirs, f.name)!r} in the checkpoint, {getattr(mine, f.name)!r} here)"
            for f in dataclasses.fields(mine)
            if getattr(theirs, f.name) != getattr(mine, f.name)
        ]
        if differ:
            raise ValueError(f"the checkpoint's Wan DiT differs from the module's: {', '.join(differ)}")


def megatron_context_parallel(dims: MegatronDims) -> ContextParallel:
    """megatron's context-parallel group (and for ``a2a+p2p`` its hierarchical groups) as a
    :class:`ContextParallel`; rank ``r`` of the group holds the ``r``-th contiguous part of every video's tokens
    (the DiT attends without a causal mask, so no load balancing is needed)."""
    group = parallel_state.get_context_parallel_group()
    if dims.cp_comm_type != "a2a+p2p":
        return ContextParallel(group, comm_type=dims.cp_comm_type)
    groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not groups or len(groups) != 2:
        raise ValueError(
            "cp_comm_type 'a2a+p2p' needs megatron's two hierarchical context-parallel groups: set "
            "hierarchical_context_parallel_sizes [a2a, p2p]"
        )
    return ContextParallel(group, comm_type="a2a+p2p", a2a_group=groups[0], p2p_group=groups[1])


def check_layout(config: WanDiTConfig, build: MegatronBuild) -> None:
    """Raise ``ValueError`` for what the DiT's twin does not run: model parallelism other than CP, the strategy's
    recompute, a composition, and Ulysses over ranks that do not split the heads."""
    dims = build.dims
    if build.moe_overlap.enabled:
        raise ValueError(
            "the MoE communication overlap options (overlap_moe_expert_parallel_comm, delay_wgrad_compute, "
            "moe_shared_expert_overlap) overlap MoE layers' communication, and the Wan DiT has none: set them to false"
        )
    degrees = {
        "tensor_model_parallel_size": dims.tp,
        "pipeline_model_parallel_size": dims.pp,
        "virtual_pipeline_model_parallel_size": dims.vpp,
        "expert_model_parallel_size": dims.ep,
        "expert_tensor_parallel_size": dims.etp,
    }
    for option, value in degrees.items():
        if value != 1:
            raise ValueError(
                f"{option} ({value}) is not supported for the Wan DiT under MegatronStrategy: its megatron twin is "
                "the plain WanDiT, which has no tensor / pipeline / expert split; use context_parallel_size for long "
                "videos (data parallelism for the rest), or train with FSDP2Strategy"
            )
    if build.recompute != "none":
        raise ValueError(
            f"components.dit.recompute ({build.recompute!r}) is not applied to the Wan DiT under MegatronStrategy; "
            "leave it unset, or train with FSDP2Strategy and performance.activation_checkpointing"
        )
    if build.composition is not None:
        raise ValueError(
            "the Wan DiT's megatron twin stands for the whole module, not a composition's decoder"
        )
    ulysses = dims.ulysses_size
    if ulysses > 1 and config.num_heads % ulysses:
        option = (
            "context_parallel_size"
            if dims.cp_comm_type == "a2a"
            else "hierarchical_context_parallel_sizes[0]"
        )
        raise ValueError(
            f"{option} ({ulysses}) must divide the DiT's num_heads ({config.num_heads}): Ulysses attention gives "
            f"each rank a share of the heads; use one of {common_divisors(config.num_heads)}, or cp_comm_type 'p2p'"
        )


def _to_device(sample: FlowMatchingSample, device: torch.device) -> FlowMatchingSample:
    moved = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    return FlowMatchingSample(**{k: None if v is None else v.to(device) for k, v in moved.items()})


def _unwrap(chunk: nn.Module) -> DiTChunk:
    while not isinstance(chunk, DiTChunk):
        chunk = chunk.module
    return chunk


def _device(chunk: nn.Module) -> torch.device:
    return next(chunk.parameters()).device

"""``DecoderTwin``: the megatron-core model of a decoder LM, behind the strategy's
:class:`~forge_lightning.contracts.MegatronTwin` contract.

A ``CausalLM`` (or a composed model whose decoder is a ``DecoderLM``) returns one from ``megatron_model(build)``;
``MegatronStrategy`` then trains the twin's chunks and never reads the family's code::

    DecoderLM (HF names, weights or meta + pretrained dir) ─ build_chunks ─▶ GPTModel chunks of this rank
        weights: the module's own (weights.py rules) or each rank's shards read from the files (bridge.py)
    forward_step ─ steps.py (plain or composed), the module's LMLoss
    after_schedule ─ the module's GlobalBatchLoss records the sums; MoE router losses and expert load logged
    state_dict ─ the gathered weights under the DecoderLM's own names (experts fused, tied head)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from forge_lightning.accelerators.capabilities import capabilities
from forge_lightning.contracts import MegatronBuild, MegatronDims, common_divisors
from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.hf import (
    EMBEDDING_KEY,
    TIED_HEAD_KEY,
    check_compatible,
    fuse_experts,
    split_experts,
)
from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.model import DecoderLM
from forge_lightning.modules.objective import GlobalBatchLoss

# megatron's full recompute of the twin: every layer's forward is recomputed in backward.
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


class DecoderTwin:
    """The megatron-core twin of a :class:`~forge_lightning.modules.llm.model.DecoderLM` (a ``MegatronTwin``).

    Args:
        decoder: the native decoder (Hugging Face names); on the meta device when ``pretrained`` is to be read
            shard by shard.
        build: the strategy's layout and settings.
        loss: the module's loss (its ``backend`` is the fused kernel's at TP = 1).
        objective: the module's loss bookkeeping, which receives each step's and evaluation's sums.
        log: the module's ``log`` (for the MoE metrics).
        pretrained: the Hugging Face directory the decoder's weights are read from when it is on the meta device.

    Raises:
        ValueError: the layout does not fit the model (layers per stage, experts, Ulysses heads), or a
            ``performance`` switch has a value the twin cannot honour (named).
        NotImplementedError: an architecture megatron-core cannot express (see tf_config.py).
    """

    performance_switches = frozenset(
        {
            "kernels.rms_norm",
            "kernels.rope",
            "kernels.swiglu",
            "kernels.cross_entropy",
            "attention.packed",
            "attention.kernel",
            "activation_checkpointing",
        }
    )

    def __init__(
        self,
        decoder: DecoderLM,
        build: MegatronBuild,
        *,
        loss: LMLoss,
        objective: GlobalBatchLoss,
        log: Callable[..., Any],
        pretrained: str | None = None,
    ) -> None:
        self.decoder = decoder
        self.config: LLMConfig = decoder.config
        self.build = build
        self.objective = objective
        self.log = log
        self.pretrained = pretrained
        check_layout(self.config, build.dims, build.use_transformer_engine)
        check_moe_overlap(self.config, build)
        self.kernels, self.recompute = self._performance()
        if resolve_transformer_engine(self.config, build.use_transformer_engine):
            for name in ("rms_norm", "rope"):
                if self.kernels[name] != "auto":
                    raise ValueError(
                        f"performance.kernels.{name} ({self.kernels[name]!r}) is not applied with TransformerEngine's "
                        "layer spec, which brings its own kernels; leave it 'auto' or set use_transformer_engine: false"
                    )
        if self.kernels["cross_entropy"] != "auto" and build.dims.tp > 1:
            raise ValueError(
                f"performance.kernels.cross_entropy ({self.kernels['cross_entropy']!r}) is not applied at "
                f"tensor_model_parallel_size {build.dims.tp}: the twin's vocabulary is split over the TP ranks, and "
                "megatron's vocab-parallel cross-entropy computes the loss; leave it 'auto'"
            )
        self.loss = LMLoss(
            ignore_index=loss.ignore_index, z_loss=loss.z_loss, backend=self.kernels["cross_entropy"]
        )
        self._tf_config: Any = None

    def _performance(self) -> tuple[dict[str, str], str]:
        """The kernel choices and the recompute mode, from ``build.performance`` and ``build.recompute``."""
        perf = self.build.performance
        kernels = {"rms_norm": "auto", "rope": "auto", "swiglu": "auto", "cross_entropy": "auto"}
        checkpointing = "none"
        if perf is not None:
            kernels = {name: getattr(perf.kernels, name) for name in kernels}
            if perf.attention.packed not in ("auto", "sdpa"):
                raise ValueError(
                    f"performance.attention.packed ({perf.attention.packed!r}) is not applied under "
                    "MegatronStrategy: the twin attends within packed documents through SDPA with a document mask "
                    "('sdpa'); set 'auto' or 'sdpa'"
                )
            if perf.attention.kernel == "fa4":
                raise ValueError(
                    "performance.attention.kernel ('fa4') is not applied under MegatronStrategy: the twin's "
                    "attention is megatron-core's (SDPA); set 'auto' or 'sdpa', or train with FSDP2Strategy or DDP "
                    "for FlashAttention-4"
                )
            checkpointing = perf.activation_checkpointing
        if kernels["swiglu"] == "triton":
            raise ValueError(
                "performance.kernels.swiglu ('triton') is not applied under MegatronStrategy: the twin's SwiGLU is "
                "megatron-core's fused kernel on CUDA ('auto') or plain torch ('torch')"
            )
        if checkpointing == "selective":
            raise ValueError(
                "performance.activation_checkpointing ('selective') is not applied under MegatronStrategy: "
                "megatron-core's selective recompute keeps other tensors than forge's; use 'full' (megatron's full "
                "recompute of every layer) or 'none'"
            )
        recompute = "full" if "full" in (checkpointing, self.build.recompute) else "none"
        return kernels, recompute

    # ----- building ---------------------------------------------------------------------------------------------
    def transformer_config(self) -> Any:
        """megatron-core's ``TransformerConfig`` of the twin at the build's layout."""
        from forge_lightning.modules.llm.megatron.tf_config import transformer_config

        dims, device = self.build.dims, self.build.device
        cp_fields: dict[str, Any] = {}
        if dims.cp > 1:  # megatron's own names: its TE attention reads them too (None: its default)
            hierarchy = dims.hierarchical_context_parallel_sizes if dims.cp_comm_type == "a2a+p2p" else None
            cp_fields = {
                "cp_comm_type": dims.cp_comm_type,
                "hierarchical_context_parallel_sizes": None if hierarchy is None else list(hierarchy),
            }
        return transformer_config(
            self.config,
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            context_parallel_size=dims.cp,
            expert_model_parallel_size=dims.ep,
            expert_tensor_parallel_size=dims.expert_tensor_parallel_size,
            virtual_pipeline_model_parallel_size=dims.virtual_pipeline_model_parallel_size,
            sequence_parallel=dims.sequence_parallel,
            pipeline_dtype=torch.bfloat16 if self.build.bf16 else torch.float32,
            bf16=self.build.bf16,
            **cp_fields,
            # On a GPU, built there (megatron's CPU initialisation is slow at real sizes); the init values are
            # overwritten by the weights, but megatron's init functions also tag the tensor-parallel weights.
            # There, too, the gated MLP's SiLU-and-multiply runs as megatron's compiled fused kernel (one pass
            # instead of several eager ones; not on a CPU, where compiling it would only slow short runs down).
            use_cpu_initialization=device.type != "cuda",
            bias_activation_fusion=capabilities(device).compile and self.kernels["swiglu"] == "auto",
            **(FULL_RECOMPUTE if self.recompute == "full" else {}),
            **self.build.moe_overlap.transformer_config_fields(),
        )

    def build_chunks(self) -> list[nn.Module]:
        """This rank's model chunks (one per virtual stage), holding the decoder's weights.

        A decoder on the meta device has its ``pretrained`` directory read instead, each rank reading only its own
        shards (:func:`~forge_lightning.modules.llm.megatron.bridge.load_hf_checkpoint`).
        """
        from megatron.core import parallel_state
        from megatron.core.transformer.module import Float16Module

        from forge_lightning.modules.llm.megatron.bridge import load_hf_checkpoint, load_state
        from forge_lightning.modules.llm.megatron.gpt import build_gpt_model
        from forge_lightning.modules.llm.megatron.layer_spec import gpt_decoder_spec

        dims = self.build.dims
        tf_config = self._tf_config = self.transformer_config()
        use_te = resolve_transformer_engine(self.config, self.build.use_transformer_engine)
        chunks = []
        for stage in range(dims.vpp):
            vp_stage = stage if dims.vpp > 1 else None
            spec = gpt_decoder_spec(
                tf_config, vp_stage=vp_stage, use_transformer_engine=use_te, kernels=self.kernels
            )
            chunk = build_gpt_model(
                self.config,
                tf_config,
                spec,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
                loss=self.loss,
                fused_loss=True,
            )
            if self.build.composition is not None and chunk.pre_process:
                # The composition's merge needs every position's token embedding: keep them whole (all-reduced,
                # not scattered over the sequence); the composed step scatters after the merge.
                chunk.embedding.word_embeddings.reduce_scatter_embeddings = False
            chunks.append(chunk.to(self.build.device))
        if any(p.is_meta for p in self.decoder.parameters()):
            if self.pretrained is None:
                raise ValueError(
                    "the decoder is on the meta device and names no pretrained directory to read its weights from; "
                    "pass model.init_args.pretrained or build the module with materialised weights"
                )
            load_hf_checkpoint(chunks, self.config, self.pretrained)
        else:
            # The module's experts are 3-D tensors; the rules name them one by one.
            load_state(chunks, self.config, split_experts(self.decoder.state_dict()).__getitem__)
        return [Float16Module(tf_config, chunk) if self.build.bf16 else chunk for chunk in chunks]

    # ----- the schedule -----------------------------------------------------------------------------------------
    def forward_step(
        self, batch: dict[str, Tensor], chunk: nn.Module, *, schedule_plan: bool = False
    ) -> tuple[Any, Callable]:
        """megatron's forward step of one micro-batch (see steps.py); with ``schedule_plan`` (megatron-core's
        combined 1F1B schedule, ``overlap_moe_expert_parallel_comm``) the chunk's schedule plan instead of its
        output."""
        from forge_lightning.modules.llm.megatron import steps

        build = self.build
        if build.composition is None:
            # Batches of variable length (the data's seq_length, when fixed, was checked at setup).
            build.dims.check_sequence_length(batch["input_ids"].shape[1], what="the batch's sequence length")
            return steps.forward_step(batch, chunk, self.loss, schedule_plan=schedule_plan)
        return steps.composed_forward_step(batch, chunk, self.loss, build.composition, build.encode)

    def after_schedule(
        self, chunks: list[nn.Module], sums: Tensor, *, training: bool, num_micro_batches: int
    ) -> None:
        """Record the sums with the module's objective; after a training step, log the MoE metrics."""
        from forge_lightning.modules.llm.megatron.gpt import unwrap
        from forge_lightning.modules.llm.megatron.metrics import expert_load_metrics, router_loss_metrics

        if not training:
            self.objective.record_eval(sums)
            return
        self.objective.record_train(sums)
        config = unwrap(chunks[0]).config
        device = next(chunks[0].parameters()).device
        metrics = {
            **router_loss_metrics(config, num_micro_batches, device),
            **expert_load_metrics(config, chunks),
        }
        for name, value in metrics.items():  # MoE models only
            self.log(name, value, rank_zero_only=True)

    def micro_batch_shape(self, batch: dict[str, Tensor]) -> tuple[int, int]:
        """``input_ids``' ``[b, s]`` (a composed model's decoder input may be longer, but only at PP = 1: under
        pipeline parallelism its merge must keep the text positions, see ``steps.composed_forward_step``)."""
        micro_batch, seq_length = batch["input_ids"].shape
        return micro_batch, seq_length

    def padding_batch(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``batch`` with every label ignored: no loss, no tokens."""
        return {**batch, "labels": torch.full_like(batch["labels"], self.loss.ignore_index)}

    # ----- checkpoints and export -------------------------------------------------------------------------------
    def hf_state_dict(self, chunks: list[nn.Module]) -> dict[str, Tensor]:
        """The full Hugging Face state dict (experts one by one) on global rank 0 (CPU), empty elsewhere.
        Collective."""
        from forge_lightning.modules.llm.megatron.bridge import export_hf_state

        return export_hf_state(chunks, self.config)

    def state_dict(self, chunks: list[nn.Module]) -> dict[str, Tensor]:
        """The trained weights under the ``DecoderLM``'s own names (experts as 3-D tensors, the tied head beside
        the embedding, the native order) on global rank 0, empty elsewhere. Collective."""
        hf = self.hf_state_dict(chunks)
        if not hf:
            return {}
        native = fuse_experts(hf)
        order = list(self.decoder.state_dict())
        if self.config.tie_word_embeddings and TIED_HEAD_KEY in order:
            native[TIED_HEAD_KEY] = native[EMBEDDING_KEY]
        return {k: native[k] for k in order if k in native} | native

    def hf_config(self) -> dict[str, Any]:
        return self.config.to_hf()

    def check_checkpoint_config(self, saved: dict[str, Any]) -> None:
        check_compatible(self.config, LLMConfig.load(saved))


def resolve_transformer_engine(config: LLMConfig, requested: bool | None) -> bool:
    """Whether the twin uses TransformerEngine's layer spec: as requested, else when TE is importable (never with
    multi-latent attention, whose TE spec has other weight names; see ``gpt_decoder_spec``)."""
    if requested is not None:
        return requested
    # Imported only here: it imports megatron-core, which checking a requested layout does not need.
    from forge_lightning.modules.llm.megatron.layer_spec import transformer_engine_available

    return transformer_engine_available() and config.mla is None


def check_layout(config: LLMConfig, dims: MegatronDims, use_transformer_engine: bool | None = None) -> None:
    """Raise ``ValueError`` unless the layout fits the model: layers per pipeline chunk, experts per expert-parallel
    rank and expert width per expert-TP rank (TP when ``expert_tensor_parallel_size`` is unset), and (local spec)
    query heads per Ulysses rank. The tensor-parallel divisors (heads, key/value heads, widths, vocabulary) are the
    plan's (``CausalLM.parallel_plan``) and the sequence length is the data's, both checked by the strategy."""
    chunks = dims.pp * dims.vpp
    if config.num_layers % chunks:
        raise ValueError(
            f"pipeline_model_parallel_size ({dims.pp}) x virtual_pipeline_model_parallel_size ({dims.vpp}) = "
            f"{chunks} must divide the model's num_layers ({config.num_layers}): each pipeline stage (each of its "
            f"virtual chunks) holds an equal number of layers; choose degrees whose product is one of "
            f"{common_divisors(config.num_layers)}"
        )
    check_experts(config, dims.ep, dims.expert_tensor_parallel_size, tp=dims.tp)
    if not resolve_transformer_engine(config, use_transformer_engine):  # TE's attention brings its own CP
        option = (
            "context_parallel_size"
            if dims.cp_comm_type == "a2a"
            else "hierarchical_context_parallel_sizes[0]"
        )
        check_ulysses_heads(config, dims.tp, dims.ulysses_size, option=option)


def check_moe_overlap(config: LLMConfig, build: MegatronBuild) -> None:
    """Raise ``ValueError`` for a MoE communication overlap option (``build.moe_overlap``, checked against the
    layout by the strategy) that this model or layer spec cannot run, naming the option and the fix."""
    overlap = build.moe_overlap
    if not overlap.enabled:
        return
    on = [name for name, value in overlap.transformer_config_fields().items() if value]
    if config.moe is None or not config.num_moe_layers:
        raise ValueError(
            f"{', '.join(on)} overlap the MoE layers' communication, and this model has none: set them to false"
        )
    if overlap.moe_shared_expert_overlap and not config.moe.shared_intermediate_size:
        raise ValueError(
            "moe_shared_expert_overlap overlaps the shared experts with the token dispatch, and this model has no "
            "shared experts (moe.shared_intermediate_size is 0): set it to false"
        )
    if overlap.delay_wgrad_compute and not resolve_transformer_engine(config, build.use_transformer_engine):
        why = (
            "multi-latent attention runs the local spec" if config.mla is not None else "the local layer spec"
        )
        raise ValueError(
            f"delay_wgrad_compute needs TransformerEngine's linears (megatron-core's local linears compute the weight "
            f"gradients in the backward itself, so nothing would be delayed), and this twin runs {why}: install "
            "TransformerEngine and set use_transformer_engine: true, or set delay_wgrad_compute to false"
        )
    if overlap.overlap_moe_expert_parallel_comm and build.composition is not None:
        raise ValueError(
            "overlap_moe_expert_parallel_comm is not supported for the decoder of a composed model (encoder -> "
            "projector -> LLM): megatron-core's schedule plan has no place for the merged encoder features; set it "
            "to false"
        )


def check_ulysses_heads(
    config: LLMConfig, tp: int, cp: int, *, option: str = "context_parallel_size"
) -> None:
    """Raise ``ValueError`` unless Ulysses context parallelism can split this TP rank's query heads over CP ranks.

    Each Ulysses rank attends over the whole sequence for ``1 / cp`` of the rank's query heads (see
    :class:`~forge_lightning.modules.llm.megatron.layer_spec.SDPACoreAttention`). Key/value heads need not divide:
    when they do not, they are repeated to the query heads before the exchange (more bytes, same result). Ring
    attention (``cp_comm_type`` ``p2p``) has no such constraint; the hybrid's Ulysses part (``a2a+p2p``) has, over
    its ``hierarchical_context_parallel_sizes[0]`` ranks.

    Args:
        config: the decoder's configuration (``num_heads``).
        tp: ``tensor_model_parallel_size``.
        cp: the ranks Ulysses splits the heads over (``context_parallel_size`` with ``cp_comm_type`` ``a2a``).
        option: the option that set ``cp``, for the message.
    """
    if cp == 1 or (config.num_heads // tp) % cp == 0:
        return
    raise ValueError(
        f"{option} ({cp}) must divide the query heads of each tensor-parallel rank, num_heads "
        f"({config.num_heads}) / tensor_model_parallel_size ({tp}) = {config.num_heads // tp}: Ulysses attention "
        f"gives each context-parallel rank a share of the heads over the whole sequence; use one of "
        f"{common_divisors(config.num_heads // tp)}, or cp_comm_type 'p2p' (ring attention), which does not split "
        "the heads"
    )


def check_experts(config: LLMConfig, ep: int, etp: int | None = None, *, tp: int = 1) -> None:
    """Raise ``ValueError`` unless ``expert_model_parallel_size`` and ``expert_tensor_parallel_size`` (``None``:
    ``tensor_model_parallel_size`` ``tp``, megatron-core's default) fit the model's experts."""
    if etp is None and config.moe is not None and config.moe.intermediate_size % tp:
        raise ValueError(
            f"tensor_model_parallel_size ({tp}) must divide the model's moe.intermediate_size "
            f"({config.moe.intermediate_size}): expert_tensor_parallel_size is unset, so each routed expert's width "
            f"is split over the TP ranks; set expert_tensor_parallel_size to one of "
            f"{common_divisors(config.moe.intermediate_size)} (1 keeps the experts whole)"
        )
    if ep == 1 and etp is None:
        return
    if config.moe is None or not config.num_moe_layers:
        option = f"expert_model_parallel_size ({ep})" if ep > 1 else f"expert_tensor_parallel_size ({etp})"
        raise ValueError(
            f"{option} needs a mixture-of-experts model; {config.architecture} has no experts (leave the expert "
            "options at their defaults)"
        )
    if etp is not None and config.moe.intermediate_size % etp:
        raise ValueError(
            f"expert_tensor_parallel_size ({etp}) must divide moe.intermediate_size ({config.moe.intermediate_size}):"
            " each expert-tensor-parallel rank holds an equal slice of every expert's width; use one of "
            f"{common_divisors(config.moe.intermediate_size)}"
        )
    if config.moe.num_experts % ep:
        raise ValueError(
            f"expert_model_parallel_size ({ep}) must divide moe.num_experts ({config.moe.num_experts}): each "
            f"expert-parallel rank holds the same number of experts; use one of "
            f"{common_divisors(config.moe.num_experts)}"
        )

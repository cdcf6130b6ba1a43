"""``MixerTwin``: the MLP-Mixer's megatron-core model, behind the strategy's
:class:`~forge_lightning.contracts.MegatronTwin` contract (the test-only family of mixer.py).

The twin mirrors the native module tree, so its parameter names are the native ones; each MLP is megatron's
``ColumnParallelLinear`` -> GELU -> ``RowParallelLinear`` pair, the rest (patch embedding, norms, head) plain torch
modules replicated on every TP rank. Which tensors are split, and how, comes from the family's own TP plan
(``MLPMixer.tp_plan``: ``colwise`` / ``rowwise``), the plan FSDP2's DTensor TP applies too::

    native (MLPMixer)                           twin chunk on TP rank r of T (PP = 1)
    patch_embed.{weight,bias}                ->  patch_embed                    (replicated, nn.Linear)
    position.weight  (position_embedding)    ->  position                       (replicated, nn.Embedding)
    blocks.L.{token,channel}_norm            ->  blocks.L.{token,channel}_norm  (replicated, nn.LayerNorm)
    blocks.L.X_mlp.fc1.weight  [W, S]        ->  ColumnParallelLinear weight    rows    [r*W/T, (r+1)*W/T)
    blocks.L.X_mlp.fc1.bias    [W]           ->  ColumnParallelLinear bias      entries [r*W/T, (r+1)*W/T)
    blocks.L.X_mlp.fc2.weight  [S, W]        ->  RowParallelLinear weight       columns [r*W/T, (r+1)*W/T)
    blocks.L.channel_mlp.fc2.bias [D]        ->  RowParallelLinear bias         (replicated, added after the reduce)
    norm, head                               ->  norm, head                     (replicated)

    X in {token, channel}; (S, W) = (P, T) for the token MLP, (D, C) for the channel MLP.

``state_dict`` all-gathers the split tensors over the TP group of data-parallel rank 0 and returns the native
state dict (names and order) on global rank 0. The chunk's ``sharded_state_dict`` (what MegatronStrategy's
dist-checkpoints store) reaches every parallel linear through the plain containers, so each is saved split over TP
and the checkpoint loads at any TP x DP layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mixer import IGNORE_INDEX, MixerConfig, MLPMixer, classification_loss
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from forge_lightning.contracts import LOSS_AND_COUNT, MegatronBuild, MegatronDims
from forge_lightning.modules.objective import GlobalBatchLoss

HF_MODEL_TYPE = "forge_test_mixer"
# Kinds of tensors between the native module and one TP rank's twin: whole, rows (dim 0) split, columns split.
REPLICATED, ROWS, COLUMNS = "replicated", "rows", "columns"


# ----------------------------------------------------------------------------------------------- layout


def check_layout(dims: MegatronDims, build: MegatronBuild) -> None:
    """Refuse what the twin does not implement, naming the option (TP and DP, with or without the distributed
    optimizer, are supported).

    Raises:
        NotImplementedError: pipeline, context or expert parallelism, sequence parallelism, TransformerEngine, or a
            composed model.
    """
    refused = {
        "pipeline_model_parallel_size": (dims.pp > 1, "the twin is one stage"),
        "virtual_pipeline_model_parallel_size": (dims.vpp > 1, "the twin is one stage"),
        "context_parallel_size": (
            dims.cp > 1,
            "the mixer has no sequence to split (its MLPs mix all patches)",
        ),
        "expert_model_parallel_size": (dims.ep > 1, "the mixer has no experts"),
        "expert_tensor_parallel_size": (
            dims.expert_tensor_parallel_size not in (None, dims.tp),
            "the mixer has no experts",
        ),
        "sequence_parallel": (
            dims.sequence_parallel,
            "the token-mixing MLP mixes over the patch dimension that sequence parallelism would split",
        ),
        "use_transformer_engine": (
            bool(build.use_transformer_engine),
            "the twin has no TransformerEngine layers",
        ),
    }
    for option, (bad, why) in refused.items():
        if bad:
            value = getattr(dims, option, None) if option != "use_transformer_engine" else True
            raise NotImplementedError(
                f"{option}={value} is not supported by the MLP-Mixer's megatron twin ({why}); use "
                "tensor_model_parallel_size and data parallelism (optionally use_distributed_optimizer)"
            )
    if build.composition is not None:
        raise NotImplementedError(
            "the MLP-Mixer's megatron twin does not stand for the decoder of a composed model"
        )


def weight_kind(name: str, tp_plan: dict[str, str]) -> str:
    """How native tensor ``name`` is split over TP ranks, from the block-relative TP plan (``colwise``: weight
    rows and bias entries; ``rowwise``: weight columns, bias whole)."""
    parts = name.split(".")
    if parts[0] == "blocks" and len(parts) > 3:
        style = tp_plan.get(".".join(parts[2:-1]))
        if style == "colwise":
            return ROWS
        if style == "rowwise":
            return COLUMNS if parts[-1] == "weight" else REPLICATED
        if style is not None:
            raise ValueError(f"{name}: TP style {style!r} has no megatron mapping in the mixer twin")
    return REPLICATED


# ----------------------------------------------------------------------------------------------- the chunk


def _megatron_chunk_class() -> type:
    """The chunk class (defined here: megatron-core is imported when the twin is built)."""
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.module import MegatronModule

    class ParallelMLP(nn.Module):
        """``fc2(gelu(fc1(x)))``: fc1 splits the hidden width over TP ranks, fc2 all-reduces its output."""

        def __init__(self, size: int, hidden: int, tf_config: Any, *, out_bias: bool = True) -> None:
            super().__init__()
            init = nn.init.zeros_  # overwritten by the native weights (megatron's init also tags TP tensors)
            self.fc1 = ColumnParallelLinear(
                size, hidden, config=tf_config, init_method=init, bias=True, gather_output=False
            )
            self.fc2 = RowParallelLinear(
                hidden, size, config=tf_config, init_method=init, bias=out_bias, input_is_parallel=True,
                skip_bias_add=False,
            )  # fmt: skip

        def forward(self, x: Tensor) -> Tensor:  # x: [b, n, size], 3-D as megatron's linears expect
            hidden, _ = self.fc1(x)
            out, _ = self.fc2(F.gelu(hidden))
            return out

    class ParallelMixerBlock(nn.Module):
        def __init__(self, config: MixerConfig, tf_config: Any, recompute: bool) -> None:
            super().__init__()
            self.recompute = recompute
            self.token_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.token_mlp = ParallelMLP(
                config.num_patches, config.token_hidden_size, tf_config, out_bias=False
            )
            self.channel_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.channel_mlp = ParallelMLP(config.hidden_size, config.channel_hidden_size, tf_config)

        def _forward(self, x_BPD: Tensor) -> Tensor:
            mixed_BDP = self.token_mlp(self.token_norm(x_BPD).transpose(1, 2).contiguous())
            x_BPD = x_BPD + mixed_BDP.transpose(1, 2)
            return x_BPD + self.channel_mlp(self.channel_norm(x_BPD))

        def forward(self, x_BPD: Tensor) -> Tensor:
            if self.recompute and torch.is_grad_enabled():
                return checkpoint(self._forward, x_BPD, use_reentrant=False)  # no dropout: no RNG to replay
            return self._forward(x_BPD)

    class MixerChunk(MegatronModule):
        """The whole mixer as one megatron chunk (PP = 1): patches ``[b, P, F]`` -> logits ``[b, K]``."""

        def __init__(self, config: MixerConfig, tf_config: Any, recompute: bool) -> None:
            super().__init__(config=tf_config)
            self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
            self.mixer_config = config
            self.patch_embed = nn.Linear(config.patch_dim, config.hidden_size)
            if config.position_embedding:
                self.position = nn.Embedding(config.num_patches, config.hidden_size)
            self.blocks = nn.ModuleList(
                ParallelMixerBlock(config, tf_config, recompute) for _ in range(config.num_layers)
            )
            self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.head = nn.Linear(config.hidden_size, config.num_classes)

        def set_input_tensor(self, input_tensor: Any) -> None:
            pass  # one stage: no activations arrive from a previous one

        def sharded_state_dict(
            self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
        ) -> dict[str, Any]:
            """The chunk's tensors for megatron's dist-checkpoint, each parallel linear's split over TP.

            megatron's default (``MegatronModule.sharded_state_dict``) stores every child that is not a megatron
            module (here ``blocks``, a ``ModuleList``) as tensors replicated whole over the TP ranks, so TP rank 0's
            shards of the parallel linears inside would be saved as the full tensors; this recursion reaches them.
            """
            return {
                key: value
                for name, child in self.named_children()
                for key, value in _sharded(child, f"{prefix}{name}.", sharded_offsets, metadata).items()
            }

        def forward(self, patches_BPF: Tensor) -> Tensor:
            x_BPD = self.patch_embed(patches_BPF)
            if self.mixer_config.position_embedding:
                x_BPD = x_BPD + self.position.weight
            for block in self.blocks:
                x_BPD = block(x_BPD)
            return self.head(self.norm(x_BPD).mean(dim=1))

    return MixerChunk


def _sharded(module: nn.Module, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> dict[str, Any]:
    """``module``'s sharded state: its own ``sharded_state_dict`` (megatron's parallel linears), its children's
    for a container, or megatron's default (tensors replicated over TP) for a leaf such as a norm."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import sharded_state_dict_default

    if hasattr(module, "sharded_state_dict") or not any(True for _ in module.children()):
        # The TP group named: without it megatron gives every TP rank replica id 0 (all would write).
        tp_group = parallel_state.get_tensor_model_parallel_group()
        return sharded_state_dict_default(module, prefix, sharded_offsets, metadata, tp_group=tp_group)
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"{prefix}: a container with parameters of its own has no checkpoint layout in the twin"
        )
    return {
        key: value
        for name, child in module.named_children()
        for key, value in _sharded(child, f"{prefix}{name}.", sharded_offsets, metadata).items()
    }


def unwrap(chunk: nn.Module) -> nn.Module:
    """The ``MixerChunk`` inside megatron's wrappers (DDP, Float16Module)."""
    while hasattr(chunk, "module") and not hasattr(chunk, "blocks"):
        chunk = chunk.module
    return chunk


# ----------------------------------------------------------------------------------------------- the twin


class MixerTwin:
    """The megatron-core twin of an :class:`~mixer.MLPMixer` (a ``MegatronTwin``).

    Args:
        native: the module's plain model (its weights are copied into the chunks).
        build: the strategy's layout and settings.
        objective: the module's loss bookkeeping, which receives each step's and evaluation's sums.

    Raises:
        NotImplementedError: a layout the twin does not implement (see :func:`check_layout`).
        ValueError: a ``performance`` value the twin cannot honour (named).
    """

    # What the twin applies of `performance` (the strategy applies `optimizer`, `attention.sdpa`, `compile: false`).
    performance_switches = frozenset({"activation_checkpointing"})

    def __init__(self, native: MLPMixer, build: MegatronBuild, *, objective: GlobalBatchLoss) -> None:
        check_layout(build.dims, build)
        self.native = native
        self.config: MixerConfig = native.config
        self.build = build
        self.objective = objective
        self.tp_plan = native.tp_plan()
        perf = build.performance
        checkpointing = "none" if perf is None else perf.activation_checkpointing
        if checkpointing == "selective":
            raise ValueError(
                "performance.activation_checkpointing ('selective') is not applied by the MLP-Mixer's megatron "
                "twin: use 'full' (each block recomputed in backward) or 'none'"
            )
        self.recompute = "full" in (checkpointing, build.recompute)

    def transformer_config(self) -> Any:
        """megatron-core's ``TransformerConfig`` of the chunks: the parallel layout, the per-item loss (the schedule
        divides by the global batch's count: ``calculate_per_token_loss``) and no fused kernels."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        dims = self.build.dims
        return TransformerConfig(
            num_layers=self.config.num_layers,
            hidden_size=self.config.hidden_size,
            # A TransformerConfig needs attention heads divisible by TP; the mixer has none, and nothing reads it.
            num_attention_heads=dims.tp,
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=1,
            bf16=self.build.bf16,
            pipeline_dtype=torch.bfloat16 if self.build.bf16 else torch.float32,
            use_cpu_initialization=self.build.device.type != "cuda",
            calculate_per_token_loss=True,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )

    # ----- building ---------------------------------------------------------------------------------------------
    def build_chunks(self) -> list[nn.Module]:
        """The one chunk of this rank (PP = 1) holding its TP shard of the native weights."""
        from megatron.core.transformer.module import Float16Module

        chunk_cls = _megatron_chunk_class()
        tf_config = self.transformer_config()
        chunk = chunk_cls(self.config, tf_config, self.recompute).to(self.build.device)
        self._load(chunk)
        return [Float16Module(tf_config, chunk) if self.build.bf16 else chunk]

    def _tp(self) -> tuple[int, int]:
        from megatron.core import parallel_state

        return (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
        )

    def _rules(self, chunk: nn.Module) -> Iterator[tuple[str, str, nn.Parameter]]:
        """(native name, kind, twin parameter) of every twin parameter, in the native order."""
        params = dict(unwrap(chunk).named_parameters())
        native = [name for name, _ in self.native.named_parameters()]
        if sorted(params) != sorted(native):
            raise ValueError(
                f"the twin's parameters {sorted(set(params) ^ set(native))} have no native counterpart (or reverse)"
            )
        for name in native:
            yield name, weight_kind(name, self.tp_plan), params[name]

    @torch.no_grad()
    def _load(self, chunk: nn.Module) -> None:
        """Copy this TP rank's share of every native tensor into the chunk."""
        rank, size = self._tp()
        state = self.native.state_dict()
        for name, kind, param in self._rules(chunk):
            full = state[name]
            if kind == ROWS:
                shard = full.chunk(size, dim=0)[rank]
            elif kind == COLUMNS:
                shard = full.chunk(size, dim=-1)[rank]
            else:
                shard = full
            split = getattr(param, "tensor_model_parallel", False) and size > 1
            if split != (kind != REPLICATED and size > 1) or shard.shape != param.shape:
                raise ValueError(
                    f"{name}: the rule {kind!r} gives a shard of shape {tuple(shard.shape)}, the twin's parameter is "
                    f"{tuple(param.shape)} (tensor_model_parallel={getattr(param, 'tensor_model_parallel', False)})"
                )
            param.copy_(shard)

    # ----- the schedule -----------------------------------------------------------------------------------------
    def forward_step(self, batch: dict[str, Tensor], chunk: nn.Module) -> tuple[Tensor, Callable]:
        """Logits of one micro-batch and its loss function (the family's :func:`~mixer.classification_loss`)."""
        labels_B = batch["labels"]
        logits_BK = chunk(batch["patches"])

        def loss_function(logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            loss_sum, count = classification_loss(logits, labels_B)
            pair = torch.stack([loss_sum.detach().double(), count.double()])
            return loss_sum, count.to(torch.int), {LOSS_AND_COUNT: pair}

        return logits_BK, loss_function

    def after_schedule(
        self, chunks: list[nn.Module], sums: Tensor, *, training: bool, num_micro_batches: int
    ) -> None:
        """Hand the sums to the module's objective, which logs them as natively."""
        if training:
            self.objective.record_train(sums)
        else:
            self.objective.record_eval(sums)

    def micro_batch_shape(self, batch: dict[str, Tensor]) -> tuple[int, int]:
        """``(b, P)`` of the patches."""
        micro_batch, num_patches, _ = batch["patches"].shape
        return micro_batch, num_patches

    def padding_batch(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``batch`` with every sample unlabelled: no loss, no count."""
        return {**batch, "labels": torch.full_like(batch["labels"], IGNORE_INDEX)}

    # ----- export and checkpoints -------------------------------------------------------------------------------
    @torch.no_grad()
    def state_dict(self, chunks: list[nn.Module]) -> dict[str, Tensor]:
        """The native state dict (names, order) on global rank 0 (CPU), empty elsewhere. Collective: the TP group
        of data-parallel rank 0 all-gathers each split tensor; the other data-parallel ranks take no part."""
        from megatron.core import parallel_state

        if parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0:
            return {}
        group = parallel_state.get_tensor_model_parallel_group()
        _, size = self._tp()
        state = {}
        for name, kind, param in self._rules(chunks[0]):
            tensor = param.detach()
            if kind != REPLICATED and size > 1:
                shards = [torch.empty_like(tensor) for _ in range(size)]
                dist.all_gather(shards, tensor.contiguous(), group=group)
                tensor = torch.cat(shards, dim=0 if kind == ROWS else -1)
            state[name] = tensor.cpu().clone()
        return state if dist.get_rank() == 0 else {}

    def hf_config(self) -> dict[str, Any]:
        return {"model_type": HF_MODEL_TYPE, **self.config.to_dict()}

    def check_checkpoint_config(self, saved: dict[str, Any]) -> None:
        if saved.get("model_type") != HF_MODEL_TYPE:
            raise ValueError(
                f"model_type: checkpoint {saved.get('model_type')!r}, this model {HF_MODEL_TYPE!r}"
            )
        ours = self.config.to_dict()
        differing = [
            f"{field.name}: checkpoint {saved.get(field.name)!r}, this model {ours[field.name]!r}"
            for field in dataclasses.fields(MixerConfig)
            if saved.get(field.name) != ours[field.name]
        ]
        if differing:
            raise ValueError("; ".join(differing))

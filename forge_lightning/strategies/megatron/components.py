"""Heterogeneous per-component parallelism under ``MegatronStrategy`` (the strategy's ``components`` option).

A composed model (encoder -> projector -> decoder LM, declared by its plan's
:class:`~forge_lightning.modules.plan.Composition`) trains with its decoder as the megatron-core twin at the
strategy's TP size and every other component as it is (plain PyTorch, TP = 1), replicated on the T ranks of the
decoder's TP group, each of which encodes a share of the micro-batch::

    one micro-batch of b samples (the same on the T ranks of a TP group)
      TP rank r: samples [r*c, (r+1)*c), c = ceil(b / T)   (short ranks pad with copies of the last sample)
        composition.encode (encoder, projector; TP = 1)        -> [c, N, H]
      all-gather over the TP group (GatherSamples)              -> [T*c, N, H] -> first b rows
                                                                   backward: each rank keeps its own rows' gradient
      composition.merge(twin's token embeddings, encoded)      -> decoder input [T', b, H] (sequence first)
      GPTModel(decoder_input=...) at TP = T                     -> per-token loss [b, T']

Why each rank keeps only its own rows' gradient: the decoder's input is replicated over the TP group and its
column-parallel linears all-reduce their input gradient over it, so every TP rank holds the *whole* gradient of the
loss w.r.t. the gathered encoder output (the same on all of them). Rank r back-propagates rows r*c ... through its
encoder; the sum of the T ranks' encoder gradients is then the micro-batch's, as on one process. Padding rows are
dropped after the gather and get a zero gradient.

Gradients. The twin's are reduced over the data-parallel group by its megatron DDP, as without components. The
encoder side (every non-decoder component, one megatron ``DistributedDataParallel`` over their trainable parameters)
is held by every rank of the TP x DP group, so its DDP reduces (sums) over that group. Both are then divided by the
global batch's trainable tokens (megatron's per-token loss): megatron's ``finalize_model_grads`` does it for the twin,
:meth:`Components.finalize` for the encoder side. One megatron optimizer holds the twin's and the encoder side's
trainable parameters (frozen ones have ``requires_grad`` off and get no state); its gradient norm counts a replicated
parameter once (on TP rank 0), as megatron does for the twin's replicated norms.

Checkpoints. The encoder side's parameters (frozen ones too) are saved in the same megatron dist-checkpoint as the
twin, under ``components.<name>.<parameter>`` as tensors replicated over the TP x DP group (only TP rank 0 of DP
rank 0 writes them), and their optimizer state beside them (see checkpoint.py); they load at any decoder layout.
``full_model_state_dict`` gives the LightningModule's own state-dict names (:meth:`Components.full_state_dict`).

Options (``components: {NAME: {...}}``, NAME a component of the module's plan):

* ``tensor_model_parallel_size``: the decoder runs at the strategy's TP size; the others at 1 (larger sizes, which
  need a tensor-parallel twin of the component, are not supported yet). Must divide the strategy's.
* ``recompute``: ``none`` or ``full``: the decoder with megatron's full recompute (every layer), another component
  with activation checkpointing of each of its plan's blocks.
* ``freeze``: ``true`` / ``false`` (default: as the module's plan declares): ``requires_grad`` off, so no gradient,
  no gradient reduce and no optimizer state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from forge_lightning.modules.plan import Component, Composition, ParallelPlan
from forge_lightning.performance.transforms import apply_activation_checkpointing

OPTIONS = ("tensor_model_parallel_size", "recompute", "freeze")
RECOMPUTE = ("none", "full")
# megatron's full recompute of the twin: every layer's forward is recomputed in backward.
_FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
# Marks a block already wrapped for recompute (the strategy's setup runs once per fit / validate call).
_RECOMPUTED = "_forge_megatron_recompute"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComponentOptions:
    """One component's entry of the strategy's ``components`` option (see the module docstring).

    Args:
        tensor_model_parallel_size: ``None``: the decoder's is the strategy's, the others' 1.
        recompute: ``none`` or ``full``.
        freeze: ``None``: as the module's plan declares.
    """

    tensor_model_parallel_size: int | None = None
    recompute: str = "none"
    freeze: bool | None = None


def parse_components(
    raw: Mapping[str, Any] | None, tensor_model_parallel_size: int
) -> dict[str, ComponentOptions]:
    """Check the shape and values of the strategy's ``components`` option (names are checked against the module's
    plan by :func:`resolve_components`).

    Args:
        raw: ``{component name: {option: value}}`` (``None``: no options).
        tensor_model_parallel_size: the strategy's TP size (the decoder's).

    Raises:
        TypeError: not a mapping of mappings.
        ValueError: an unknown option or an invalid value, named in the message.
    """
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise TypeError(f"components must map component names to their options, got {raw!r}")
    parsed = {}
    for name, entry in raw.items():
        entry = {} if entry is None else entry
        if not isinstance(entry, Mapping):
            raise TypeError(
                f"components.{name} must be a mapping of options ({', '.join(OPTIONS)}), got {entry!r}"
            )
        unknown = sorted(set(entry) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"components.{name}: unknown option(s) {unknown}; the options are {list(OPTIONS)}"
            )
        tp = entry.get("tensor_model_parallel_size")
        if tp is not None:
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise ValueError(
                    f"components.{name}.tensor_model_parallel_size must be a positive integer, got {tp!r}"
                )
            if tensor_model_parallel_size % tp:
                raise ValueError(
                    f"components.{name}.tensor_model_parallel_size ({tp}) must divide the strategy's "
                    f"tensor_model_parallel_size ({tensor_model_parallel_size}): a component's TP group is a part of "
                    "the decoder's, and the ranks of the rest share its samples"
                )
        recompute = entry.get("recompute", "none")
        if recompute not in RECOMPUTE:
            raise ValueError(
                f"components.{name}.recompute must be one of {list(RECOMPUTE)}, got {recompute!r}"
            )
        freeze = entry.get("freeze")
        if freeze is not None and not isinstance(freeze, bool):
            raise ValueError(f"components.{name}.freeze must be true, false or null, got {freeze!r}")
        parsed[name] = ComponentOptions(tensor_model_parallel_size=tp, recompute=recompute, freeze=freeze)
    return parsed


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedComponent:
    """A plan component with its settings under the strategy."""

    component: Component
    decoder: bool
    tensor_model_parallel_size: int
    recompute: str
    frozen: bool


def resolve_components(
    plan: ParallelPlan, options: Mapping[str, ComponentOptions], degrees: Mapping[str, Any]
) -> list[ResolvedComponent]:
    """Every component of ``plan`` with its settings: its ``options`` entry over the plan's defaults.

    Args:
        plan: the module's parallel plan (its composition names the decoder; a plan of one component is the
            decoder).
        options: the parsed ``components`` option.
        degrees: the strategy's options (``tensor_model_parallel_size``, ...).

    Raises:
        ValueError: an unknown component name, a decoder TP other than the strategy's, recompute of a frozen or
            block-less encoder-side component, nothing left to train, a plan of several components without a
            composition.
        NotImplementedError: an encoder-side TP size > 1, or a layout not supported with components.
    """
    names = [c.name for c in plan]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"components names {unknown}, but the module's plan has the components {names}")
    if plan.composition is not None:
        decoder = plan.composition.decoder
        _check_composed_layout(degrees)
    elif len(names) == 1:
        decoder = names[0]
    else:
        raise ValueError(
            f"the module's plan has the components {names} but no composition: MegatronStrategy needs to know which "
            "one is the decoder LM and how the others feed it (ParallelPlan.composition)"
        )
    tp = degrees["tensor_model_parallel_size"]
    resolved = [
        _resolve(comp, options.get(comp.name, ComponentOptions()), comp.name == decoder, tp) for comp in plan
    ]
    if all(r.frozen for r in resolved):
        raise ValueError(f"every component is frozen ({names}): nothing to train")
    return resolved


def _resolve(comp: Component, opts: ComponentOptions, is_decoder: bool, tp: int) -> ResolvedComponent:
    """One component's settings (see :func:`resolve_components`); ``tp`` is the strategy's TP size."""
    frozen = comp.frozen if opts.freeze is None else opts.freeze
    comp_tp = opts.tensor_model_parallel_size or (tp if is_decoder else 1)
    where = f"components.{comp.name}"
    if is_decoder and comp_tp != tp:
        raise ValueError(
            f"{where}.tensor_model_parallel_size ({comp_tp}): {comp.name!r} is the decoder, which runs at the "
            f"strategy's tensor_model_parallel_size ({tp}); set that instead"
        )
    if not is_decoder and comp_tp != 1:
        raise NotImplementedError(
            f"{where}.tensor_model_parallel_size={comp_tp}: components other than the decoder run unsharded (TP = 1, "
            "data-parallel over the decoder's TP group); a TP size > 1 needs a tensor-parallel twin of the "
            "component, which is not yet supported"
        )
    if not is_decoder and opts.recompute != "none" and frozen:
        raise ValueError(
            f"{where}: recompute={opts.recompute!r} on a frozen component does nothing (no gradient flows into it, "
            "so it keeps no activations for backward); drop one of the two"
        )
    if not is_decoder and opts.recompute != "none" and not comp.blocks:
        raise ValueError(
            f"{where}: recompute={opts.recompute!r}, but the module's plan declares no blocks for {comp.name!r} "
            "(activation checkpointing wraps each block)"
        )
    return ResolvedComponent(
        component=comp,
        decoder=is_decoder,
        tensor_model_parallel_size=comp_tp,
        recompute=opts.recompute,
        frozen=frozen,
    )


def _check_composed_layout(degrees: Mapping[str, Any]) -> None:
    """Refuse the layouts a composed model cannot run at yet, naming the option."""
    refused = {
        "pipeline_model_parallel_size": degrees["pipeline_model_parallel_size"] > 1,
        "context_parallel_size": degrees["context_parallel_size"] > 1,
    }
    for option, on in refused.items():
        if on:
            raise NotImplementedError(
                f"{option}={degrees[option]} is not yet supported with a composed model (components feeding a "
                "decoder LM) under MegatronStrategy: the encoder side runs outside megatron's pipeline and context-"
                "parallel split; use tensor / data (and expert) parallelism and the distributed optimizer"
            )


# ------------------------------------------------------------------------------------------------ hand-over


def sample_rows(batch_size: int, rank: int, size: int) -> Tensor:
    """The rows of a micro-batch that rank ``rank`` of ``size`` encodes: ``ceil(batch_size / size)`` of them,
    consecutive, the last ones repeated when the batch runs out (``batch_size`` 3, ``size`` 2: ``[0, 1]``, ``[2, 2]``).
    """
    per_rank = -(-batch_size // size)
    return torch.arange(rank * per_rank, (rank + 1) * per_rank).clamp(max=batch_size - 1)


class GatherSamples(torch.autograd.Function):
    """All-gather each rank's ``[c, ...]`` rows over ``group`` into ``[size * c, ...]`` (in rank order).

    Backward returns each rank the gradient of its own rows, unreduced: it assumes every rank of ``group`` holds the
    whole (identical) gradient of the gathered tensor, which is the case for the input of megatron's TP decoder.
    """

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any) -> Tensor:
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.chunk(ctx.size)[ctx.rank].contiguous(), None


def encode_over_group(
    encode: Callable[[dict[str, Tensor]], Tensor], batch: dict[str, Tensor], group: Any
) -> Tensor:
    """``encode(batch)``, each rank of ``group`` encoding its :func:`sample_rows` and all of them the gathered result.

    Args:
        encode: the composition's ``encode``.
        batch: one micro-batch, the same on every rank of ``group``; its size is that of ``input_ids``.
        group: the ranks sharing the work (the decoder's TP group).
    """
    size = dist.get_world_size(group)
    if size == 1:
        return encode(batch)
    batch_size = batch["input_ids"].shape[0]
    rows = sample_rows(batch_size, dist.get_rank(group), size)
    local = {
        k: v.index_select(0, rows.to(v.device))
        if isinstance(v, Tensor) and v.ndim and len(v) == batch_size
        else v
        for k, v in batch.items()
    }
    return GatherSamples.apply(encode(local), group)[:batch_size]


# ------------------------------------------------------------------------------------------------ runtime


class Components:
    """The module's components under the strategy: the decoder's build settings and, for a composed model, the
    encoder side (its DDP, the hand-over and the schedule's forward step). See the module docstring.

    For a module without composition (``CausalLM``) only the decoder's options apply and every hook is a no-op.

    Args:
        module: the LightningModule.
        options: the parsed ``components`` option.
        degrees: the strategy's options.
    """

    def __init__(
        self, module: nn.Module, options: Mapping[str, ComponentOptions], degrees: Mapping[str, Any]
    ):
        plan_fn = getattr(module, "parallel_plan", None)
        plan = plan_fn() if callable(plan_fn) else None
        if plan is None and options:
            raise ValueError(
                f"components names {sorted(options)}, but {type(module).__name__} has no parallel_plan() to name "
                "its components"
            )
        self.module = module
        # A plan of several components without composition and options is not one of ours: build_chunks says what
        # the strategy trains.
        ours = plan is not None and (options or plan.composition is not None or len(plan.components) == 1)
        self.resolved = resolve_components(plan, options, degrees) if ours else []
        self.composition: Composition | None = plan.composition if plan is not None else None
        # The encoder side's megatron DDP (none when all of it is frozen).
        self.encoder_ddp: list[nn.Module] = []
        self._bf16 = False

    @property
    def composed(self) -> bool:
        return self.composition is not None

    def _decoder(self) -> ResolvedComponent | None:
        return next((r for r in self.resolved if r.decoder), None)

    def _encoder_side(self) -> list[ResolvedComponent]:
        return [r for r in self.resolved if not r.decoder]

    # ----- building ---------------------------------------------------------------------------------------------
    def decoder_source(self) -> Any:
        """What ``build_chunks`` builds the twin from: the module itself, or for a composed model its decoder LM
        (``config`` and HF-named ``model``; its weights must be materialised)."""
        if not self.composed:
            return self.module
        decoder = self._decoder().component
        if any(p.is_meta for p in decoder.module.parameters()):
            raise NotImplementedError(
                f"the decoder component {decoder.name!r} is on the meta device: per-rank pretrained loading is not yet "
                "supported for a composed model under MegatronStrategy; build the module with materialised weights"
            )
        return SimpleNamespace(config=decoder.module.config, model=decoder.module)

    def decoder_config_overrides(self) -> dict[str, Any]:
        """``TransformerConfig`` fields of the decoder's options (full recompute)."""
        decoder = self._decoder()
        return dict(_FULL_RECOMPUTE) if decoder is not None and decoder.recompute == "full" else {}

    def prepare_decoder(self, chunks: list[nn.Module]) -> None:
        """Freeze the twin when asked (before its DDP wraps it); for a composed model under sequence parallelism,
        keep the token embeddings whole (the merge needs every position; :meth:`forward_step` scatters after it)."""
        from forge_lightning.modules.llm.megatron import unwrap

        decoder = self._decoder()
        for chunk in chunks:
            if decoder is not None and decoder.frozen:
                chunk.requires_grad_(False)
            gpt = unwrap(chunk)
            if self.composed and getattr(gpt, "pre_process", False):
                gpt.embedding.word_embeddings.reduce_scatter_embeddings = False

    def wrap_encoders(self, chunks: list[nn.Module], *, device: torch.device, bf16: bool) -> None:
        """Freeze / recompute the encoder-side components and wrap their trainable parameters in a megatron DDP
        that reduces over the TP x DP group (every rank holds a replica)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from forge_lightning.modules.llm.megatron import unwrap

        self._bf16 = bf16
        side = self._encoder_side()
        if not side:
            return
        for r in side:
            _prepare_encoder_component(r)
        modules = nn.ModuleDict({r.component.name: r.component.module for r in side}).to(device)
        self.encoder_ddp = []
        if not any(p.requires_grad for p in modules.parameters()):
            return
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
        ddp = DistributedDataParallel(
            unwrap(chunks[0]).config,
            ddp_config,
            modules,
            disable_bucketing=True,
            pg_collection=_replica_groups(),
        )
        ddp.broadcast_params()
        self.encoder_ddp = [ddp]

    # ----- training ---------------------------------------------------------------------------------------------
    def connect(self, chunks: list[nn.Module]) -> None:
        """Make the schedule's gradient finalisation also finish and scale the encoder side's gradients."""
        from forge_lightning.modules.llm.megatron import unwrap

        if not self.encoder_ddp:
            return
        config = unwrap(chunks[0]).config
        config.finalize_model_grads_func = partial(self.finalize, config.finalize_model_grads_func)

    def finalize(
        self,
        finalize_decoder: Callable[..., Any],
        model: list[nn.Module],
        num_tokens: Tensor | None,
        **kwargs: Any,
    ) -> None:
        """megatron's ``finalize_model_grads`` for the twin, then the encoder side: its all-reduce over TP x DP and
        the division by the global batch's trainable tokens (counted over DP, as for the twin)."""
        from megatron.core import parallel_state

        tokens = None if num_tokens is None else num_tokens.clone()
        finalize_decoder(model, num_tokens, **kwargs)
        if tokens is not None:
            dist.all_reduce(tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        for ddp in self.encoder_ddp:
            ddp.finish_grad_sync()
            if tokens is not None and tokens > 0:
                ddp.scale_gradients(1.0 / tokens)

    def zero_grad_buffers(self) -> None:
        for ddp in self.encoder_ddp:
            ddp.zero_grad_buffer()

    def forward_step(
        self, ignore_index: int, data_iterator: Iterator[dict[str, Tensor]], model: nn.Module
    ) -> tuple:
        """megatron's ``forward_step_func`` of a composed model: encode (shared over the TP group), merge with the
        twin's token embeddings, run the twin on the merged inputs; the loss function as in ``schedule.py``."""
        from megatron.core import parallel_state

        from forge_lightning.modules.llm.megatron import unwrap
        from forge_lightning.strategies.megatron.schedule import masked_loss_sum

        batch = next(data_iterator)
        if batch.get("document_ids") is not None:
            raise NotImplementedError(
                "packed batches (document_ids) of a composed model (encoder -> projector -> LLM) are not yet "
                "supported by MegatronStrategy: the merge changes the sequence, so the document ids would not match"
            )
        gpt = unwrap(model)
        with self._autocast(batch["input_ids"].device):
            encoded = encode_over_group(
                self.composition.encode, batch, parallel_state.get_tensor_model_parallel_group()
            )
        # The twin's token embeddings, whole on every TP rank (all-reduced, not scattered: see prepare_decoder).
        tokens_BSH = gpt.embedding.word_embeddings(batch["input_ids"])
        inputs_BTH, labels_BT = self.composition.merge(tokens_BSH, encoded.to(tokens_BSH.dtype), batch)
        mask = labels_BT != ignore_index
        decoder_input = _decoder_input(gpt, inputs_BTH)
        # Ignored positions get a valid class id; their loss is masked out.
        output = model(None, None, None, decoder_input=decoder_input, labels=labels_BT.masked_fill(~mask, 0))
        return output, partial(masked_loss_sum, mask)

    def _autocast(self, device: torch.device) -> Any:
        """bf16 runs: the encoder side keeps fp32 parameters (megatron's optimizer steps them as fp32) and computes
        under autocast; its output is cast to the twin's dtype for the merge."""
        if not self._bf16:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    # ----- checkpoints and export ---------------------------------------------------------------------------------
    def decoder_config(self) -> Any:
        """The decoder's ``LLMConfig`` (written as a checkpoint's ``config.json`` and checked on load)."""
        return self._decoder().component.module.config if self.composed else self.module.config

    def encoder_modules(self) -> dict[str, nn.Module]:
        """The encoder side's modules by component name (frozen ones included), in the plan's order; empty for a
        module without composition. Checkpoints store them as replicated tensors (see checkpoint.py)."""
        return {r.component.name: r.component.module for r in self._encoder_side()}

    def frozen(self) -> list[str]:
        """The names of the frozen components (no optimizer state), as the checkpoint records them."""
        return sorted(r.component.name for r in self.resolved if r.frozen)

    def full_state_dict(self, decoder_hf: dict[str, Tensor], module: nn.Module | None) -> dict[str, Tensor]:
        """A composed model's full state dict under the native module's names, from the twin's Hugging Face export.

        The decoder's tensors go under its module's prefix in the LightningModule (``model.llm.``) in the native
        layout (a MoE layer's experts fused into 3-D tensors, a tied ``lm_head.weight`` beside the embedding), the
        encoder side's are this rank's replica of them: the LightningModule's own ``state_dict()`` keys, which
        ``load_state_dict(strict=True)`` takes back.

        Args:
            decoder_hf: ``export_hf_state`` of the twin (full on global rank 0, empty elsewhere).
            module: ``None`` (or the LightningModule) for every key; a submodule for its keys, relative to it.

        Returns:
            The state dict on global rank 0 (CPU), an empty dict elsewhere.
        """
        from forge_lightning.modules.llm.hf import _EMBEDDING, _TIED_HEAD, fuse_experts

        prefixes = {id(sub): name for name, sub in self.module.named_modules()}
        prefix = "" if module is None else prefixes.get(id(module))
        if prefix is None:
            raise ValueError(f"{type(module).__name__} is not a submodule of {type(self.module).__name__}")
        if dist.get_rank() != 0:
            return {}
        decoder = self._decoder().component.module
        native = fuse_experts(decoder_hf)
        order = list(decoder.state_dict())
        if decoder.config.tie_word_embeddings and _TIED_HEAD in order:
            native[_TIED_HEAD] = native[_EMBEDDING]
        parts = {id(decoder): {k: native[k] for k in order if k in native} | native}  # the native order
        for r in self._encoder_side():
            parts[id(r.component.module)] = {
                k: v.detach().cpu().clone() for k, v in r.component.module.state_dict().items()
            }
        full: dict[str, Tensor] = {}
        for name, sub in self.module.named_modules():  # the native state dict's order
            for key, tensor in parts.pop(id(sub), {}).items():
                full[f"{name}.{key}" if name else key] = tensor
        within = f"{prefix}." if prefix else ""
        return {k.removeprefix(within): v for k, v in full.items() if k.startswith(within)}


def _prepare_encoder_component(r: ResolvedComponent) -> None:
    """Freeze (or unfreeze), wrap the blocks for recompute and tag the embedding tables of one encoder-side
    component."""
    module = r.component.module
    if r.frozen or r.component.frozen:  # as asked: `freeze: false` unfreezes a component the plan freezes
        module.requires_grad_(not r.frozen)
    if r.recompute == "full":
        blocks = [b for b in r.component.blocks if not getattr(b, _RECOMPUTED, False)]
        apply_activation_checkpointing(
            ParallelPlan(components=[dataclasses.replace(r.component, blocks=blocks)]), "full"
        )
        for block in blocks:
            setattr(block, _RECOMPUTED, True)
    for sub in module.modules():  # the one no-decay rule: embedding tables are not decayed
        if isinstance(sub, nn.Embedding):
            sub.weight.no_weight_decay = True


def _decoder_input(gpt: nn.Module, inputs_BTH: Tensor) -> Tensor:
    """The twin's ``decoder_input`` from merged embeddings ``[b, T, H]``: sequence first, embedding dropout, and
    under sequence parallelism this TP rank's share of the sequence (what megatron's own embedding does)."""
    from megatron.core import tensor_parallel

    config = gpt.config
    x_TBH = inputs_BTH.transpose(0, 1).contiguous()
    if not config.sequence_parallel:
        return gpt.embedding.embedding_dropout(x_TBH)
    tp = config.tensor_model_parallel_size
    if x_TBH.shape[0] % tp:
        raise ValueError(
            f"sequence_parallel: the decoder's input length ({x_TBH.shape[0]}: the merged encoder and text positions) "
            f"must be divisible by tensor_model_parallel_size ({tp})"
        )
    x_TBH = tensor_parallel.scatter_to_sequence_parallel_region(x_TBH).clone()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        return gpt.embedding.embedding_dropout(x_TBH)


def _replica_groups() -> Any:
    """megatron's process groups for the encoder side's DDP: its data-parallel group is TP x DP (x CP), the ranks
    holding a replica of it; the rest as the twin's (no expert parameters on the encoder side)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection()
    groups.dp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=False)
    groups.dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    groups.expt_dp = parallel_state.get_expert_data_parallel_group()
    groups.tp = parallel_state.get_tensor_model_parallel_group()  # megatron's DDP logs with it
    groups.pp = parallel_state.get_pipeline_model_parallel_group()
    groups.ep = parallel_state.get_expert_model_parallel_group()
    return groups

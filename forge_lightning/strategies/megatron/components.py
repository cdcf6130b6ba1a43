"""Heterogeneous per-component parallelism under ``MegatronStrategy`` (the strategy's ``components`` option).

A composed model (encoder -> projector -> decoder, declared by its plan's
:class:`~forge_lightning.contracts.Composition`) trains with its decoder as the megatron-core model the module
provides (its twin) at the strategy's TP size and every other component as it is (plain PyTorch, TP = 1),
replicated on the T ranks of the decoder's TP group, each of which encodes a share of the micro-batch
(:meth:`Components.encode`, which the twin's forward step calls)::

    one micro-batch of b samples (the same on the T ranks of a TP group)
      TP rank r: samples [r*c, (r+1)*c), c = ceil(b / T)   (short ranks pad with copies of the last sample)
        composition.encode (encoder, projector; TP = 1)        -> [c, N, H]
      all-gather over the TP group (GatherSamples)              -> [T*c, N, H] -> first b rows
                                                                   backward: each rank keeps its own rows' gradient
      composition.merge(twin's token embeddings, encoded)      -> decoder input (the twin's forward step)
      the twin at TP = T                                        -> per-token loss

Which samples a rank encodes is cut by the composition's ``select`` (default: every tensor whose first dimension is
the batch size; a VLM takes each sample's own images from the batch's image tensor).

Pipeline parallelism (the decoupled encoder). With PP > 1 only the first stage merges the encoder's output into the
decoder's input. The encoder side's forward and backward run apart from megatron's schedule, so that they take no
place in the pipeline's slots, and where is the strategy's ``encoder_placement``::

    encode_ahead     every micro-batch of the step encoded before the schedule; graph kept, each output handed to
                     the first stage's forward step as a detached leaf that requires grad
                       spread (default)  every stage holds the encoder side; the TP x PP ranks each encode a run of
                                         the step's samples, gathered on the first stage (spread.py)
                       first_stage       only the first stage holds it and encodes all of them (over its TP group)
    the schedule     1F1B over the micro-batches; the first stage's backward leaves the gradient of the loss w.r.t.
                     the encoder output on each leaf
    backward_ahead   the encoder side back-propagated from those gradients (spread: each rank its own rows', sent
                     back from the first stage), then its gradient all-reduce and scaling (deferred from the
                     schedule's gradient finalisation)

``first_stage`` leaves the later stages idle while the first encodes: a bubble of (PP - 1) x the step's encoder time
(forward before the schedule, backward after it); ``spread`` gives every rank 1 / (TP x PP) of the step's samples
(the runs differ by one sample at most; no padding) for one gather of the features and one scatter of their
gradients over the PP group. The encoder side's replicas then span TP x PP x DP: its DDP reduces over all of them,
and on the later stages its parameters are marked ``shared`` so that megatron's gradient norm (summed over TP x PP)
counts them once.

The later stages take their labels from ``batch["labels"]``: the composition's merge must keep the text positions and
their labels (a VLM's features in place of its placeholder tokens do; a merge that prepends positions is refused).

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
twin, under ``components.<name>.<parameter>`` as replicated tensors (only TP rank 0 of DP rank 0 of the first stage
writes them), and their optimizer state beside them (see checkpoint.py); they load at any decoder layout and
placement.
``full_model_state_dict`` gives the LightningModule's own state-dict names (:meth:`Components.full_state_dict`),
the twin's part from its ``state_dict`` (under the decoder component's names).

Options (``components: {NAME: {...}}``, NAME a component of the module's plan):

* ``tensor_model_parallel_size``: the decoder runs at the strategy's TP size; the others at 1 (larger sizes, which
  need a tensor-parallel twin of the component, are not supported yet). Must divide the strategy's.
* ``recompute``: ``none`` or ``full``: the decoder with the twin's full recompute (megatron's, every layer), another
  component with activation checkpointing of each of its plan's blocks.
* ``freeze``: ``true`` / ``false`` (default: as the module's plan declares): ``requires_grad`` off, so no gradient,
  no gradient reduce and no optimizer state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from forge_lightning.contracts import Component, Composition, MegatronDims, ParallelPlan, PlannedModule
from forge_lightning.contracts.megatron import RECOMPUTE
from forge_lightning.performance.transforms import apply_activation_checkpointing
from forge_lightning.strategies.megatron.spread import SpreadStep, StageGroups, backward_spread, encode_spread
from forge_lightning.strategies.megatron.wrapping import chunk_config

OPTIONS = ("tensor_model_parallel_size", "recompute", "freeze")
# Where the encoder side runs with pipeline parallelism (the strategy's encoder_placement; None: the first).
PLACEMENTS = ("spread", "first_stage")
# Batch key of a micro-batch's encoder output computed ahead of the pipeline schedule (Components.encode_ahead).
ENCODED = "_forge_encoded"
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


def parse_placement(placement: str | None, pipeline_model_parallel_size: int) -> str:
    """The strategy's ``encoder_placement``: ``spread`` (the default) or ``first_stage`` (see the module docstring).

    Raises:
        ValueError: another value, or a value set without pipeline parallelism (where it would do nothing).
    """
    if placement is None:
        return PLACEMENTS[0]
    if placement not in PLACEMENTS:
        raise ValueError(f"encoder_placement must be one of {list(PLACEMENTS)}, got {placement!r}")
    if pipeline_model_parallel_size == 1:
        raise ValueError(
            f"encoder_placement={placement!r} places a composed model's encoder side over the pipeline stages, but "
            "pipeline_model_parallel_size is 1 (the encoder side then runs in the decoder's forward step, shared "
            "by its TP group); leave encoder_placement unset"
        )
    return placement


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedComponent:
    """A plan component with its settings under the strategy."""

    component: Component
    decoder: bool
    tensor_model_parallel_size: int
    recompute: str
    frozen: bool


def resolve_components(
    plan: ParallelPlan, options: Mapping[str, ComponentOptions], dims: MegatronDims
) -> list[ResolvedComponent]:
    """Every component of ``plan`` with its settings: its ``options`` entry over the plan's defaults.

    Args:
        plan: the module's parallel plan (its composition names the decoder; a plan of one component is the
            decoder).
        options: the parsed ``components`` option.
        dims: the strategy's layout.

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
        _check_composed_layout(dims)
    elif len(names) == 1:
        decoder = names[0]
    else:
        raise ValueError(
            f"the module's plan has the components {names} but no composition: MegatronStrategy needs to know which "
            "one its megatron-core model stands for and how the others feed it (ParallelPlan.composition)"
        )
    resolved = [
        _resolve(comp, options.get(comp.name, ComponentOptions()), comp.name == decoder, dims.tp)
        for comp in plan
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


def _check_composed_layout(dims: MegatronDims) -> None:
    """Refuse the layouts a composed model cannot run at yet, naming the option."""
    if dims.cp > 1:
        raise NotImplementedError(
            f"context_parallel_size={dims.cp} is not yet supported with a composed model (components feeding a "
            "decoder) under MegatronStrategy: the encoder side runs outside megatron's context-parallel split; use "
            "tensor / pipeline / data (and expert) parallelism"
        )
    if dims.vpp > 1:
        raise NotImplementedError(
            f"virtual_pipeline_model_parallel_size={dims.vpp} is not yet supported with a composed model: its "
            "decoupled encoder is tested with the 1F1B schedule only; leave it unset (one chunk per stage)"
        )
    if dims.pp > 1 and dims.use_distributed_optimizer:
        raise NotImplementedError(
            f"use_distributed_optimizer with pipeline_model_parallel_size={dims.pp} is not yet supported with a "
            "composed model: the encoder side's own optimizer, chained with the twin's, is not yet tested over "
            "pipeline stages; use the plain optimizer or pipeline_model_parallel_size=1"
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
    composition: Composition, batch: dict[str, Tensor], group: Any, dtype: torch.dtype | None = None
) -> Tensor:
    """``composition.encode(batch)``, each rank of ``group`` encoding its :func:`sample_rows` (taken by
    ``composition.select``) and all of them the gathered result.

    Args:
        composition: the module's composition.
        batch: one micro-batch, the same on every rank of ``group``; its size is that of ``input_ids``.
        group: the ranks sharing the work (the decoder's TP group).
        dtype: the dtype each rank's encoding is cast to before the gather (``None``: as encoded). Under autocast a
            share without encoder work (a VLM's samples without images) gives zeros in the parameters' dtype and the
            others the autocast dtype, which the gather cannot join.
    """
    size = dist.get_world_size(group)
    if size == 1:
        encoded = composition.encode(batch)
        return encoded if dtype is None else encoded.to(dtype)
    batch_size = batch["input_ids"].shape[0]
    rows = sample_rows(batch_size, dist.get_rank(group), size)
    local = composition.encode(composition.select(batch, rows))
    return GatherSamples.apply(local if dtype is None else local.to(dtype), group)[:batch_size]


# ------------------------------------------------------------------------------------------------ runtime


class Components:
    """The module's components under the strategy: which one the twin stands for (the decoder), its options, and
    for a composed model the encoder side (its DDP, its share of each micro-batch, its gradients). See the module
    docstring.

    For a module of one component only the decoder's options apply and every encoder-side hook is a no-op.

    Args:
        module: the LightningModule (a :class:`~forge_lightning.contracts.PlannedModule`).
        options: the parsed ``components`` option.
        dims: the strategy's layout.
        bf16: the run trains in bf16 (the encoder side then computes under autocast).
        placement: the parsed ``encoder_placement`` (:func:`parse_placement`).

    Raises:
        TypeError: the module declares no parallel plan.
    """

    def __init__(
        self,
        module: nn.Module,
        options: Mapping[str, ComponentOptions],
        dims: MegatronDims,
        *,
        bf16: bool,
        placement: str = PLACEMENTS[0],
    ) -> None:
        if not isinstance(module, PlannedModule):
            raise TypeError(
                f"MegatronStrategy trains modules that declare their components ({type(module).__name__} has no "
                "parallel_plan(); see forge_lightning.contracts.PlannedModule)"
            )
        plan = module.parallel_plan()
        self.module = module
        self.resolved = resolve_components(plan, options, dims)
        self.composition: Composition | None = plan.composition
        # The encoder side's megatron DDP (none when all of it is frozen, or on a later pipeline stage).
        self.encoder_ddp: list[nn.Module] = []
        self._bf16 = bf16
        # In bf16 runs the encodings travel in bf16, the dtype the twin's merge casts them to anyway.
        self._dtype = torch.bfloat16 if bf16 else None
        # With pipeline parallelism the encoder side runs apart from the schedule: spread over the stages, or on
        # the first stage only.
        self.decoupled = self.composed and dims.pp > 1
        self.spread = self.decoupled and placement == "spread"
        self._holds_encoders = True
        # first_stage: (encoder output with its graph, the leaf the twin reads) of each micro-batch encoded ahead
        self._ahead: list[tuple[Tensor, Tensor]] = []
        self._spread_step: SpreadStep | None = None  # spread: the step's shares, pieces and leaves
        self._tokens: Tensor | None = None
        # The samples this rank passed to the composition's encode, in training and in evaluation (its encoder work).
        self.encoded_samples: Counter[str] = Counter()

    @property
    def composed(self) -> bool:
        return self.composition is not None

    @property
    def decoder(self) -> ResolvedComponent:
        """The component the twin stands for."""
        return next(r for r in self.resolved if r.decoder)

    def _encoder_side(self) -> list[ResolvedComponent]:
        return [r for r in self.resolved if not r.decoder]

    # ----- building ---------------------------------------------------------------------------------------------
    def decoder_recompute(self) -> str:
        """The decoder's ``recompute`` option (the twin applies it)."""
        return self.decoder.recompute

    def prepare_decoder(self, chunks: list[nn.Module]) -> None:
        """Freeze the twin when asked (before its DDP wraps it)."""
        if self.decoder.frozen:
            for chunk in chunks:
                chunk.requires_grad_(False)

    def wrap_encoders(self, chunks: list[nn.Module], *, device: torch.device) -> None:
        """Freeze / recompute the encoder-side components and wrap their trainable parameters in a megatron DDP
        that reduces over the TP x DP group (every rank holds a replica)."""
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        side = self._encoder_side()
        if not side:
            return
        # Only the first pipeline stage merges the encoder's output into the decoder's input: placed there, later
        # stages hold no encoder side (no gradient, no optimizer state, nothing in their checkpoint shards).
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self._holds_encoders = first or self.spread
        self.encoder_ddp = []
        if not self._holds_encoders:
            return
        for r in side:
            _prepare_encoder_component(r)
        modules = nn.ModuleDict({r.component.name: r.component.module for r in side}).to(device)
        # megatron's gradient norm sums over TP x PP and skips `shared` parameters (as a tied embedding's copy on the
        # last stage): spread, each replicated parameter is counted on the first stage only (set on every setup, so
        # that a later fit at another layout counts them again).
        for param in modules.parameters():
            param.shared = self.spread and not first
        if not any(p.requires_grad for p in modules.parameters()):
            return
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
        ddp = DistributedDataParallel(
            chunk_config(chunks[0]),
            ddp_config,
            modules,
            disable_bucketing=True,
            pg_collection=_replica_groups(spread=self.spread),
        )
        ddp.broadcast_params()
        self.encoder_ddp = [ddp]

    # ----- training ---------------------------------------------------------------------------------------------
    def encode(self, batch: dict[str, Tensor]) -> Tensor:
        """The composition's ``encode`` of one micro-batch, each rank of the decoder's TP group encoding a share of
        its samples (:func:`encode_over_group`); under autocast in bf16 runs (the encoder side keeps fp32
        parameters, which megatron's optimizer steps as fp32), its output cast to bf16. The twin's forward step
        calls it."""
        from megatron.core import parallel_state

        assert self.composition is not None
        if ENCODED in batch:  # encoded ahead of the schedule (encode_ahead)
            return batch[ENCODED]
        group = parallel_state.get_tensor_model_parallel_group()
        self._count(-(-batch["input_ids"].shape[0] // dist.get_world_size(group)))
        with self._autocast(batch["input_ids"].device):
            return encode_over_group(self.composition, batch, group, self._dtype)

    def encode_ahead(self, batches: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """With pipeline parallelism, encode every micro-batch of the step before the schedule runs (first stage;
        the batches are unchanged elsewhere): each batch then carries a leaf tensor holding its encoder output,
        which the twin's first stage reads, and whose gradient :meth:`backward_ahead` back-propagates through the
        encoder side after the schedule. The encoder thus takes no place in the pipeline's slots: its forward and
        backward do not stretch the first stage's share of every micro-batch. Under ``no_grad`` (evaluation) no
        graph is kept."""
        if not self.decoupled:
            return batches
        if self.spread:
            return self._encode_spread(batches)
        if not self._holds_encoders:
            return batches
        self._ahead, ahead = [], []
        for batch in batches:
            out = self.encode(batch)
            leaf = out.detach().requires_grad_(out.requires_grad)
            if out.requires_grad:
                self._ahead.append((out, leaf))
            ahead.append({**batch, ENCODED: leaf})
        return ahead

    def backward_ahead(self) -> None:
        """After a training schedule with :meth:`encode_ahead`: back-propagate the gradients the schedule left on
        the encoder outputs through the encoder side, then reduce and scale its gradients (:meth:`finalize`
        deferred that part)."""
        if not self.decoupled:
            return
        step, self._spread_step = self._spread_step, None
        if step is not None:
            backward_spread(step, _stage_groups())
        pairs, self._ahead = [p for p in self._ahead if p[1].grad is not None], []
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [leaf.grad for _, leaf in pairs])
        self._finish_encoders(self._tokens)
        self._tokens = None

    def _encode_spread(self, batches: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """:meth:`encode_ahead` with ``encoder_placement: spread`` (spread.py): this rank's run of the step's samples,
        every micro-batch's features gathered on the first stage."""
        assert self.composition is not None
        composition, device = self.composition, batches[0]["input_ids"].device

        def encode_rows(m: int, rows: Tensor) -> Tensor:
            self._count(len(rows))
            with self._autocast(device):
                encoded = composition.encode(composition.select(batches[m], rows))
            return encoded if self._dtype is None else encoded.to(self._dtype)

        # Every rank decides alike: the encoder side has trainable parameters and the schedule back-propagates.
        requires_grad = torch.is_grad_enabled() and bool(self.encoder_ddp)
        sizes = [batch["input_ids"].shape[0] for batch in batches]
        step = encode_spread(sizes, encode_rows, _stage_groups(), device=device, requires_grad=requires_grad)
        self._spread_step = step if requires_grad else None
        if not step.leaves:  # a later stage: its forward step reads no encoder output
            return batches
        return [{**batch, ENCODED: leaf} for batch, leaf in zip(batches, step.leaves, strict=True)]

    def _count(self, samples: int) -> None:
        self.encoded_samples["train" if torch.is_grad_enabled() else "eval"] += samples

    def connect(self, chunks: list[nn.Module]) -> None:
        """Make the schedule's gradient finalisation also finish and scale the encoder side's gradients."""
        if not self.encoder_ddp:
            return
        config = chunk_config(chunks[0])
        config.finalize_model_grads_func = partial(self.finalize, config.finalize_model_grads_func)

    def finalize(
        self,
        finalize_decoder: Callable[..., Any],
        model: list[nn.Module],
        num_tokens: Tensor | None,
        **kwargs: Any,
    ) -> None:
        """megatron's ``finalize_model_grads`` for the twin, then the encoder side: its all-reduce over TP x DP and
        the division by the global batch's trainable tokens (megatron's finalisation leaves that count, broadcast
        from the last stage and summed over DP, in ``num_tokens``). With the decoupled encoder (pipeline
        parallelism) its gradients are not there yet: :meth:`backward_ahead` finishes them."""
        finalize_decoder(model, num_tokens, **kwargs)
        tokens = None if num_tokens is None else num_tokens.clone()
        if self.decoupled:
            self._tokens = tokens
            return
        self._finish_encoders(tokens)

    def _finish_encoders(self, tokens: Tensor | None) -> None:
        for ddp in self.encoder_ddp:
            ddp.finish_grad_sync()
            if tokens is not None and tokens > 0:
                ddp.scale_gradients(1.0 / tokens)

    def zero_grad_buffers(self) -> None:
        for ddp in self.encoder_ddp:
            ddp.zero_grad_buffer()

    def _autocast(self, device: torch.device) -> Any:
        if not self._bf16:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    # ----- checkpoints and export ---------------------------------------------------------------------------------
    def encoder_modules(self) -> dict[str, nn.Module]:
        """The encoder side's modules by component name (frozen ones included), in the plan's order; empty for a
        module of one component and, with ``encoder_placement: first_stage``, on pipeline stages after the first
        (which hold no encoder side). Checkpoints store them as replicated tensors (see checkpoint.py)."""
        if not self._holds_encoders:
            return {}
        return {r.component.name: r.component.module for r in self._encoder_side()}

    def frozen(self) -> list[str]:
        """The names of the frozen components (no optimizer state), as the checkpoint records them."""
        return sorted(r.component.name for r in self.resolved if r.frozen)

    def full_state_dict(
        self, decoder_state: dict[str, Tensor], module: nn.Module | None
    ) -> dict[str, Tensor]:
        """The module's full state dict under its own names, from the twin's state of the decoder component.

        The decoder's tensors go under its module's prefix in the LightningModule (e.g. ``model.`` or
        ``model.llm.``), the encoder side's are this rank's replica of them: the LightningModule's own
        ``state_dict()`` keys, which ``load_state_dict(strict=True)`` takes back.

        Args:
            decoder_state: the twin's ``state_dict`` (full on global rank 0, empty elsewhere).
            module: ``None`` (or the LightningModule) for every key; a submodule for its keys, relative to it.

        Returns:
            The state dict on global rank 0 (CPU), an empty dict elsewhere.
        """
        prefixes = {id(sub): name for name, sub in self.module.named_modules()}
        prefix = "" if module is None else prefixes.get(id(module))
        if prefix is None:
            raise ValueError(f"{type(module).__name__} is not a submodule of {type(self.module).__name__}")
        if dist.get_rank() != 0:
            return {}
        parts = {id(self.decoder.component.module): decoder_state}
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
    """Freeze (or unfreeze) and wrap the blocks for recompute of one encoder-side component."""
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


def _replica_groups(*, spread: bool) -> Any:
    """megatron's process groups for the encoder side's DDP: its data-parallel group holds the ranks with a replica
    of it, TP x DP (x CP) on one stage, or every rank when it is spread over the stages (CP, refused with a composed
    model, is 1); the rest as the twin's (no expert parameters on the encoder side)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection()
    if spread:
        groups.dp = groups.dp_cp = dist.group.WORLD
    else:
        groups.dp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=False)
        groups.dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    groups.expt_dp = parallel_state.get_expert_data_parallel_group()
    groups.tp = parallel_state.get_tensor_model_parallel_group()  # megatron's DDP logs with it
    groups.pp = parallel_state.get_pipeline_model_parallel_group()
    groups.ep = parallel_state.get_expert_model_parallel_group()
    return groups


def _stage_groups() -> StageGroups:
    """This rank's TP and PP groups for the spread encoder side (spread.py)."""
    from megatron.core import parallel_state

    return StageGroups(
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        first=parallel_state.get_pipeline_model_parallel_first_rank(),
    )

"""The transforms that apply a :class:`~forge_lightning.performance.PerformanceConfig` to a module's parallel plan.

Every strategy applies them in one fixed order, between its own tensor parallelism and its data-parallel
wrapping::

    tensor parallelism ─ FP8 ─ kernels ─ SDPA backends, attention kernel ─ activation checkpointing ─ torch.compile ─ FSDP / DDP
    (strategy)           apply_performance (this module)                                                             (strategy)

Strategies that shard or parallelise the model (``FSDP2Strategy``) call :func:`apply_performance` themselves after
TP and declare ``traits.applies_performance``; ``MegatronStrategy`` declares it too and hands the settings to the
model it trains. For every other strategy (Lightning's single-device and DDP strategies and ours built on them,
which wrap the model after ``configure_model``), the LightningModule's ``configure_model`` calls
:func:`configure_performance`. Each transform reads only the plan (components, blocks, frozen flags), never a model
family, logs one line and keeps parameter names unchanged. :func:`apply_performance` returns the switches it
applied; with the module's own (``performance_switches``) they must cover every switch the run changed
(:func:`~forge_lightning.performance.switches.check_applied`).
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from forge_lightning.accelerators.capabilities import capabilities
from forge_lightning.contracts import ParallelPlan, TunedModule, traits_of
from forge_lightning.performance.config import AC_MODES, PerformanceConfig, resolve
from forge_lightning.performance.switches import check_applied

_APPLIED = "_forge_performance_applied"
# The plain layer each Triton kernel replaces (messages).
FUSED_LAYER_NAMES = {"rms_norm": "RMSNorm", "swiglu": "GatedMLP", "rope": "grouped-query Attention"}


# The switches apply_performance applies (FP8's own fields when FP8 is on; the selective-checkpointing ops with
# selective checkpointing). `fp8.fsdp_all_gather` is FSDP2's, `fp8.lm_head` and the loss kernel the module's.
_APPLIED_SWITCHES = frozenset(
    {
        "fp8",
        "fp8.recipe",
        "fp8.exclude",
        "fp8.attention",
        "fp8.fast_accum",
        "kernels.rms_norm",
        "kernels.rope",
        "kernels.swiglu",
        "attention.sdpa",
        "attention.kernel",
        "activation_checkpointing",
        "compile",
    }
)


def apply_performance(
    plan: ParallelPlan, perf: PerformanceConfig, device: torch.device | str
) -> frozenset[str]:
    """Apply FP8, kernels, SDPA backends, activation checkpointing and compilation, in that order.

    Args:
        plan: the module's parallel plan (tensor parallelism, if any, already applied).
        perf: the run's performance settings.
        device: where the model trains (decides every ``auto``).

    Returns:
        The switches applied (see :mod:`~forge_lightning.performance.switches`).
    """
    resolved = resolve(perf, device)
    apply_fp8(plan, resolved.fp8, device)
    switched = apply_kernels(plan, resolved.kernels)
    for name, count in switched.items():
        if count == 0 and getattr(perf.kernels, name) == "triton":  # asked for, and nothing to switch
            plain = FUSED_LAYER_NAMES[name]
            raise ValueError(
                f"performance.kernels.{name} ('triton') is not applied: the model has no {plain} layer for the kernel "
                "to replace; leave it 'auto'"
            )
    apply_sdpa_backends(resolved.sdpa)
    apply_attention_kernel(
        resolved.attention_kernel,
        chosen=resolved.attention_kernel_chosen,
        note=resolved.attention_kernel_note if capabilities(device).flash_attention else None,
    )
    apply_activation_checkpointing(plan, resolved.activation_checkpointing, resolved.selective_save_ops)
    apply_compile(plan, enabled=resolved.compile)
    selective = {"selective_save_ops"} if resolved.activation_checkpointing == "selective" else set()
    return _APPLIED_SWITCHES | selective


def configure_performance(module: Any) -> None:
    """``configure_model`` helper of LightningModules: apply the module's ``performance`` unless the strategy does,
    and refuse the switches nobody applies.

    Idempotent (``configure_model`` runs for every ``fit`` / ``validate`` call).

    Args:
        module: a LightningModule with ``parallel_plan()`` and a ``performance`` attribute (a
            :class:`~forge_lightning.contracts.TunedModule`), attached to a trainer.
    """
    strategy = module.trainer.strategy
    if traits_of(strategy).applies_performance or getattr(module, _APPLIED, False):
        return
    applied = apply_performance(module.parallel_plan(), module.performance, strategy.root_device)
    check_applied(module.performance, applied | module_switches(module), type(strategy).__name__)
    setattr(module, _APPLIED, True)


def module_switches(module: Any) -> frozenset[str]:
    """The switches ``module`` applies itself (``TunedModule.performance_switches``; none for other modules)."""
    return frozenset(module.performance_switches) if isinstance(module, TunedModule) else frozenset()


def mark_applied(module: nn.Module) -> None:
    """Record that a strategy applied ``module``'s performance settings (so nothing applies them twice)."""
    setattr(module, _APPLIED, True)


# ----- FP8 ---------------------------------------------------------------------------------------------------
def apply_fp8(plan: ParallelPlan, fp8: Any, device: torch.device | str = "cpu") -> None:
    """Swap the trainable components' ``nn.Linear`` layers for torchao ``Float8Linear`` (dynamic scaling), and
    with ``fp8.attention`` give their ``Attention`` layers FP8 attention state.

    Layers named in ``fp8.exclude`` and layers whose dimensions are not multiples of 16 (FP8 GEMM tiles) stay in
    high precision.

    Args:
        plan: the module's parallel plan.
        fp8: a :class:`~forge_lightning.performance.Float8Config`, or ``None`` (no-op).
        device: where the model trains (FP8 attention on CUDA needs the cuDNN frontend).
    """
    if fp8 is None:
        return
    if fp8.attention:
        _enable_fp8_attention(plan, torch.device(device))
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ImportError(
            "performance.fp8 needs torchao: pip install 'forge-lightning[fp8]' (or torchao>=0.18)"
        ) from err
    import dataclasses

    config = Float8LinearConfig.from_recipe_name(fp8.recipe)
    if fp8.fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    if fp8.fast_accum:
        from torchao.float8.config import Float8GemmConfig

        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    converted: list[str] = []

    def keep_in_fp8(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # descend into containers
        excluded = any(fnmatch.fnmatchcase(fqn, pattern) for pattern in fp8.exclude)
        fits = module.in_features % 16 == 0 and module.out_features % 16 == 0
        if fits and not excluded:
            converted.append(fqn)
        return fits and not excluded

    for comp in plan:
        if not comp.frozen:
            convert_to_float8_training(comp.module, module_filter_fn=keep_in_fp8, config=config)
    rank_zero_info(
        f"fp8: {len(converted)} linear layers to Float8Linear ({fp8.recipe}, FSDP FP8 all-gather "
        f"{'on' if fp8.fsdp_all_gather else 'off'}); excluded {fp8.exclude}"
    )


def _enable_fp8_attention(plan: ParallelPlan, device: torch.device) -> None:
    from forge_lightning.kernels.fp8_attention import (
        FP8AttentionScales,
        cudnn_fp8_attention_available,
        cudnn_head_dim_unsupported,
    )
    from forge_lightning.modules.layers.attention import Attention, SelfAttention

    cudnn = capabilities(device).cudnn_attention
    if cudnn:
        reason = cudnn_fp8_attention_available(device)
        if reason is not None:
            raise RuntimeError(
                f"performance.fp8.attention: {reason}; or set performance.fp8.attention: false"
            )
    enabled, other = 0, 0
    for comp in plan:
        if comp.frozen:
            continue
        for module in comp.module.modules():
            if isinstance(module, Attention):
                reason = cudnn_head_dim_unsupported(module.head_dim, device)
                if reason is not None:
                    raise ValueError(
                        f"performance.fp8.attention: {reason}; set performance.fp8.attention: false"
                    )
                module.fp8_scales = FP8AttentionScales()
                enabled += 1
            elif isinstance(module, SelfAttention):
                other += 1
    if not enabled:
        raise ValueError(
            "performance.fp8.attention: the trainable components have no grouped-query Attention layer (MLA and "
            "other attention modules have no FP8 path); set performance.fp8.attention: false"
        )
    backend = "cuDNN fused FP8" if cudnn else "torch emulation"
    kept = f"; {other} other attention layers (MLA) stay in high precision" if other else ""
    rank_zero_info(f"fp8 attention: {enabled} layers ({backend}){kept}")


# ----- kernels and attention ---------------------------------------------------------------------------------
def apply_kernels(plan: ParallelPlan, kernels: dict[str, str]) -> dict[str, int]:
    """Switch the plan's RMSNorm / GatedMLP / Attention layers to their Triton twins where ``kernels`` says so.

    Args:
        plan: the module's parallel plan.
        kernels: resolved choice per kernel (``triton`` or ``torch``), see :func:`~forge_lightning.performance.resolve`.

    Returns:
        The layers switched per kernel set to ``triton``.
    """
    from forge_lightning.modules.layers.fused import FUSED_LAYERS

    counts = {}
    for name, (plain, fused) in FUSED_LAYERS.items():
        if kernels.get(name) != "triton":
            continue
        counts[name] = 0
        for comp in plan:
            for module in comp.module.modules():
                if type(module) is plain:
                    module.__class__ = fused  # same parameters and buffers, the kernel's forward
                    counts[name] += 1
    if counts:
        rank_zero_info(f"kernels: Triton for {counts}; cross-entropy {kernels.get('cross_entropy')}")
    return counts


def apply_sdpa_backends(backends: list[str] | None) -> None:
    """Allow only ``backends`` for ``scaled_dot_product_attention`` in this process, tried in the given order.

    Process-wide (like ``torch.backends.cuda.enable_*_sdp``), so compiled graphs see it too. ``None``: unchanged.

    Args:
        backends: names among ``cudnn``, ``flash``, ``efficient``, ``math``, highest priority first.
    """
    if backends is None:
        return
    from torch.nn.attention import SDPBackend

    enums = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in backends)
    torch.backends.cuda.enable_flash_sdp("flash" in backends)
    torch.backends.cuda.enable_mem_efficient_sdp("efficient" in backends)
    torch.backends.cuda.enable_math_sdp("math" in backends)
    # The priority order is what `torch.nn.attention.sdpa_kernel(..., set_priority=True)` sets inside its context;
    # here it must outlive any context, so it is set directly.
    order = [enums[name] for name in backends] + [e for name, e in enums.items() if name not in backends]
    torch._C._set_sdp_priority_order([int(e) for e in order])
    rank_zero_info(f"sdpa backends: {backends}")


def apply_attention_kernel(kernel: str, *, chosen: bool, note: str | None = None) -> None:
    """Use ``kernel`` (``sdpa`` or ``fa4``) for every attention layer of this process (see
    :func:`~forge_lightning.modules.layers.attention.set_attention_kernel`).

    Args:
        kernel: the resolved ``performance.attention.kernel``.
        chosen: ``auto`` picked it (calls FA4 does not take fall back to SDPA).
        note: why ``auto`` did not pick FA4, for the log line.
    """
    from forge_lightning.modules.layers.attention import set_attention_kernel

    set_attention_kernel(kernel, chosen=chosen)
    if kernel == "fa4":
        rank_zero_info(
            "attention kernel: FlashAttention-4 (calls with a mask or a KV cache use SDPA"
            + ("; fp32 or head dims other than 64 and 128 too)" if chosen else ")")
        )
    elif note is not None:
        rank_zero_info(f"attention kernel: SDPA ({note})")


# ----- activation checkpointing and compilation ----------------------------------------------------------------
def apply_activation_checkpointing(plan: ParallelPlan, mode: str, save_ops: tuple[str, ...] = ()) -> None:
    """Recompute each trainable block's activations in backward (the composable ``checkpoint`` API).

    Args:
        plan: the module's parallel plan; a component's own ``activation_checkpointing`` takes the place of
            ``mode`` for its blocks.
        mode: ``none`` (no-op), ``full`` (recompute everything) or ``selective`` (keep the outputs of
            ``save_ops``, recompute the rest).
        save_ops: aten overload names, e.g. ``aten.mm.default`` (selective only).
    """
    counts: dict[str, int] = {}
    for comp in plan:
        own = comp.activation_checkpointing or mode
        if own not in AC_MODES:
            raise ValueError(
                f"component {comp.name!r}: activation_checkpointing ({own!r}) must be one of {', '.join(AC_MODES)}"
            )
        if comp.frozen or own == "none":
            continue
        context_fn = _selective_context(save_ops) if own == "selective" else None
        for block in comp.blocks:
            _checkpoint_forward(block, context_fn)
        counts[f"{comp.name} {own}"] = len(comp.blocks)
    if counts:
        rank_zero_info(
            f"activation checkpointing: {', '.join(f'{k}: {n} blocks' for k, n in counts.items())}"
        )


def _checkpoint_forward(block: nn.Module, context_fn: Any | None) -> None:
    """Run ``block.forward`` under non-reentrant ``torch.utils.checkpoint`` (parameter names unchanged).

    The checkpoint wraps the forward method, not the module call: hooks on the module (FSDP2's all-gather and
    reshard) stay outside the checkpointed region in forward and in the backward recompute alike. The composable
    ``checkpoint`` API enters the region from a module pre-hook instead, so FSDP2's hooks ran inside it in one of
    the two passes, and selective checkpointing met ops in the recompute it had not recorded in forward.
    """
    from torch.utils.checkpoint import checkpoint

    forward = block.forward
    extra = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(forward)
    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = checkpointed_forward


def _selective_context(save_ops: tuple[str, ...]) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {_aten_op(name) for name in save_ops}
    saved.discard(None)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _aten_op(name: str) -> Any:
    """``aten.mm.default`` -> ``torch.ops.aten.mm.default``, ``forge_lightning.<op>.<overload>`` likewise (our
    custom ops, e.g. FlashAttention-4's forward); ``None`` for an op this build lacks."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] not in ("aten", "forge_lightning"):
        raise ValueError(
            f"performance.selective_save_ops entry {name!r} must look like 'aten.<op>.<overload>' (or "
            "'forge_lightning.<op>.<overload>')"
        )
    packet = getattr(getattr(torch.ops, parts[0]), parts[1], None)
    return None if packet is None else getattr(packet, parts[2], None)


def apply_compile(plan: ParallelPlan, *, enabled: bool) -> None:
    """``torch.compile`` each block in place (parameter names unchanged; one graph reused by all blocks).

    Args:
        plan: the module's parallel plan; a component's own ``compile`` takes the place of ``enabled`` for its
            blocks.
        enabled: compile the blocks of the components that do not say otherwise.
    """
    count = 0
    for comp in plan:
        if not (enabled if comp.compile is None else comp.compile):
            continue
        for block in comp.blocks:
            block.compile()
            count += 1
    if count:
        rank_zero_info(f"torch.compile: {count} blocks")

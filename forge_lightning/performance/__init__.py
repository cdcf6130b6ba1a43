"""Speed switches (kernels, attention, FP8, activation checkpointing, compile, optimizer) in one config section,
and the transforms every strategy applies from it, in one order. See docs/performance.md."""

from forge_lightning.performance.config import (
    AttentionConfig,
    Float8Config,
    KernelConfig,
    PerformanceConfig,
    ResolvedPerformance,
    resolve,
    resolve_for,
)
from forge_lightning.performance.switches import changed_switches, check_applied, switch_names
from forge_lightning.performance.transforms import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fp8,
    apply_kernels,
    apply_performance,
    apply_sdpa_backends,
    configure_performance,
    mark_applied,
    module_switches,
)

__all__ = [
    "AttentionConfig",
    "Float8Config",
    "KernelConfig",
    "PerformanceConfig",
    "ResolvedPerformance",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fp8",
    "apply_kernels",
    "apply_performance",
    "apply_sdpa_backends",
    "changed_switches",
    "check_applied",
    "configure_performance",
    "mark_applied",
    "module_switches",
    "resolve",
    "resolve_for",
    "switch_names",
]

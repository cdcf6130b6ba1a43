"""``PerformanceConfig``: every speed switch of a run, in the one YAML section ``performance`` every strategy honours.

The switches change how fast a step runs, never what it computes (up to floating-point rounding and, for FP8, the
FP8 recipe's quantisation). Each ``"auto"`` resolves to the fastest correct choice the device's platform supports
(NVIDIA GPUs, Kunlun XPUs, the CPU: :mod:`forge_lightning.accelerators.capabilities`) and to plain torch elsewhere;
:func:`resolve` does that once the device is known, and refuses a switch set to what the platform cannot run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from forge_lightning.accelerators.capabilities import DeviceCapabilities, capabilities, refuses_unsupported

KernelChoice = Literal["auto", "triton", "torch"]
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
CUDA_SDPA_PRIORITY = ["cudnn", "flash", "efficient", "math"]
"""SDPA backends in priority order on CUDA: cuDNN attention first (about 1.6x FlashAttention-2's speed for causal
GQA on an H200, measured in docs/benchmarks.md), the others as fallbacks for inputs cuDNN refuses."""
PORTABLE_SDPA_PRIORITY = ["efficient", "math"]
"""SDPA backends on a CUDA-typed device without cuDNN / flash attention (Kunlun's CUDA-compatible mode)."""
PACKED_BACKENDS = ("auto", "sdpa", "flex", "varlen", "fa4")
ATTENTION_KERNELS = ("auto", "sdpa", "fa4")
AC_MODES = ("none", "full", "selective")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
DEFAULT_SELECTIVE_SAVE = [
    "aten.mm.default",
    "aten.addmm.default",
    "aten._scaled_mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "forge_lightning.flash4_forward.default",
]
"""Ops whose outputs selective activation checkpointing keeps: the matmuls and attention (expensive to recompute);
norms, activations and RoPE are recomputed in backward."""


@dataclass(kw_only=True)
class KernelConfig:
    """Which implementation each fused layer uses: ``triton`` (our Triton kernels), ``torch`` (the plain layers,
    which ``torch.compile`` fuses) or ``auto``.

    ``auto``: the fused linear + cross-entropy runs in Triton on NVIDIA GPUs; RMSNorm, RoPE and SwiGLU run in Triton
    there when the blocks are not compiled (compiled blocks fuse them with their neighbours, which is faster than a
    separate kernel); torch elsewhere (Kunlun XPUs, CPU; ``triton`` is refused on Kunlun).

    Args:
        rms_norm: RMSNorm layers.
        rope: rotary embedding of queries and keys.
        swiglu: the SwiGLU activation of gated MLPs.
        cross_entropy: the fused linear + cross-entropy loss.
    """

    rms_norm: KernelChoice = "auto"
    rope: KernelChoice = "auto"
    swiglu: KernelChoice = "auto"
    cross_entropy: KernelChoice = "auto"


@dataclass(kw_only=True)
class AttentionConfig:
    """Attention kernels.

    Args:
        kernel: kernel of attention without packed documents, every family's: ``sdpa``, ``fa4``
            (FlashAttention-4, ``pip install flash-attn-4``: Hopper or Blackwell, bf16 / fp16, head dims up to
            128; calls with a mask or a KV cache use SDPA) or ``auto`` (``fa4`` where it imports and the GPU
            takes it, its unsupported calls falling back to SDPA; ``sdpa`` elsewhere).
        sdpa: SDPA backends allowed, in priority order (``cudnn``, ``flash``, ``efficient``, ``math``); ``auto``:
            cuDNN, then flash, efficient and math on NVIDIA GPUs, efficient and math on Kunlun XPUs (where
            ``cudnn`` / ``flash`` are refused), torch's default elsewhere.
        packed: kernel for packed rows (several documents per row): ``auto`` (on NVIDIA GPUs FA4 varlen when
            ``kernel`` resolves to ``fa4``, else FlexAttention for an LLM's fixed-shape rows and FlashAttention
            varlen for encoders, whose shapes change with every image grid; SDPA with a block-diagonal mask
            elsewhere: Kunlun XPUs, CPU), ``sdpa``, ``flex``, ``varlen`` or ``fa4``.
    """

    kernel: str = "auto"
    sdpa: list[str] | Literal["auto"] = "auto"
    packed: str = "auto"


@dataclass(kw_only=True)
class Float8Config:
    """FP8 training of linear layers with torchao's float8 recipes (dynamic scaling).

    Args:
        recipe: ``tensorwise`` (one scale per tensor, fastest), ``rowwise`` (one scale per row, more accurate) or
            ``rowwise_with_gw_hp`` (rowwise, weight gradient in high precision).
        exclude: fully qualified module names or ``fnmatch`` patterns left in high precision (the output head by
            default: the fused cross-entropy reads its weight directly).
        fsdp_all_gather: under FSDP2, all-gather parameters in FP8 (tensorwise only; half the bytes of bf16).
        attention: also run causal self-attention (the GQA ``Attention`` layers) in FP8: cuDNN's fused FP8
            attention on CUDA (Hopper or newer, ``pip install nvidia-cudnn-frontend``), its torch emulation
            elsewhere; see ``forge_lightning.kernels.fp8_attention``. Packed documents, masks and KV-cache decoding
            stay in bf16, MLA layers too.
        fast_accum: cuBLAS fast accumulation in the two backward GEMMs as well (the forward GEMM always uses it),
            in the block linears and, with ``lm_head``, in the output head's hidden-state gradient (its weight
            gradient, one GEMM over every token, always accumulates precisely): faster, less precise sums.
        lm_head: run the output head's three GEMMs inside the fused linear + cross-entropy in FP8 too (e4m3
            hidden states and weight, e5m2 logit gradients, per-tensor scales; see
            ``forge_lightning.kernels.fused_linear_cross_entropy``). Independent of ``exclude``, which lists the
            ``nn.Linear`` layers torchao converts.
    """

    recipe: str = "tensorwise"
    exclude: list[str] = field(default_factory=lambda: ["lm_head", "*.lm_head"])
    fsdp_all_gather: bool = False
    attention: bool = False
    fast_accum: bool = False
    lm_head: bool = False


@dataclass(kw_only=True)
class PerformanceConfig:
    """Speed switches applied by every strategy in one order: TP → FP8 → kernels → activation checkpointing →
    per-block ``torch.compile`` → FSDP / DDP (see ``forge_lightning.performance.transforms``).

    Args:
        kernels: Triton kernels per layer type.
        attention: SDPA backends and the packed-rows kernel.
        compile: ``torch.compile`` each repeated block of the plan; ``auto``: on NVIDIA GPUs (``true`` is refused on
            Kunlun XPUs, which have no Triton for inductor).
        activation_checkpointing: ``none``, ``full`` (recompute whole blocks) or ``selective`` (keep the outputs of
            ``selective_save_ops``, recompute the rest).
        selective_save_ops: aten overloads whose outputs selective checkpointing keeps.
        fp8: FP8 training (``None``: off); needs ``torchao``.
        optimizer: ``fused`` (one kernel per step), ``foreach`` or ``for_loop`` Adam(W); ``auto``: fused on NVIDIA
            GPUs, foreach elsewhere (``fused`` is refused on Kunlun XPUs).
    """

    kernels: KernelConfig = field(default_factory=KernelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    compile: bool | Literal["auto"] = "auto"
    activation_checkpointing: str = "none"
    selective_save_ops: list[str] = field(default_factory=lambda: list(DEFAULT_SELECTIVE_SAVE))
    fp8: Float8Config | None = None
    optimizer: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.kernels, dict):
            self.kernels = KernelConfig(**self.kernels)
        if isinstance(self.attention, dict):
            self.attention = AttentionConfig(**self.attention)
        if isinstance(self.fp8, dict):
            self.fp8 = Float8Config(**self.fp8)
        for name, value in dataclasses.asdict(self.kernels).items():
            _check(f"performance.kernels.{name}", value, ("auto", "triton", "torch"))
        if self.attention.sdpa != "auto":
            for value in self.attention.sdpa:
                _check("performance.attention.sdpa entries", value, SDPA_BACKENDS)
            if not self.attention.sdpa:
                raise ValueError(
                    "performance.attention.sdpa is empty: name at least one backend, or use 'auto'"
                )
        _check("performance.attention.kernel", self.attention.kernel, ATTENTION_KERNELS)
        _check("performance.attention.packed", self.attention.packed, PACKED_BACKENDS)
        _check("performance.compile", self.compile, (True, False, "auto"))
        _check("performance.activation_checkpointing", self.activation_checkpointing, AC_MODES)
        _check("performance.optimizer", self.optimizer, OPTIMIZER_IMPLEMENTATIONS)
        if self.fp8 is not None:
            _check("performance.fp8.recipe", self.fp8.recipe, FP8_RECIPES)
            if self.fp8.fsdp_all_gather and self.fp8.recipe != "tensorwise":
                raise ValueError(
                    f"performance.fp8.fsdp_all_gather needs recipe 'tensorwise' (got {self.fp8.recipe!r}): "
                    "torchao all-gathers FP8 weights with one scale per tensor"
                )

    def to_dict(self) -> dict:
        """Plain containers (for hyperparameters that load with ``weights_only=True``)."""
        return dataclasses.asdict(self)


def _check(option: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{option} ({value!r}) must be one of {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class ResolvedPerformance:
    """A :class:`PerformanceConfig` with every ``auto`` decided for one device."""

    kernels: dict[str, str]
    sdpa: list[str] | None
    packed: str
    attention_kernel: str
    attention_kernel_chosen: bool
    attention_kernel_note: str | None
    compile: bool
    activation_checkpointing: str
    selective_save_ops: tuple[str, ...]
    fp8: Float8Config | None
    optimizer: str


def resolve_for(module: Any, device: torch.device | str) -> ResolvedPerformance:
    """:func:`resolve` of ``module.performance`` for ``device``, cached on the module per device type and platform
    (a module asks at every step, e.g. for its loss kernel)."""
    cache = module.__dict__.setdefault("_resolved_performance", {})
    kind = (torch.device(device).type, capabilities(device).platform)
    if kind not in cache:
        cache[kind] = resolve(module.performance, device)
    return cache[kind]


def resolve(perf: PerformanceConfig, device: torch.device | str) -> ResolvedPerformance:
    """Decide every ``auto`` of ``perf`` for ``device``, from its platform's capabilities.

    Args:
        perf: the run's performance settings.
        device: where the model trains.

    Raises:
        ValueError: a switch asks for what the device's platform cannot run (Triton kernels, ``torch.compile``,
            FP8, cuDNN / flash SDPA backends, FA4, fused Adam on a Kunlun XPU); the message names the switch.
    """
    caps = capabilities(device)
    if refuses_unsupported(device):
        refuse_unsupported(perf, caps)
    compiled = caps.compile if perf.compile == "auto" else bool(perf.compile)
    kernels = {}
    for name, choice in dataclasses.asdict(perf.kernels).items():
        if choice == "auto":
            # Compiled blocks fuse norms, RoPE and SwiGLU with their neighbours; the loss sits outside the blocks.
            choice = "triton" if caps.triton and (name == "cross_entropy" or not compiled) else "torch"
        kernels[name] = choice
    sdpa = perf.attention.sdpa
    if sdpa == "auto":
        sdpa = _auto_sdpa(caps, torch.device(device))
    attention_kernel, note = resolve_attention_kernel(perf.attention, device)
    optimizer = perf.optimizer
    if optimizer == "auto":
        optimizer = "fused" if caps.fused_optimizer else "foreach"
    return ResolvedPerformance(
        kernels=kernels,
        sdpa=sdpa,
        packed=perf.attention.packed,
        attention_kernel=attention_kernel,
        attention_kernel_chosen=perf.attention.kernel == "auto",
        attention_kernel_note=note,
        compile=compiled,
        activation_checkpointing=perf.activation_checkpointing,
        selective_save_ops=tuple(perf.selective_save_ops),
        fp8=perf.fp8,
        optimizer=optimizer,
    )


def _auto_sdpa(caps: DeviceCapabilities, device: torch.device) -> list[str] | None:
    if caps.cudnn_attention:
        return list(CUDA_SDPA_PRIORITY)
    # The SDPA switches are CUDA's (torch.backends.cuda.enable_*_sdp): a CUDA-typed device without cuDNN / flash
    # gets the portable backends; other devices keep torch's default.
    return list(PORTABLE_SDPA_PRIORITY) if device.type == "cuda" else None


def refuse_unsupported(perf: PerformanceConfig, caps: DeviceCapabilities) -> None:
    """Refuse the switches set to what ``caps``' platform cannot run, naming each switch and what to set instead
    (:func:`resolve` asks where :func:`~forge_lightning.accelerators.capabilities.refuses_unsupported`).

    Args:
        perf: the run's performance settings.
        caps: the capabilities of the device's platform.

    Raises:
        ValueError: the first unsupported switch.
    """
    platform = caps.platform
    for name, choice in dataclasses.asdict(perf.kernels).items():
        if choice == "triton" and not caps.triton:
            raise ValueError(
                f"performance.kernels.{name} ('triton') is not supported on {platform}: the platform has no Triton; "
                f"set performance.kernels.{name}: auto or torch"
            )
    if perf.compile is True and not caps.triton:
        raise ValueError(
            f"performance.compile (true) is not supported on {platform}: inductor generates Triton kernels for "
            "accelerators, and the platform has no Triton; set performance.compile: auto or false"
        )
    if perf.fp8 is not None and not caps.fp8:
        raise ValueError(
            f"performance.fp8 (recipe {perf.fp8.recipe!r}) is not supported on {platform}: no FP8 training "
            "kernels there; remove performance.fp8 (set performance.fp8: null) to train in bf16"
        )
    if perf.attention.sdpa != "auto" and not caps.cudnn_attention:
        fused = [name for name in perf.attention.sdpa if name in ("cudnn", "flash")]
        if fused:
            raise ValueError(
                f"performance.attention.sdpa lists {fused}, not supported on {platform}: no cuDNN / FlashAttention "
                "SDPA backends there; list only 'efficient' and 'math', or set performance.attention.sdpa: auto"
            )
    packed = perf.attention.packed
    if (packed == "flex" and not caps.triton) or (packed == "varlen" and not caps.flash_attention):
        kernel = "FlexAttention compiles to Triton" if packed == "flex" else "varlen is FlashAttention's"
        raise ValueError(
            f"performance.attention.packed ({packed!r}) is not supported on {platform}: {kernel}; set "
            "performance.attention.packed: auto or sdpa (SDPA with a block-diagonal document mask)"
        )
    if perf.optimizer == "fused" and not caps.fused_optimizer:
        raise ValueError(
            f"performance.optimizer ('fused') is not supported on {platform}: no fused Adam kernel there; "
            "set performance.optimizer: auto or foreach"
        )


def resolve_attention_kernel(
    attention: AttentionConfig, device: torch.device | str
) -> tuple[str, str | None]:
    """The attention kernel (``sdpa`` or ``fa4``) ``attention.kernel`` and ``attention.packed`` mean on ``device``,
    and why ``auto`` did not pick FA4 (``None`` when it did, or when nothing asked for it).

    Args:
        attention: the run's attention settings.
        device: where the model trains.

    Raises:
        ValueError: ``fa4`` asked for (as ``kernel`` or ``packed``) where FlashAttention-4 cannot run (not
            installed, no CUDA, not Hopper / Blackwell).
    """
    from forge_lightning.kernels.flash4 import device_unsupported

    asked = [
        f"performance.attention.{name}" for name in ("kernel", "packed") if getattr(attention, name) == "fa4"
    ]
    if attention.kernel == "sdpa" and not asked:
        return "sdpa", None
    reason = device_unsupported(device)
    if reason is not None and asked:
        raise ValueError(f"{' and '.join(asked)} 'fa4': {reason}; or set it to 'auto' or 'sdpa'")
    if reason is not None:
        return "sdpa", reason
    return ("sdpa" if attention.kernel == "sdpa" else "fa4"), None

"""The capability table: what each platform's devices support, the one place every ``auto`` and every refusal asks.

A device's type does not say which hardware it is: Kunlun XPUs in the vendor's CUDA-compatible mode (``xpytorch``)
are ``cuda`` devices to torch. Code therefore never decides by ``device.type == "cuda"``; it asks
:func:`capabilities` (``capabilities(x.device).triton``), which answers from the device type, unless an accelerator
registered a platform for that type with :func:`register_platform` (``KunlunAccelerator.setup_device`` registers
:data:`KUNLUN` for its device type; from then on, in that process, devices of that type are Kunlun devices).

A capability says what the platform can run at all; a check of the device itself (an NVIDIA GPU's compute
capability for FA4, FP8 or ``torch._grouped_mm``) still follows where the feature needs one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a platform's devices support.

    Args:
        platform: ``nvidia``, ``kunlun``, ``cpu`` or another device type's name.
        triton: Triton kernels run (``performance.kernels.*: auto`` picks them).
        compile: ``torch.compile`` (inductor) is the ``performance.compile: auto`` choice.
        fp8: torchao FP8 training and FP8 attention (``performance.fp8``).
        cudnn_attention: SDPA's cuDNN and flash backends (the CUDA SDPA priority list).
        flash_attention: FlashAttention-4 and flash-attn varlen kernels.
        fused_optimizer: torch's fused Adam(W) (``performance.optimizer: fused``).
        grouped_mm: ``torch._grouped_mm`` for MoE experts (NVIDIA: Hopper or newer, checked per device).
        cuda_streams: side ``torch.cuda.Stream``s to overlap communication hooks with compute.
        bf16: bf16 tensors and autocast.
        autocast_dtype: the mixed-precision dtype (``None``: no autocast).
        peak_bf16_tflops: dense bf16 peak per device for MFU (``None``: unknown, no MFU logged).
    """

    platform: str
    triton: bool
    compile: bool
    fp8: bool
    cudnn_attention: bool
    flash_attention: bool
    fused_optimizer: bool
    grouped_mm: bool
    cuda_streams: bool
    bf16: bool
    autocast_dtype: torch.dtype | None
    peak_bf16_tflops: float | None


NVIDIA = DeviceCapabilities(
    platform="nvidia",
    triton=True,
    compile=True,
    fp8=True,
    cudnn_attention=True,
    flash_attention=True,
    fused_optimizer=True,
    grouped_mm=True,
    cuda_streams=True,
    bf16=True,
    autocast_dtype=torch.bfloat16,
    peak_bf16_tflops=989.0,  # H100 / H200 SXM dense bf16 (NVIDIA's datasheet), the GPUs the benchmarks ran on
)
"""NVIDIA GPUs (device type ``cuda`` when no other platform is registered for it)."""

KUNLUN = DeviceCapabilities(
    platform="kunlun",
    # The vendor stack has no Triton backend, so inductor (which emits Triton) has none either.
    triton=False,
    compile=False,
    # No FP8 GEMMs in torchao for the XPU, no cuDNN, no FlashAttention: SDPA runs its math / efficient backends.
    fp8=False,
    cudnn_attention=False,
    flash_attention=False,
    # torch's fused Adam is a CUDA kernel the vendor build does not ship; foreach runs on any device.
    fused_optimizer=False,
    grouped_mm=False,
    # The vendor maps torch.cuda.Stream in CUDA-compatible mode, but whether BKCL collectives on a side stream
    # order correctly against compute has not been run on hardware here: the hooks stay on the current stream
    # (correct, without the overlap).
    cuda_streams=False,
    bf16=True,  # P800 (XPU3) computes in bf16
    autocast_dtype=torch.bfloat16,
    peak_bf16_tflops=None,  # no public per-device dense bf16 peak to cite
)
"""Kunlun XPUs (registered by ``KunlunAccelerator`` for its runtime's device type)."""

CPU = DeviceCapabilities(
    platform="cpu",
    triton=False,  # Triton's interpreter runs kernels on CPU when forced (tests); "auto" never picks it
    compile=False,
    fp8=True,  # torchao emulates the FP8 GEMMs and FP8 attention has a torch emulation: slow, but exact to spec
    cudnn_attention=False,
    flash_attention=False,
    fused_optimizer=False,
    grouped_mm=False,
    cuda_streams=False,
    bf16=True,
    autocast_dtype=torch.bfloat16,
    peak_bf16_tflops=None,
)
"""The host CPU."""

_DEFAULTS = {"cuda": NVIDIA, "cpu": CPU}
_registered: dict[str, DeviceCapabilities] = {}


def _unknown(device_type: str) -> DeviceCapabilities:
    # A device type nobody described (xpu, mps, a PrivateUse1 backend): plain torch, nothing assumed.
    return dataclasses.replace(CPU, platform=device_type, fp8=False, bf16=False, autocast_dtype=None)


def capabilities(device: torch.device | str) -> DeviceCapabilities:
    """What the devices of ``device``'s type support in this process.

    Args:
        device: a device, or a device type / device string (``"cuda"``, ``"cuda:1"``, ``"cpu"``).

    Returns:
        The platform registered for the device type, else NVIDIA for ``cuda``, the CPU for ``cpu`` and a
        conservative plain-torch default for any other type.
    """
    device_type = torch.device(device).type
    if device_type in _registered:
        return _registered[device_type]
    return _DEFAULTS.get(device_type) or _unknown(device_type)


def refuses_unsupported(device: torch.device | str) -> bool:
    """Whether a switch set to what ``device``'s platform cannot run is refused there: on the platforms the table
    describes (NVIDIA, Kunlun, any registered one), not on the CPU (Triton's interpreter, inductor's C++ backend
    and torchao's FP8 emulation serve it) nor on device types the table does not describe (their own stacks decide).

    Args:
        device: a device, or a device type / device string.
    """
    device_type = torch.device(device).type
    described = device_type in _registered or device_type in _DEFAULTS
    return described and capabilities(device).platform != "cpu"


def register_platform(device_type: str, caps: DeviceCapabilities) -> None:
    """From now on, in this process, devices of ``device_type`` are ``caps.platform``'s devices.

    Args:
        device_type: a torch device type (``"cuda"`` for Kunlun's CUDA-compatible mode).
        caps: the platform's capabilities (e.g. :data:`KUNLUN`).

    Raises:
        ValueError: ``device_type`` is not a device type, or another platform is already registered for it.
    """
    if torch.device(device_type).type != device_type or ":" in device_type:
        raise ValueError(f"device_type ({device_type!r}) must be a bare torch device type such as 'cuda'")
    current = _registered.get(device_type)
    if current is not None and current != caps:
        raise ValueError(
            f"device type {device_type!r} is already registered as platform {current.platform!r}; "
            f"call unregister_platform({device_type!r}) before registering {caps.platform!r}"
        )
    _registered[device_type] = caps


def unregister_platform(device_type: str) -> None:
    """Undo :func:`register_platform` for ``device_type`` (no-op when nothing is registered).

    Args:
        device_type: the torch device type registered before.
    """
    _registered.pop(device_type, None)


def registered_platforms() -> dict[str, str]:
    """The platforms registered in this process, by device type (``{"cuda": "kunlun"}``)."""
    return {device_type: caps.platform for device_type, caps in _registered.items()}

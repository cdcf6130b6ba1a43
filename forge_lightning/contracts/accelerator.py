"""What strategies and callbacks may ask of an accelerator beyond Lightning's ``Accelerator`` API.

Lightning derives the process-group backend and the device type from the device (``cuda`` -> ``nccl``, anything
else -> ``gloo``). An accelerator whose devices need another answer (Kunlun XPUs: BKCL, a PrivateUse1 device type)
declares it::

    DistributedDevices   process_group_backend, device_mesh_type    DDP / ZeRO-1 / FSDP2 / MegatronStrategy
    MeasuredDevices      synchronize(device), peak_memory_bytes(device)
                                                                     ThroughputMonitor

Lightning's own accelerators implement neither; the helpers give Lightning's answer for them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device


@runtime_checkable
class DistributedDevices(Protocol):
    """An accelerator that names the process-group backend and the DeviceMesh device type of its devices."""

    @property
    def process_group_backend(self) -> str: ...

    @property
    def device_mesh_type(self) -> str: ...


@runtime_checkable
class MeasuredDevices(Protocol):
    """An accelerator that synchronises and measures its devices itself (not through ``torch.cuda``)."""

    def synchronize(self, device: torch.device) -> None: ...

    def peak_memory_bytes(self, device: torch.device) -> int | None: ...


def process_group_backend(accelerator: Any, device: torch.device) -> str:
    """The backend ``accelerator`` declares, else Lightning's default for ``device``."""
    if isinstance(accelerator, DistributedDevices):
        return accelerator.process_group_backend
    return _get_default_process_group_backend_for_device(device)


def device_mesh_type(accelerator: Any, device: torch.device) -> str:
    """The device type ``accelerator`` declares for DeviceMeshes, else ``device``'s type."""
    if isinstance(accelerator, DistributedDevices):
        return accelerator.device_mesh_type
    return device.type

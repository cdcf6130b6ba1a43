"""Accelerators and the capability table their devices are described by.

``KunlunAccelerator`` is registered in Lightning's ``AcceleratorRegistry`` as ``kunlun`` when this package is
imported (the CLI imports it); see docs/kunlun.md.
"""

from lightning.pytorch.accelerators import AcceleratorRegistry

from forge_lightning.accelerators.capabilities import (
    CPU,
    KUNLUN,
    NVIDIA,
    DeviceCapabilities,
    capabilities,
    refuses_unsupported,
    register_platform,
    unregister_platform,
)
from forge_lightning.accelerators.kunlun import KunlunAccelerator
from forge_lightning.accelerators.runtime import KunlunRuntime, MemoryStats, SimulatedRuntime, XmlirRuntime

__all__ = [
    "CPU",
    "KUNLUN",
    "NVIDIA",
    "DeviceCapabilities",
    "KunlunAccelerator",
    "KunlunRuntime",
    "MemoryStats",
    "SimulatedRuntime",
    "XmlirRuntime",
    "capabilities",
    "refuses_unsupported",
    "register_platform",
    "unregister_platform",
]

if KunlunAccelerator.name() not in AcceleratorRegistry:
    KunlunAccelerator.register_accelerators(AcceleratorRegistry)

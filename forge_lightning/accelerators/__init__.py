"""Accelerators and the capability table their devices are described by."""

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

__all__ = [
    "CPU",
    "KUNLUN",
    "NVIDIA",
    "DeviceCapabilities",
    "capabilities",
    "refuses_unsupported",
    "register_platform",
    "unregister_platform",
]

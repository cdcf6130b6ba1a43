"""Accelerators and the capability table their devices are described by.

The capability table (``capabilities``) is imported by the kernels, the performance settings and the layers, so
this package imports nothing heavy itself: the Kunlun accelerator and its runtimes load on first use.
``KunlunAccelerator`` is registered in Lightning's ``AcceleratorRegistry`` as ``kunlun`` when
``forge_lightning.accelerators.kunlun`` is imported (the ``forge`` CLI does; see docs/kunlun.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

_EXPORTS = {
    "KunlunAccelerator": "kunlun",
    "KunlunRuntime": "runtime",
    "MemoryStats": "runtime",
    "SimulatedRuntime": "runtime",
    "XmlirRuntime": "runtime",
}

if TYPE_CHECKING:
    from forge_lightning.accelerators.kunlun import KunlunAccelerator
    from forge_lightning.accelerators.runtime import (
        KunlunRuntime,
        MemoryStats,
        SimulatedRuntime,
        XmlirRuntime,
    )

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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

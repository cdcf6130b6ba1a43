"""``KunlunAccelerator``: Kunlun XPUs as a Lightning accelerator (``trainer.accelerator: kunlun``).

Every vendor call goes through the accelerator's :class:`~forge_lightning.accelerators.runtime.KunlunRuntime`.
Lightning asks an accelerator's class (not the instance) whether it is available and how to parse ``devices``, so
the runtime an instance chose is this process's runtime: the class methods answer from it (one accelerator per
process, as Lightning builds it). In ``setup_device`` the accelerator selects the process's device, registers the
:data:`~forge_lightning.accelerators.capabilities.KUNLUN` capabilities for its device type (Triton, compile, FP8,
cuDNN / FlashAttention off) and seeds the device generators from the seed Lightning set.

Strategies read the process-group backend and the DeviceMesh device type from it
(:class:`~forge_lightning.contracts.DistributedDevices`), the throughput callback its synchronisation and memory
(:class:`~forge_lightning.contracts.MeasuredDevices`).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from forge_lightning.accelerators.capabilities import (
    KUNLUN,
    capabilities,
    register_platform,
    unregister_platform,
)
from forge_lightning.accelerators.runtime import KunlunRuntime, SimulatedRuntime, XmlirRuntime, import_xmlir

RUNTIMES = ("auto", "xmlir", "simulated")

_log = logging.getLogger(__name__)
if not _log.handlers:  # as Lightning does for its own loggers: every process prints which device it set up
    _log.addHandler(logging.StreamHandler())
    _log.setLevel(logging.INFO)
    _log.propagate = False
_active: KunlunRuntime | None = None
_HOST = torch.device("cpu")


def make_runtime(runtime: str, simulated_devices: int = 8) -> KunlunRuntime:
    """The runtime named ``runtime``.

    Args:
        runtime: ``xmlir`` (the vendor's ``torch_xmlir``), ``simulated`` (CPU, tests) or ``auto`` (``xmlir``; it
            never falls back to the simulation).
        simulated_devices: devices of the simulated runtime.

    Raises:
        ValueError: an unknown runtime name.
        ImportError: ``xmlir`` / ``auto`` without ``torch_xmlir`` installed (the message says what to install).
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    if runtime == "simulated":
        return SimulatedRuntime(simulated_devices)
    import_xmlir()
    return XmlirRuntime()


def active_runtime() -> KunlunRuntime:
    """This process's runtime: the last ``KunlunAccelerator``'s, else the real one (not yet imported)."""
    return _active if _active is not None else XmlirRuntime()


class KunlunAccelerator(Accelerator):
    """Kunlun XPUs (P800 and later) through the vendor's ``torch_xmlir``, or simulated on the CPU.

    Registered as ``kunlun`` (``trainer.accelerator: kunlun`` uses ``runtime: auto``); the class path takes the
    arguments::

        trainer:
          accelerator:
            class_path: forge_lightning.accelerators.KunlunAccelerator
            init_args: {runtime: simulated}

    Args:
        runtime: ``auto`` / ``xmlir``: the vendor's runtime (an ``ImportError`` that says what to install when
            ``torch_xmlir`` is missing); ``simulated``: ``simulated_devices`` devices on the host CPU over gloo,
            through the same accelerator code (tests and CI).
        simulated_devices: devices the simulated runtime reports.
    """

    def __init__(self, runtime: str = "auto", simulated_devices: int = 8) -> None:
        global _active
        super().__init__()
        self.runtime_name = runtime
        self.runtime = make_runtime(runtime, simulated_devices)
        _active = self.runtime
        self._registered: str | None = None

    # ----- what strategies and callbacks read ------------------------------------------------------------------
    @property
    def process_group_backend(self) -> str:
        """The ``torch.distributed`` backend of this runtime's devices (``nccl`` -> BKCL in CUDA-compatible mode)."""
        return self.runtime.process_group_backend

    @property
    def device_mesh_type(self) -> str:
        """The device type DeviceMeshes over these devices are built with."""
        return self.runtime.device_type

    def synchronize(self, device: torch.device) -> None:
        """Wait for the work queued on ``device``."""
        self.runtime.synchronize(_index(device))

    def peak_memory_bytes(self, device: torch.device) -> int | None:
        """The peak allocation on ``device`` since the last reset (``None``: the runtime cannot tell)."""
        return self.runtime.memory_stats(_index(device)).peak_allocated

    # ----- Lightning's Accelerator -----------------------------------------------------------------------------
    @override
    def setup_device(self, device: torch.device) -> None:
        """Select ``device``, register the Kunlun capabilities for its type and seed the device generators.

        Raises:
            ValueError: ``device`` is not one of this runtime's devices.
        """
        if device == _HOST and self.runtime.device_type != "cpu":
            # Lightning gives a one-device run of an accelerator it does not know a SingleDeviceStrategy on the
            # host CPU (its connector's _choose_strategy); `setup` moves that strategy onto the selected Kunlun
            # device before the model moves. The capabilities hold from here already (configure_model reads them).
            self._register()
            return
        if device.type != self.runtime.device_type:
            raise ValueError(
                f"KunlunAccelerator ({self.runtime.name}) runs on {self.runtime.device_type!r} devices, got {device}"
            )
        self._activate(_index(device))

    def _register(self) -> None:
        register_platform(self.runtime.device_type, KUNLUN)
        self._registered = self.runtime.device_type

    def _activate(self, index: int) -> None:
        self.runtime.set_device(index)
        self._register()
        # Lightning seeded torch before the accelerator existed; the device generators follow that seed.
        self.runtime.manual_seed_all(torch.initial_seed())
        device = torch.device(self.runtime.device_type, index)
        _log.info(
            f"kunlun ({self.runtime.name}): {self.runtime.device_count()} devices; this process on {device} "
            f"({self.runtime.device_name(index)}); process group backend {self.process_group_backend}; "
            f"platform {capabilities(device).platform}"
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Move a host-CPU single-device strategy onto the selected device (see ``setup_device``), point Lightning's
        mixed precision at this runtime's device type (it assumes ``cuda`` for every accelerator but the CPU) and
        start the memory peak from here."""
        strategy = trainer.strategy
        if (
            isinstance(strategy, SingleDeviceStrategy)
            and strategy.root_device.type != self.runtime.device_type
        ):
            device = trainer._accelerator_connector._parallel_devices[0]  # the one `trainer.devices` selected
            strategy._root_device = device
            self._activate(_index(device))
        plugin = trainer.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.device != self.runtime.device_type:
            plugin.device = self.runtime.device_type
        self.runtime.reset_peak_memory_stats(_index(strategy.root_device))

    @override
    def teardown(self) -> None:
        if self._registered is not None:
            unregister_platform(self._registered)
            self._registered = None

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        """``memory_allocated`` / ``memory_reserved`` / ``memory_peak_allocated`` of ``device``, in bytes."""
        stats = self.runtime.memory_stats(_index(torch.device(device)))
        values = {
            "allocated": stats.allocated,
            "reserved": stats.reserved,
            "peak_allocated": stats.peak_allocated,
        }
        return {f"memory_{key}": value for key, value in values.items() if value is not None}

    @classmethod
    @override
    def parse_devices(cls, devices: int | str | list[int]) -> list[int]:
        """The device indices ``devices`` names: ``n`` (the first n), ``-1`` / ``"auto"`` (all), ``"0,2"`` or
        ``[0, 2]`` (those).

        Raises:
            ValueError: no device, an index out of range, a repeated index, or a value of another type.
        """
        count = active_runtime().device_count()
        indices = _indices(devices, count)
        if not indices:
            raise ValueError(
                f"devices ({devices!r}) selects no Kunlun device; give a count, -1 or a list of indices"
            )
        if len(set(indices)) != len(indices):
            raise ValueError(f"devices ({devices!r}) repeats a device index")
        bad = [i for i in indices if not 0 <= i < count]
        if bad:
            raise ValueError(
                f"devices ({devices!r}): indices {bad} are out of range, this process sees {count}"
            )
        return indices

    @classmethod
    @override
    def get_parallel_devices(cls, devices: list[int]) -> list[torch.device]:
        """One torch device per index, of the runtime's device type."""
        device_type = active_runtime().device_type
        return [torch.device(device_type, i) for i in devices]

    @classmethod
    @override
    def auto_device_count(cls) -> int:
        """Every device the runtime sees."""
        return active_runtime().device_count()

    @classmethod
    @override
    def is_available(cls) -> bool:
        return active_runtime().is_available()

    @staticmethod
    @override
    def name() -> str:
        return "kunlun"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(
            cls.name(), cls, description="Kunlun XPUs through the vendor's torch_xmlir"
        )


def _index(device: torch.device) -> int:
    return 0 if device.index is None else device.index


def _indices(devices: Any, count: int) -> list[int]:
    if isinstance(devices, bool):
        raise ValueError(f"devices must be a count, -1, 'auto' or a list of indices, got {devices!r}")
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto" or text == "-1":
            return list(range(count))
        if "," in text:
            return [_int(part, devices) for part in text.split(",") if part.strip()]
        return _indices(_int(text, devices), count)
    if isinstance(devices, int):
        if devices == -1:
            return list(range(count))
        if devices < 0:
            raise ValueError(f"devices ({devices}) must be a positive count or -1 (all)")
        if devices > count:
            raise ValueError(
                f"devices ({devices}) asks for more Kunlun devices than this process sees ({count})"
            )
        return list(range(devices))
    if isinstance(devices, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in devices
    ):
        return list(devices)
    raise ValueError(f"devices must be a count, -1, 'auto' or a list of indices, got {devices!r}")


def _int(text: str, devices: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(
            f"devices ({devices!r}) must be a count, -1, 'auto' or comma-separated indices"
        ) from None


if KunlunAccelerator.name() not in AcceleratorRegistry:
    KunlunAccelerator.register_accelerators(AcceleratorRegistry)

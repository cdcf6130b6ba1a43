"""The vendor calls a Kunlun accelerator makes, behind one small interface with two implementations.

``KunlunAccelerator`` never calls the vendor stack directly: it asks a :class:`KunlunRuntime` ::

    KunlunAccelerator ──▶ KunlunRuntime ──┬─ XmlirRuntime      torch_xmlir (xpytorch): torch.cuda in the
                                          │                    CUDA-compatible mode, torch.<name> under PrivateUse1
                                          └─ SimulatedRuntime  N simulated devices on the host CPU, gloo (tests)

What the real runtime relies on, from public sources (not run on Kunlun hardware here):

* vLLM-Kunlun (``vllm_kunlun/platforms/kunlun.py``, the vendor's own platform plugin): with ``torch_xmlir``
  imported the XPUs are ``cuda`` devices, ``torch.cuda.set_device`` selects one, ``torch.cuda.max_memory_allocated``
  / ``reset_peak_memory_stats`` report memory, and the process-group backend is ``nccl``.
* vLLM-Kunlun's notes on the ``torch_xmlir`` runtime (PR #462, "openwiki/torch-xmlir"): ``import torch_xmlir``
  replaces the CUDA kernels and maps ``nccl`` onto its BKCL process group (``kccl``, reported back as ``nccl``);
  ``torch.cuda``'s streams and caching allocator are PyTorch's own and work (``torch_xmlir.xpu``'s memory functions
  do not, and ``XMLIR_DISABLE_CUDA_ALLOCATOR=1`` would route ``torch.cuda.memory_*`` to them);
  ``torch_xmlir.xpu.get_device_name`` reports the XPU's own name (``torch.cuda.get_device_name`` says ``GPU``);
  ``torch.xpu`` is Intel's and reports no device.

Assumed, not confirmed by a public source: a vendor build that registers a PrivateUse1 device (torch's
``rename_privateuse1_backend``) exposes the usual ``torch.<name>`` device module (``device_count``, ``set_device``,
``synchronize``, ``manual_seed_all``, the ``memory_*`` functions) and registers its process-group backend as the
default for that device type (``torch.distributed.Backend.register_backend(..., devices=[name])``).
"""

from __future__ import annotations

import importlib
import resource
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

MISSING_XMLIR = (
    "the Kunlun runtime needs the vendor's PyTorch build: install xpytorch (Python module torch_xmlir, with BKCL) "
    "from the Kunlunxin SDK into this environment (see docs/kunlun.md). To run the plugin without Kunlun hardware "
    "(tests, CI) use trainer.accelerator: {class_path: forge_lightning.accelerators.KunlunAccelerator, "
    "init_args: {runtime: simulated}}"
)


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one device, in bytes (``None``: the runtime cannot tell).

    Args:
        allocated: bytes held by live tensors.
        reserved: bytes the caching allocator holds (allocated + cached).
        peak_allocated: the most ``allocated`` has been since the last reset.
    """

    allocated: int | None
    reserved: int | None
    peak_allocated: int | None


@runtime_checkable
class KunlunRuntime(Protocol):
    """What ``KunlunAccelerator`` asks of the vendor stack (or of its simulation)."""

    @property
    def name(self) -> str:
        """``xmlir (cuda-compatible)``, ``xmlir (privateuse1: <name>)`` or ``simulated``."""
        ...

    @property
    def device_type(self) -> str:
        """The torch device type of this runtime's devices."""
        ...

    @property
    def process_group_backend(self) -> str:
        """The ``torch.distributed`` backend for these devices."""
        ...

    def is_available(self) -> bool:
        """Whether this process can use at least one device (never raises)."""
        ...

    def device_count(self) -> int:
        """Number of devices this process sees."""
        ...

    def set_device(self, index: int) -> None:
        """Make device ``index`` the current one."""
        ...

    def current_device(self) -> int:
        """Index of the current device."""
        ...

    def synchronize(self, index: int | None = None) -> None:
        """Wait for the work queued on device ``index`` (``None``: the current one)."""
        ...

    def memory_stats(self, index: int) -> MemoryStats:
        """Memory of device ``index``."""
        ...

    def reset_peak_memory_stats(self, index: int) -> None:
        """Restart the peak of device ``index`` from its current allocation."""
        ...

    def manual_seed_all(self, seed: int) -> None:
        """Seed the random generators of every device."""
        ...

    def device_name(self, index: int) -> str:
        """The hardware name of device ``index``."""
        ...


MIN_TORCH = (2, 6)
"""The oldest torch the project runs on (pyproject's ``torch>=2.6``): FSDP2's public ``fully_shard``, DTensor."""


def check_torch_version(version: str) -> None:
    """Refuse a vendor torch older than the project's minimum, naming both versions.

    Args:
        version: ``torch.__version__`` of the vendor build (e.g. ``2.5.1+xmlir``).

    Raises:
        RuntimeError: ``version`` is older than :data:`MIN_TORCH`.
    """
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    if (major, minor) < MIN_TORCH:
        raise RuntimeError(
            f"the installed xpytorch is built on torch {version}; forge-lightning needs torch >= "
            f"{'.'.join(map(str, MIN_TORCH))} (FSDP2, DTensor): install the vendor's build for a newer torch "
            "(see docs/kunlun.md, Install)"
        )


def import_xmlir() -> ModuleType:
    """``import torch_xmlir`` (the vendor's module), or an ``ImportError`` that says what to install; a vendor torch
    older than the project's minimum is refused (:func:`check_torch_version`)."""
    try:
        module = importlib.import_module("torch_xmlir")
    except ImportError as err:
        raise ImportError(MISSING_XMLIR) from err
    check_torch_version(torch.__version__)
    return module


def _privateuse1_name() -> str:
    return torch._C._get_privateuse1_backend_name()


class XmlirRuntime:
    """The real runtime, over the vendor's ``torch_xmlir`` (imported when first needed, not at import).

    Two modes, detected after ``import torch_xmlir``:

    * CUDA-compatible (xpytorch for torch 2.5.1, and newer builds that keep it): devices are ``cuda``, every call
      goes through ``torch.cuda`` and the backend is ``nccl`` (BKCL underneath).
    * PrivateUse1: when the import renamed torch's PrivateUse1 backend (``torch._C._get_privateuse1_backend_name()``
      is no longer ``privateuseone``), devices are of that type, calls go through ``torch.<name>`` and the backend
      is the one the vendor registered for that device type.
    """

    def __init__(self) -> None:
        self._xmlir: ModuleType | None = None
        self._device_type: str | None = None

    def _load(self) -> ModuleType:
        if self._xmlir is None:
            self._xmlir = import_xmlir()
            renamed = _privateuse1_name()
            self._device_type = "cuda" if renamed == "privateuseone" else renamed
        return self._xmlir

    @property
    def mode(self) -> str:
        """``cuda-compatible`` or ``privateuse1``."""
        return "cuda-compatible" if self.device_type == "cuda" else "privateuse1"

    @property
    def name(self) -> str:
        return (
            "xmlir (cuda-compatible)"
            if self.mode == "cuda-compatible"
            else f"xmlir (privateuse1: {self.device_type})"
        )

    @property
    def device_type(self) -> str:
        self._load()
        assert self._device_type is not None
        return self._device_type

    @property
    def version(self) -> str:
        """``torch_xmlir.__version__`` (``unknown`` when the build does not say)."""
        return str(getattr(self._load(), "__version__", "unknown"))

    def _devices(self) -> ModuleType:
        device_type = self.device_type
        module = getattr(torch, device_type, None)
        if not isinstance(module, ModuleType):
            raise RuntimeError(
                f"torch_xmlir registered the PrivateUse1 device {device_type!r} but no torch.{device_type} device "
                "module: this xpytorch build is not supported by the plugin (docs/kunlun.md lists the tested APIs)"
            )
        return module

    def _call(self, function: str, *args: Any) -> Any:
        fn = getattr(self._devices(), function, None)
        if fn is None:
            raise RuntimeError(f"torch.{self.device_type}.{function} is missing from this xpytorch build")
        return fn(*args)

    @property
    def process_group_backend(self) -> str:
        if self.mode == "cuda-compatible":
            return "nccl"  # torch_xmlir maps it onto its BKCL process group
        backend = dist.Backend.default_device_backend_map.get(self.device_type)
        if backend is None:
            raise RuntimeError(
                f"torch_xmlir registered no process-group backend for device type {self.device_type!r}: set the "
                "strategy's process_group_backend to the vendor's BKCL backend name"
            )
        return backend

    def is_available(self) -> bool:
        try:
            return self.device_count() > 0
        except (ImportError, RuntimeError):
            return False

    def device_count(self) -> int:
        return int(self._call("device_count"))

    def set_device(self, index: int) -> None:
        self._call("set_device", index)

    def current_device(self) -> int:
        return int(self._call("current_device"))

    def synchronize(self, index: int | None = None) -> None:
        self._call("synchronize", *([] if index is None else [index]))

    def memory_stats(self, index: int) -> MemoryStats:
        # torch's caching allocator in the CUDA-compatible mode (see the module docstring).
        devices = self._devices()
        values = []
        for function in ("memory_allocated", "memory_reserved", "max_memory_allocated"):
            fn = getattr(devices, function, None)
            values.append(None if fn is None else int(fn(index)))
        return MemoryStats(*values)

    def reset_peak_memory_stats(self, index: int) -> None:
        self._call("reset_peak_memory_stats", index)

    def manual_seed_all(self, seed: int) -> None:
        self._call("manual_seed_all", seed)

    def device_name(self, index: int) -> str:
        xpu = getattr(self._load(), "xpu", None)
        if xpu is not None and hasattr(xpu, "get_device_name"):
            return str(xpu.get_device_name(index))
        return str(self._call("get_device_name", index))


class SimulatedRuntime:
    """``num_devices`` simulated Kunlun devices on the host CPU, for tests and CI without the hardware.

    Devices are ``cpu`` devices (``cpu:0`` ... ``cpu:N-1``), the backend is ``gloo``; every call is appended to
    :attr:`calls` so a test can check what the accelerator asked. Seeding records the seed and leaves the host's
    generator alone (the simulated devices have none of their own, and reseeding the CPU generator would change
    the run). Memory is the process's peak resident set, the only memory the simulated devices have.

    Args:
        num_devices: devices the simulation reports (8: one Kunlun node).
    """

    name = "simulated"
    device_type = "cpu"
    process_group_backend = "gloo"

    def __init__(self, num_devices: int = 8) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices ({num_devices}) must be at least 1")
        self.num_devices = num_devices
        self.calls: list[tuple[Any, ...]] = []
        self._current = 0

    def _check(self, index: int) -> int:
        if not 0 <= index < self.num_devices:
            raise ValueError(
                f"device index {index} is out of range: the simulation has {self.num_devices} devices"
            )
        return index

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        self.calls.append(("device_count",))
        return self.num_devices

    def set_device(self, index: int) -> None:
        self._current = self._check(index)
        self.calls.append(("set_device", index))

    def current_device(self) -> int:
        return self._current

    def synchronize(self, index: int | None = None) -> None:
        self.calls.append(("synchronize", index))

    def memory_stats(self, index: int) -> MemoryStats:
        self.calls.append(("memory_stats", self._check(index)))
        # ru_maxrss is KiB on Linux, bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return MemoryStats(allocated=peak, reserved=peak, peak_allocated=peak)

    def reset_peak_memory_stats(self, index: int) -> None:
        self.calls.append(("reset_peak_memory_stats", self._check(index)))

    def manual_seed_all(self, seed: int) -> None:
        self.calls.append(("manual_seed_all", seed))

    def device_name(self, index: int) -> str:
        return f"simulated Kunlun XPU {self._check(index)}"

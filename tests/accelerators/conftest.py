"""A stand-in for the vendor's ``torch_xmlir`` that records every call the real runtime makes.

It offers exactly the API the public sources document (see forge_lightning/accelerators/runtime.py) and nothing
else, so a runtime call the vendor does not have fails here, not on a cluster:

* CUDA-compatible mode: ``import torch_xmlir`` leaves the devices to ``torch.cuda`` (stood in for by recorders of
  ``device_count``, ``set_device``, ``current_device``, ``synchronize``, the ``memory_*`` functions and
  ``manual_seed_all``); ``torch_xmlir.xpu.get_device_name`` names the XPU.
* PrivateUse1 mode: the import renames torch's PrivateUse1 backend (``kunlunxpu`` here), adds a ``torch.kunlunxpu``
  device module with the same functions and registers ``kccl`` as that device type's process-group backend.
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

PRIVATEUSE1_NAME = "kunlunxpu"
DEVICES = 8


@dataclass
class StandIn:
    """The stand-in's recorded calls (``(function, *args)``) and the memory it reports."""

    mode: str
    devices: int = DEVICES
    privateuse1_name: str = PRIVATEUSE1_NAME
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    current: int = 0
    memory: dict[str, int] = field(
        default_factory=lambda: {
            "memory_allocated": 3 << 30,
            "memory_reserved": 4 << 30,
            "max_memory_allocated": 5 << 30,
        }
    )

    def device_module(self) -> types.SimpleNamespace:
        """The functions of ``torch.cuda`` / ``torch.<privateuse1>`` the runtime may call, each recording."""

        def record(name: str, result: Any = None):
            def fn(*args: Any) -> Any:
                self.calls.append((name, *args))
                return result(*args) if callable(result) else result

            return fn

        def set_device(index: int) -> None:
            self.current = index

        return types.SimpleNamespace(
            device_count=record("device_count", DEVICES),
            set_device=record("set_device", set_device),
            current_device=record("current_device", lambda: self.current),
            synchronize=record("synchronize"),
            memory_allocated=record("memory_allocated", lambda i: self.memory["memory_allocated"]),
            memory_reserved=record("memory_reserved", lambda i: self.memory["memory_reserved"]),
            max_memory_allocated=record(
                "max_memory_allocated", lambda i: self.memory["max_memory_allocated"]
            ),
            reset_peak_memory_stats=record("reset_peak_memory_stats"),
            manual_seed_all=record("manual_seed_all"),
            get_device_name=record("get_device_name", "GPU"),  # the CUDA shim's answer (vLLM-Kunlun's notes)
        )

    def xmlir_module(self) -> types.ModuleType:
        """``torch_xmlir`` with ``__version__`` and ``xpu.get_device_name``."""
        module = types.ModuleType("torch_xmlir")
        module.__version__ = "1.0.0.1"

        def get_device_name(index: int) -> str:
            self.calls.append(("xpu.get_device_name", index))
            return "KL3"

        module.xpu = types.SimpleNamespace(get_device_name=get_device_name)
        return module


def _install(monkeypatch: pytest.MonkeyPatch, mode: str) -> StandIn:
    stand_in = StandIn(mode)
    monkeypatch.setitem(sys.modules, "torch_xmlir", stand_in.xmlir_module())
    functions = vars(stand_in.device_module())
    if mode == "cuda":
        for name, fn in functions.items():
            monkeypatch.setattr(torch.cuda, name, fn)
    else:
        # Renaming PrivateUse1 is permanent in a process: the name torch reports is stood in for instead.
        monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: PRIVATEUSE1_NAME)
        module = types.ModuleType(f"torch.{PRIVATEUSE1_NAME}")
        vars(module).update(functions)
        monkeypatch.setattr(torch, PRIVATEUSE1_NAME, module, raising=False)
        monkeypatch.setitem(dist.Backend.default_device_backend_map, PRIVATEUSE1_NAME, "kccl")
    return stand_in


@pytest.fixture(params=["cuda", "privateuse1"])
def xmlir(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> StandIn:
    """The stand-in ``torch_xmlir`` installed, in each of its two modes."""
    return _install(monkeypatch, request.param)


@pytest.fixture
def xmlir_cuda(monkeypatch: pytest.MonkeyPatch) -> StandIn:
    """The stand-in ``torch_xmlir`` in its CUDA-compatible mode."""
    return _install(monkeypatch, "cuda")


@pytest.fixture
def no_xmlir(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``torch_xmlir`` importable, whatever the machine has."""
    monkeypatch.setitem(sys.modules, "torch_xmlir", None)


@pytest.fixture(autouse=True)
def _runtime_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's accelerators leave the process's runtime and registered platforms as they were."""
    kunlun = importlib.import_module("forge_lightning.accelerators.kunlun")
    # The package exports the function ``capabilities`` under the module's name.
    table = importlib.import_module("forge_lightning.accelerators.capabilities")
    monkeypatch.setattr(kunlun, "_active", kunlun._active)
    monkeypatch.setattr(table, "_registered", dict(table._registered))

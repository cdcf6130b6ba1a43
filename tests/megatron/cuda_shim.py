"""Test-only shim: maps megatron-core's hard-coded CUDA calls to the CPU so its real code runs on gloo.

megatron-core 0.16 calls ``torch.cuda.current_device()`` for buffers, keeps its RNG tracker in CUDA generators,
times and synchronises with CUDA streams / events and checks ``param.type() == "torch.cuda.FloatTensor"``. None
of that changes the arithmetic, so for CPU tests it is redirected:

* the current CUDA device is the CPU; ``Tensor.cuda()`` is the identity;
* the CUDA RNG state is the CPU generator's;
* streams, events, synchronisation, ``Tensor.record_stream`` and NVTX ranges are no-ops (megatron's combined
  1F1B schedule of ``overlap_moe_expert_parallel_comm`` then runs its nodes in order);
* ``Tensor.type()`` of a CPU tensor reports the CUDA type name megatron expects;
* a ``device="cuda"`` argument of any torch function (``torch.tensor(..., device="cuda")``) means the CPU, and
  ``pin_memory=True`` is dropped (the context-parallel RoPE slicing asks for it);
* the MoE token dispatcher's device-to-host copy of its all-to-all split sizes gives numpy arrays, as on a GPU.

Never imported by the package (a test checks it); the test entry point and conftest install it with
:func:`install`.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_installed = False


class _FakeStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _FakeEvent:
        return _FakeEvent()

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _FakeStream:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class _FakeEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_ORIGINAL_TYPE = torch.Tensor.type


def _is_cuda(value: Any) -> bool:
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):  # no pinned-memory allocator without CUDA
            kwargs = {**kwargs, "pin_memory": False}
        if any(_is_cuda(a) for a in args):
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    if dtype is None and not kwargs and self.device.type == "cpu":
        name = _ORIGINAL_TYPE(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    return _ORIGINAL_TYPE(self, dtype, non_blocking, **kwargs)


_PATCHES = {
    "current_device": lambda: _CPU,
    "device_count": lambda: 1,
    "synchronize": lambda *a, **k: None,
    "empty_cache": lambda: None,
    "Stream": _FakeStream,
    "Event": _FakeEvent,
    "current_stream": lambda *a, **k: _FakeStream(),
    "default_stream": lambda *a, **k: _FakeStream(),
    "stream": lambda *a, **k: contextlib.nullcontext(),
    "set_stream": lambda *a, **k: None,
    "get_rng_state": lambda *a, **k: torch.get_rng_state(),
    "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
    "manual_seed": lambda seed: None,  # the CPU generator is seeded by the test
    "manual_seed_all": lambda seed: None,
    "memory_allocated": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "nvtx": types.SimpleNamespace(
        range_push=lambda *a, **k: None,
        range_pop=lambda *a, **k: None,
        range=lambda *a, **k: contextlib.nullcontext(),
        mark=lambda *a, **k: None,
    ),
}
_saved: dict[str, Any] = {}
_mode: Any = None


def uninstall() -> None:
    """Undo :func:`install` (megatron's RNG helpers stay patched: only megatron code calls them)."""
    global _installed, _mode
    if not _installed:
        return
    for name, original in _saved.items():
        if name.startswith("Tensor."):
            setattr(torch.Tensor, name.removeprefix("Tensor."), original)
        else:
            setattr(torch.cuda, name, original)
    _saved.clear()
    _mode.__exit__(None, None, None)
    _mode = None
    _installed = False


def install() -> None:
    """Patch ``torch.cuda`` and megatron-core's RNG helpers for CPU runs (idempotent; see :func:`uninstall`)."""
    global _installed, _mode
    if _installed:
        return
    _installed = True
    for name, patch in _PATCHES.items():
        _saved[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, patch)
    _saved["Tensor.cuda"], _saved["Tensor.type"] = torch.Tensor.cuda, torch.Tensor.type
    _saved["Tensor.record_stream"] = torch.Tensor.record_stream
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.record_stream = lambda self, stream: None
    torch.Tensor.type = _tensor_type
    _mode = _CudaToCpu()
    _mode.__enter__()

    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import token_dispatcher

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_to_host


def _split_sizes_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's MoE token dispatcher moves its all-to-all split sizes off the GPU as numpy arrays (what
    ``all_to_all_single`` takes); for CPU tensors its helper keeps the tensor, which gloo refuses."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

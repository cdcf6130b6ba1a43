"""Backend selection for the kernels: Triton where the device's platform has it (NVIDIA GPUs), the plain-torch
reference elsewhere (Kunlun XPUs, which are ``cuda`` devices in their CUDA-compatible mode, the CPU, ...).

Triton is an optional dependency (the ``kernels`` extra) and is never imported when this package is.
Kernels are plain Python functions wrapped in :class:`TritonKernel`, which imports Triton and jits them on
first launch, once per mode: compiled, or Triton's CPU interpreter when ``TRITON_INTERPRET=1`` is set at
that moment. Each jitted copy gets its own globals, where ``tl`` is ``triton.language`` and
``add_combine`` / ``max_combine`` are reduction combiners jitted in the same mode.

Kernels therefore avoid Triton's own jitted library functions (``tl.sum``, ``tl.max``, ``tl.sigmoid``,
``tl.zeros``): those are fixed to one mode when triton is first imported (and ``import lightning`` imports
triton), so the interpreter could not run them after a compiled-mode import. They use
``tl.reduce(x, axis, add_combine)``, ``tl.reduce(x, axis, max_combine)``, ``1 / (1 + tl.exp(-x))`` and
``tl.full`` instead, which generate the same code.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import types
from collections.abc import Callable, Collection
from typing import Any, Literal

import torch

from forge_lightning.accelerators.capabilities import capabilities, refuses_unsupported

# Placeholders so kernel modules can name them; every jitted kernel sees the real objects (see above).
tl: Any = None
add_combine: Any = None
max_combine: Any = None

Backend = Literal["auto", "triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def use_triton(backend: Backend, *tensors: torch.Tensor | None) -> bool:
    """Decides whether a kernel call runs its Triton implementation.

    Args:
        backend: see :func:`triton_backend_for`; ``"torch"`` always runs the reference.
        *tensors: the call's tensor arguments (``None`` entries are ignored).

    Returns:
        True for the Triton implementation, False for the torch reference (also for empty inputs, which have
        nothing to launch: the reference returns the same empty results).

    Raises:
        ValueError: for an unknown backend name.
        RuntimeError: for ``backend="triton"`` when Triton cannot run on these tensors.
    """
    present = [t for t in tensors if t is not None]
    chosen = triton_backend_for(backend, {t.device.type for t in present})
    return chosen and all(t.numel() > 0 for t in present)


def triton_backend_for(backend: Backend, device_types: Collection[str]) -> bool:
    """Whether a call with tensors on ``device_types`` runs Triton (the decision of :func:`use_triton`).

    Args:
        backend: ``"auto"`` picks Triton when every tensor is on one device type whose platform has Triton
            (:mod:`forge_lightning.accelerators.capabilities`: NVIDIA GPUs) and triton imports, the torch
            reference otherwise (Kunlun XPUs, CPU, ...). ``"triton"`` insists on Triton: on such a device, or on
            CPU when Triton's interpreter is enabled. ``"torch"`` always runs the reference.
        device_types: the device types of the call's tensors (``"cuda"``, ``"cpu"``).

    Raises:
        ValueError: for an unknown backend name.
        RuntimeError: for ``backend="triton"`` when Triton cannot run on these devices.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    devices = set(device_types)
    caps = capabilities(next(iter(devices))) if len(devices) == 1 else None
    if backend == "auto":
        return caps is not None and caps.triton and triton_available()
    if caps is not None and not caps.triton and refuses_unsupported(next(iter(devices))):
        raise RuntimeError(
            f"backend='triton' needs Triton, which {caps.platform} devices do not have; set the kernel's "
            "performance.kernels.<name> to 'auto' or 'torch' (backend='auto' or 'torch') for the plain-torch "
            "reference"
        )
    if not triton_available():
        raise RuntimeError(
            "backend='triton' needs the `triton` package (install forge-lightning[kernels]); "
            "use backend='auto' or 'torch' to run the plain-torch reference"
        )
    if (caps is not None and caps.triton) or (devices == {"cpu"} and interpreter_enabled()):
        return True
    raise RuntimeError(
        f"backend='triton' runs on CUDA tensors, or on CPU tensors under Triton's interpreter "
        f"(TRITON_INTERPRET=1); got tensors on {sorted(devices)}. Use backend='auto' or 'torch' for "
        "the plain-torch reference"
    )


def _add_combine(a, b):
    return a + b


def _max_combine(a, b):
    return tl.maximum(a, b)


def _jit(fn: Callable[..., Any], scope: dict[str, Any]) -> Any:
    """``triton.jit`` of a copy of ``fn`` whose globals are ``fn``'s, with ``tl`` and ``scope`` added."""
    import triton
    import triton.language as language

    scope = {"tl": language, **scope}
    clone = types.FunctionType(fn.__code__, {**fn.__globals__, **scope}, fn.__name__, fn.__defaults__)
    clone.__qualname__, clone.__annotations__ = fn.__qualname__, fn.__annotations__
    return triton.jit(clone)


@functools.cache
def _kernel_scope(interpret: bool) -> dict[str, Any]:
    """The names kernels jitted in this mode see (``interpret`` keys the cache; Triton reads the env)."""
    import triton.language as language

    scope = {"tl": language, "add_combine": _jit(_add_combine, {}), "max_combine": _jit(_max_combine, {})}
    if interpret:
        # The interpreter reduces with numpy when handed Triton's own combiners (matched by identity, never
        # called), and calls any other combiner once per element.
        standard = language.standard
        scope["add_combine"] = getattr(standard, "_sum_combine", scope["add_combine"])
        scope["max_combine"] = getattr(standard, "_elementwise_max", scope["max_combine"])
    return scope


class TritonKernel:
    """A Triton kernel jitted on first launch, once per mode (compiled / interpreted).

    Launch it like a jitted kernel: ``kernel[grid](*args, BLOCK=...)``.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._jitted: dict[bool, Any] = {}
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        interpret = interpreter_enabled()
        if interpret not in self._jitted:
            self._jitted[interpret] = _jit(self.fn, _kernel_scope(interpret))
        return self._jitted[interpret][grid]


def triton_kernel(fn: Callable[..., None]) -> TritonKernel:
    """Decorator: marks ``fn`` as a Triton kernel, jitted lazily (see :class:`TritonKernel`)."""
    return TritonKernel(fn)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_warps_for(block: int) -> int:
    """A num_warps heuristic for one-row-per-program kernels over ``block`` elements."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """Views ``x`` as ``[rows, last_dim]`` with a unit stride on the last dim, copying only if needed."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2

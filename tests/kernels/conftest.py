"""Fixtures for the kernel tests.

Triton kernels run on CPU tensors in Triton's interpreter. The kernels are jitted at their first launch in
the mode ``TRITON_INTERPRET`` selects at that moment (see forge_lightning/kernels/_dispatch.py), so the
``device`` fixture enables the interpreter with ``monkeypatch`` for one test at a time: nothing leaks into
other test folders, whatever imported triton before. On a machine with CUDA the same tests run compiled on
the GPU instead, and the ``gpu`` tests add the bf16 and FP8 cast paths that the interpreter gets wrong.

Inputs are fresh random tensors each run; every test prints its seed (shown on failure) and
``KERNEL_TEST_SEED=<seed>`` replays it.
"""

import os
import random
from collections.abc import Callable

import pytest
import torch

from forge_lightning.kernels import triton_available

# Max |actual - expected| / max |expected| allowed per dtype (see docs/kernels.md).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def _seed() -> int:
    seed = int(os.environ.get("KERNEL_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    print(f"seed {seed}: replay with KERNEL_TEST_SEED={seed}")
    return seed


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the Triton tests run: ``"cuda"`` (compiled) with a GPU, else ``"cpu"`` under the interpreter."""
    if not triton_available():
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


@pytest.fixture
def cuda() -> str:
    """For ``gpu`` tests: the CUDA device name; skips without a GPU."""
    if not torch.cuda.is_available() or not triton_available():
        pytest.skip("needs a CUDA GPU and triton")
    return "cuda"


@pytest.fixture
def assert_close() -> Callable[..., None]:
    """``assert_close(actual, expected, dtype, factor=1.0)``: max error relative to ``expected``'s scale."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, factor: float = 1.0) -> None:
        assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        scale = expected.double().abs().max().clamp_min(1e-30)
        err = ((actual.double() - expected.double()).abs().max() / scale).item()
        bound = TOLERANCE[dtype] * factor
        assert err <= bound, f"relative max error {err:.3g} > {bound:.3g} ({dtype})"

    return check


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str, layout: str) -> torch.Tensor:
    """A random tensor of ``shape`` whose memory is contiguous, transposed (last dim strided) or sliced
    (rows padded, last dim unit-stride)."""
    if layout == "contiguous":
        return torch.randn(shape, dtype=dtype, device=device)
    if layout == "transposed":
        swapped = (*shape[:-2], shape[-1], shape[-2]) if len(shape) > 1 else shape
        base = torch.randn(swapped, dtype=dtype, device=device)
        return base.transpose(-1, -2) if len(shape) > 1 else base
    if layout == "sliced":
        return torch.randn((*shape[:-1], shape[-1] + 3), dtype=dtype, device=device)[..., 1 : shape[-1] + 1]
    raise ValueError(layout)


@pytest.fixture
def make_input() -> Callable[..., torch.Tensor]:
    """``make_input(shape, dtype, device, layout)``; see :func:`make_tensor`."""
    return make_tensor

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_lightning import kernels
from forge_lightning.kernels import _dispatch


def public_calls():
    """One small call per public kernel, as ``fn(backend) -> tensor or tuple``."""
    x = torch.randn(3, 5, 16)
    weight = torch.randn(16)
    q = torch.randn(2, 5, 3, 8)
    cos, sin = kernels.rope_cos_sin(torch.arange(5), 8)
    head = torch.randn(11, 16)
    labels = torch.randint(0, 11, (3, 5))
    return {
        "rms_norm": lambda backend: kernels.rms_norm(x, weight, residual=x, backend=backend),
        "swiglu": lambda backend: kernels.swiglu(x, x.flip(-1), backend=backend),
        "apply_rope": lambda backend: kernels.apply_rope(q, cos, sin, backend=backend),
        "fused_linear_cross_entropy": lambda backend: kernels.fused_linear_cross_entropy(
            x, head, labels, backend=backend
        ),
        "quantize_fp8": lambda backend: kernels.quantize_fp8(x, 16, backend=backend),
        "dequantize_fp8": lambda backend: kernels.dequantize_fp8(
            *kernels.quantize_fp8(x, 16), 16, backend=backend
        ),
    }


@pytest.mark.parametrize("name", sorted(public_calls()))
def test_auto_runs_the_reference_on_cpu(name):
    call = public_calls()[name]
    auto, reference = call("auto"), call("torch")
    for a, r in zip(
        auto if isinstance(auto, tuple) else (auto,),
        reference if isinstance(reference, tuple) else (reference,),
        strict=True,
    ):
        assert torch.equal(a.float(), r.float())


def test_auto_picks_torch_on_cpu_even_with_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _dispatch.use_triton("auto", torch.randn(2))
    assert not _dispatch.use_triton("torch", torch.randn(2))


@pytest.mark.parametrize("name", sorted(public_calls()))
def test_triton_on_cpu_without_interpreter_raises(monkeypatch, name):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    call = public_calls()[name]
    if not _dispatch.triton_available():
        with pytest.raises(RuntimeError, match="needs the `triton` package"):
            call("triton")
        return
    with pytest.raises(
        RuntimeError, match=r"on CPU tensors under Triton's interpreter \(TRITON_INTERPRET=1\)"
    ):
        call("triton")


def test_bad_backend_and_missing_triton(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.swiglu(torch.randn(2), torch.randn(2), backend="cuda")
    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        _dispatch.use_triton("triton", torch.randn(2))
    assert not _dispatch.use_triton("auto", torch.randn(2))


def test_mixed_devices_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match=r"got tensors on \['cpu', 'meta'\]"):
        _dispatch.use_triton("triton", torch.randn(2), torch.empty(2, device="meta"))


SUBPROCESS_CHECK = """
import os, sys, torch
import forge_lightning.kernels as kernels
assert "triton" not in sys.modules, "importing forge_lightning.kernels imported triton"
import triton  # first import in compiled mode, as `import lightning` does in a test session
os.environ["TRITON_INTERPRET"] = "1"
gate, up = torch.randn(3, 40), torch.randn(3, 40)
torch.testing.assert_close(kernels.swiglu(gate, up, backend="triton"), kernels.swiglu(gate, up, backend="torch"))
"""


@pytest.mark.skipif(not _dispatch.triton_available(), reason="triton is not installed")
def test_triton_is_imported_lazily_and_the_interpreter_can_be_enabled_late():
    # Triton jits its own library in the mode set at its first import; the kernels avoid that library, so
    # the interpreter works whenever TRITON_INTERPRET is set before a kernel's first launch.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(kernels.__file__).parents[2]
    subprocess.run([sys.executable, "-c", SUBPROCESS_CHECK], check=True, cwd=root, env=env)

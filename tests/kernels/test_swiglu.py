import pytest
import torch

from forge_lightning.kernels import swiglu
from forge_lightning.kernels.swiglu import swiglu_reference

SHAPES = [(7, 33), (3, 5, 129)]


def independent_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu written out from its definition, in fp32."""
    g = gate.float()
    return g / (1 + torch.exp(-g)) * up.float()


def fused_halves(shape, dtype, device):
    """gate and up as the two halves of one fused projection output (strided rows)."""
    fused = torch.randn((*shape[:-1], 2 * shape[-1]), dtype=dtype, device=device)
    return fused.chunk(2, dim=-1)


def run(fn, gate, up, dy, **kwargs):
    gate.grad = up.grad = None
    y = fn(gate, up, **kwargs)
    y.backward(dy.to(y.dtype))
    return y.detach(), gate.grad, up.grad


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference_and_independent(device, make_input, assert_close, shape, dtype, layout):
    if layout == "fused":
        gate, up = fused_halves(shape, dtype, device)
    else:
        gate, up = (make_input(shape, dtype, device, layout) for _ in range(2))
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    dy = torch.randn(shape, device=device)
    got = run(swiglu, gate, up, dy, backend="triton")
    for want in (run(swiglu, gate, up, dy, backend="torch"), run(independent_swiglu, gate, up, dy)):
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_independent_formulation(assert_close, dtype):
    gate, up = (torch.randn(3, 5, 129, dtype=dtype, requires_grad=True) for _ in range(2))
    dy = torch.randn(3, 5, 129)
    for g, w in zip(run(swiglu_reference, gate, up, dy), run(independent_swiglu, gate, up, dy), strict=True):
        assert_close(g, w, dtype)


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="gate shape"):
        swiglu(torch.randn(4, 8), torch.randn(4, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [*SHAPES, (2, 1024, 8192)])
def test_triton_matches_reference_cuda(cuda, assert_close, shape, dtype):
    gate, up = (t.detach().requires_grad_() for t in fused_halves(shape, dtype, cuda))
    dy = torch.randn(shape, device=cuda)
    got = run(swiglu, gate, up, dy, backend="triton")
    for g, w in zip(got, run(swiglu, gate, up, dy, backend="torch"), strict=True):
        assert_close(g, w, dtype)

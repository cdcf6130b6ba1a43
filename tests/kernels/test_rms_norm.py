import pytest
import torch
import torch.nn.functional as F

from forge_lightning.kernels import rms_norm
from forge_lightning.kernels.rms_norm import rms_norm_reference

SHAPES = [(7, 33), (3, 5, 129)]
LAYOUTS = ["contiguous", "transposed", "sliced"]


def independent_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF semantics through torch's own fused op: normalise in fp32, cast back, then scale."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def run(fn, x, weight, residual, backend):
    """Forward + backward with a random upstream gradient on every output; returns outputs and grads."""
    leaves = [t for t in (x, weight, residual) if t is not None]
    for leaf in leaves:
        leaf.grad = None
    kwargs = {"backend": backend} if backend else {}
    out = fn(x, weight, 1e-5, residual, **kwargs) if residual is not None else fn(x, weight, 1e-5, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(1234)
    loss = sum((o.float() * torch.randn(o.shape, device=o.device)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs] + [leaf.grad for leaf in leaves]


def make_args(shape, dtype, device, layout, make_input, with_residual):
    x = make_input(shape, dtype, device, layout).requires_grad_()
    weight = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
    residual = make_input(shape, dtype, device, "contiguous").requires_grad_() if with_residual else None
    return x, weight, residual


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(device, make_input, assert_close, shape, dtype, layout, with_residual):
    args = make_args(shape, dtype, device, layout, make_input, with_residual)
    got = run(rms_norm, *args, backend="triton")
    want = run(rms_norm, *args, backend="torch")
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        assert_close(g, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_independent_formulation(make_input, assert_close, dtype):
    x, weight, residual = make_args((3, 5, 129), dtype, "cpu", "sliced", make_input, True)
    got = run(rms_norm_reference, x, weight, None, backend=None)
    want = run(independent_rms_norm, x, weight, None, backend=None)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, dtype)
    y, s = rms_norm_reference(x, weight, 1e-5, residual)
    torch.testing.assert_close(s, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(y, independent_rms_norm(x + residual, weight, 1e-5), rtol=0, atol=0)


@pytest.mark.parametrize("use", ["normed", "sum"])
def test_residual_backward_with_one_output_used(device, assert_close, use):
    x, residual = (torch.randn(3, 5, 33, device=device, requires_grad=True) for _ in range(2))
    weight = torch.randn(33, device=device, requires_grad=True)
    grads = []
    for backend in ("triton", "torch"):
        y, s = rms_norm(x, weight, residual=residual, backend=backend)
        (y if use == "normed" else s).square().sum().backward()
        grads.append([x.grad, weight.grad, residual.grad])
        x.grad = weight.grad = residual.grad = None
    for got, want in zip(*grads, strict=True):
        if want is None:
            assert got is None or not got.any()
        else:
            assert_close(got, want, torch.float32)


def test_mixed_weight_dtype_promotes_like_hf(device, assert_close):
    x = torch.randn(7, 33, dtype=torch.float16, device=device)
    # An fp32 weight with a half-precision input gives an fp32 output, as in HF.
    weight = torch.randn(33, device=device)
    got = rms_norm(x, weight, backend="triton")
    assert got.dtype == torch.float32
    assert_close(got, rms_norm_reference(x, weight), torch.float16)


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.randn(4, 8), torch.randn(7))
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(torch.randn(4, 8), torch.randn(8), residual=torch.randn(4, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [*SHAPES, (4, 1024, 2048), (2, 3, 8192)])
def test_triton_matches_reference_cuda(cuda, make_input, assert_close, shape, dtype, with_residual):
    args = make_args(shape, dtype, cuda, "sliced", make_input, with_residual)
    for g, w in zip(
        run(rms_norm, *args, backend="triton"), run(rms_norm, *args, backend="torch"), strict=True
    ):
        assert_close(g, w, dtype)

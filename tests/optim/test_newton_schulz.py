"""Newton-Schulz orthogonalisation and the lr adjustment against torch.optim.Muon's own."""

import pytest
import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from forge_lightning.optim.newton_schulz import adjusted_lr, newton_schulz

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
SHAPES = [(16, 16), (24, 8), (8, 24)]  # square, tall, wide


@pytest.mark.parametrize("shape", SHAPES)
def test_one_matrix_equals_torch_bitwise(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz(x)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, _zeropower_via_newtonschulz(x, COEFFICIENTS, 5, 1e-7))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_stack_equals_each_matrix_alone(shape, dtype):
    x = torch.randn(2, 3, *shape, generator=torch.Generator().manual_seed(1))
    stacked = newton_schulz(x, dtype=dtype)
    alone = torch.stack([torch.stack([newton_schulz(m, dtype=dtype) for m in row]) for row in x])
    assert stacked.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(stacked.float(), alone.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_result_is_nearly_orthogonal(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = newton_schulz(x, dtype=torch.float32)
    assert out.dtype == torch.float32
    singular = torch.linalg.svdvals(out.double())
    # Keller Jordan's coefficients trade exactness for speed: singular values land near 1, roughly in [0.5, 1.5].
    assert singular.min() > 0.5 and singular.max() < 1.5, singular


def test_input_is_not_modified_and_zero_stays_zero():
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    before = x.clone()
    newton_schulz(x)
    assert torch.equal(x, before)
    assert torch.equal(newton_schulz(torch.zeros(4, 6)), torch.zeros(4, 6, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "ns_steps"),
        ({"steps": 100}, "ns_steps"),
        ({"coefficients": (1.0, 2.0)}, "three numbers"),
        ({"eps": 0.0}, "eps"),
        ({"dtype": torch.int32}, "floating-point"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.randn(4, 4), **kwargs)


def test_a_vector_is_refused():
    with pytest.raises(ValueError, match=r"\[\.\.\., m, n\]"):
        newton_schulz(torch.randn(4))


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [*SHAPES, (3, 1000)])
def test_adjusted_lr_equals_torch(fn, shape):
    assert adjusted_lr(0.02, fn, *shape) == _adjust_lr(0.02, fn, torch.Size(shape))


def test_unknown_adjust_lr_fn_is_refused():
    with pytest.raises(ValueError, match="match_rms_adamw"):
        adjusted_lr(0.02, "spectral", 4, 4)

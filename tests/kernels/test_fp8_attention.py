"""FP8 attention's torch emulation and per-layer scale state (the cuDNN kernels: tests/gpu/test_fp8_attention_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F

from forge_lightning.kernels.fp8 import dequantize_fp8_reference, quantize_fp8_reference
from forge_lightning.kernels.fp8_attention import (
    DELAYED,
    E4M3_MAX,
    HISTORY,
    MARGIN,
    FP8AttentionScales,
    cudnn_fp8_attention_available,
    cudnn_head_dim_unsupported,
    fp8_attention,
)


def _round_trip(x):
    payload, scale = quantize_fp8_reference(x, None)
    return dequantize_fp8_reference(payload, scale, None, x.shape, x.dtype)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (3, 3)])
def test_emulation_is_exact_attention_on_e4m3_rounded_inputs_with_straight_through_gradients(heads, kv_heads):
    q = (
        torch.randn(2, 9, heads, 16).transpose(1, 2).requires_grad_()
    )  # [B, H, S, D] views, as layers make them
    k = torch.randn(2, 9, kv_heads, 16).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 9, kv_heads, 16).transpose(1, 2).requires_grad_()
    out = fp8_attention(q, k, v, FP8AttentionScales(), backend="auto")  # CPU tensors: the emulation
    rounded = [_round_trip(t.detach()).requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*rounded, is_causal=True, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(out, want)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    expected = torch.autograd.grad(want, rounded, grad_out)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert not torch.equal(
        out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    )


def test_bad_shapes_and_backends_are_refused():
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16)
    with pytest.raises(ValueError, match="must divide query heads"):
        fp8_attention(q, kv, kv, FP8AttentionScales())
    with pytest.raises(ValueError, match=r"q \[B, H, S, D\]"):
        fp8_attention(q, torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16), FP8AttentionScales())
    with pytest.raises(ValueError, match="backend"):
        fp8_attention(q, q, q, FP8AttentionScales(), backend="flash")
    assert cudnn_head_dim_unsupported(64, "cpu") is None
    if not torch.cuda.is_available():
        assert cudnn_fp8_attention_available("cpu") == "no CUDA device"


def test_scales_keep_the_newest_amaxes_first_and_leave_headroom():
    scales = FP8AttentionScales()
    with pytest.raises(AssertionError, match="no backward pass"):
        scales.scales()
    scales.record(torch.tensor([2.0, 1.0, 4.0, 8.0]))
    assert scales.amax.shape == (len(DELAYED), HISTORY)
    torch.testing.assert_close(scales.scales(), E4M3_MAX / (MARGIN * torch.tensor([2.0, 1.0, 4.0, 8.0])))
    scales.record(torch.tensor([1.0, 3.0, 1.0, 1.0]))
    assert scales.amax[:, 0].tolist() == [1.0, 3.0, 1.0, 1.0]
    torch.testing.assert_close(scales.scales(), E4M3_MAX / (MARGIN * torch.tensor([2.0, 3.0, 4.0, 8.0])))
    for _ in range(HISTORY - 1):  # the first record leaves the window after HISTORY newer ones
        scales.record(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    torch.testing.assert_close(scales.scales(), E4M3_MAX / (MARGIN * torch.tensor([1.0, 3.0, 1.0, 1.0])))

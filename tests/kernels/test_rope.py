import pytest
import torch

from forge_lightning.kernels import apply_rope, rope_cos_sin
from forge_lightning.kernels.rope import apply_rope_reference

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SCALINGS = [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3]


def complex_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Independent formulation: channel pairs (i, i + r/2) as complex numbers times exp(i * angle)."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    xf = x.double()
    pairs = torch.complex(xf[..., :half], xf[..., half:rotary_dim])
    phase = torch.complex(cos[..., :half].double(), sin[..., :half].double())[:, :, None, :]
    rotated = pairs * phase
    return torch.cat((rotated.real, rotated.imag, xf[..., rotary_dim:]), dim=-1)


def make_x(shape, dtype, device, layout):
    batch, seq, heads, head_dim = shape
    if layout == "heads_first":  # [B, H, S, D] memory viewed as [B, S, H, D]
        return torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device).transpose(1, 2)
    if layout == "sliced":  # e.g. q out of a fused qkv projection
        return torch.randn(batch, seq, heads, head_dim + 5, dtype=dtype, device=device)[..., 2 : head_dim + 2]
    return torch.randn(shape, dtype=dtype, device=device)


def run(x, cos, sin, dy, backend):
    x.grad = None
    y = apply_rope(x, cos, sin, backend=backend)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("dim", [64, 128])
def test_cos_sin_match_transformers(scaling, dim):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", **(scaling or {}), "rope_theta": 500000.0}
    config = transformers.LlamaConfig(hidden_size=2 * dim, num_attention_heads=2, rope_parameters=params)
    position_ids = torch.randint(0, 4096, (2, 11))
    want_cos, want_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), position_ids)
    cos, sin = rope_cos_sin(position_ids, dim, 500000.0, scaling)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=0)


def test_cos_sin_scaling_formulas():
    positions = torch.arange(50)[None]
    cos, sin = rope_cos_sin(positions, 8, theta=10.0)
    inv_freq = torch.tensor([10.0 ** (-i / 8) for i in range(0, 8, 2)])
    angles = positions[0, :, None].double() * inv_freq.double()
    torch.testing.assert_close(cos[0, :, :4].double(), angles.cos(), atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[0, :, 4:].double(), angles.sin(), atol=1e-5, rtol=0)
    linear, _ = rope_cos_sin(positions * 4, 8, theta=10.0)
    torch.testing.assert_close(
        rope_cos_sin(positions * 16, 8, 10.0, {"type": "linear", "factor": 4.0})[0], linear
    )
    with pytest.raises(ValueError, match="llama3 rope scaling needs keys"):
        rope_cos_sin(positions, 8, scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        rope_cos_sin(positions, 8, scaling={"rope_type": "yarn"})


@pytest.mark.parametrize("rotary_dim", [20, 12])
@pytest.mark.parametrize("cos_batch", [1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "heads_first", "sliced"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference_and_independent(device, assert_close, dtype, layout, cos_batch, rotary_dim):
    shape = (2, 7, 3, 20)
    x = make_x(shape, dtype, device, layout).requires_grad_()
    position_ids = torch.randint(0, 200, (cos_batch, shape[1]), device=device)
    cos, sin = rope_cos_sin(position_ids, rotary_dim, 10000.0, LLAMA3)
    dy = torch.randn(shape, dtype=dtype, device=device)
    got_y, got_dx = run(x, cos, sin, dy, "triton")
    ref_y, ref_dx = run(x, cos, sin, dy, "torch")
    assert_close(got_y, ref_y, dtype)
    assert_close(got_dx, ref_dx, dtype)
    assert_close(got_y, complex_rope(x.detach(), cos, sin), dtype)
    # The gradient of a rotation is the rotation by the negative angle.
    assert_close(got_dx, complex_rope(dy, cos, -sin), dtype)
    torch.testing.assert_close(got_y[..., rotary_dim:], x.detach()[..., rotary_dim:], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_transformers(assert_close, dtype):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.randn(2, 9, 4, 16, dtype=dtype)
    cos, sin = rope_cos_sin(torch.randint(0, 500, (2, 9)), 16)
    want, _ = apply_rotary_pos_emb(x.float(), x.float(), cos, sin, unsqueeze_dim=2)
    assert_close(apply_rope_reference(x, cos, sin), want.to(dtype), dtype)


def test_rejects_bad_arguments(device):
    x = torch.randn(2, 7, 3, 20, device=device)
    cos, sin = rope_cos_sin(torch.arange(7, device=device), 20)
    with pytest.raises(ValueError, match=r"must be \[batch, seq, heads, head_dim\]"):
        apply_rope(x[0], cos, sin)
    with pytest.raises(ValueError, match="at most head_dim"):
        apply_rope(x[..., :10], cos, sin)
    with pytest.raises(ValueError, match="does not match x shape"):
        apply_rope(x[:, :5], cos, sin)
    with pytest.raises(ValueError, match="no gradient to cos"):
        apply_rope(x, cos.requires_grad_(), sin, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_reference_cuda(cuda, assert_close, dtype, rotary_dim):
    shape = (2, 1024, 8, 128)
    x = make_x(shape, dtype, cuda, "heads_first").requires_grad_()
    cos, sin = rope_cos_sin(torch.arange(shape[1], device=cuda), rotary_dim, 500000.0, LLAMA3)
    dy = torch.randn(shape, dtype=dtype, device=cuda)
    for g, w in zip(run(x, cos, sin, dy, "triton"), run(x, cos, sin, dy, "torch"), strict=True):
        assert_close(g, w, dtype)

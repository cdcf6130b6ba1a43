import pytest
import torch
from fp8_payload import assert_payload_matches

from forge_lightning.kernels import dequantize_fp8, quantize_fp8
from forge_lightning.kernels.fp8 import dequantize_fp8_reference, quantize_fp8_reference

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Round-to-nearest error bounds: half an ulp relative for normals (3 / 2 mantissa bits), half the smallest
# subnormal spacing in absolute terms (2^-9 / 2^-16 of the scale).
RELATIVE = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
SUBNORMAL = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}
# (shape, block, rowwise): partial last blocks, per-tensor, per-row, a block large enough for the
# two-pass Triton path.
CASES = [((7, 33), 16, False), ((3, 5, 129), 256, False), ((3, 5, 129), None, False), ((9, 130), None, True)]
LARGE_CASES = [((3, 20001), 10000, False), ((5, 9001), None, True)]


def make_x(shape, dtype, device):
    """Random data with per-row magnitudes spread over several decades, one all-zero leading block."""
    x = torch.randn(shape, device=device) * 10 ** torch.empty((*shape[:-1], 1), device=device).uniform_(-3, 3)
    x.view(-1)[:16] = 0
    return x.to(dtype)


def independent_quantize(x, block, fp8):
    """Block by block in Python: scale = amax / max, payload = saturated cast of x / scale."""
    fp8_max = torch.finfo(fp8).max
    flat = x.reshape(-1).float()
    payload, scales = [], []
    for start in range(0, flat.numel(), block):
        chunk = flat[start : start + block]
        amax = chunk.abs().max()
        scale = (amax / fp8_max).clamp_min(torch.finfo(torch.float32).tiny) if amax > 0 else torch.tensor(1.0)
        payload.append((chunk / scale).clamp(-fp8_max, fp8_max).to(fp8))
        scales.append(scale)
    return torch.cat(payload), torch.stack(scales)


def block_of(x, block, rowwise):
    return x.shape[1] if rowwise else (block or x.numel())


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "block", "rowwise"), CASES)
def test_reference_quantize(fp8, dtype, shape, block, rowwise):
    x = make_x(shape, dtype, "cpu")
    payload, scales = quantize_fp8(x, block, fp8, rowwise=rowwise, backend="torch")
    size = block_of(x, block, rowwise)
    want_payload, want_scales = independent_quantize(x, size, fp8)
    assert payload.dtype == fp8 and payload.shape == (x.numel(),) and scales.dtype == torch.float32
    assert torch.equal(payload.view(torch.uint8), want_payload.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    # The block's largest magnitude lands exactly on the format's max (nothing saturates beyond it).
    padded = torch.nn.functional.pad(payload.float().abs(), (0, -x.numel() % size)).view(-1, size)
    nonzero = want_scales != 1
    assert torch.equal(padded.amax(1)[nonzero], torch.full_like(padded[nonzero, 0], torch.finfo(fp8).max))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("shape", "block", "rowwise"), CASES)
def test_round_trip_error_bound(fp8, shape, block, rowwise):
    x = make_x(shape, torch.float32, "cpu")
    payload, scales = quantize_fp8(x, block, fp8, rowwise=rowwise, backend="torch")
    size = block_of(x, block, rowwise)
    restored = dequantize_fp8(payload, scales, size, x.shape, backend="torch")
    assert restored.shape == x.shape
    per_element = scales.repeat_interleave(size)[: x.numel()].view(x.shape)
    bound = RELATIVE[fp8] * x.abs() + SUBNORMAL[fp8] * per_element
    assert ((restored - x).abs() <= bound).all()
    assert not restored.view(-1)[:16].any()  # the zero block round-trips to zeros
    for out_dtype in (torch.bfloat16, torch.float16):
        narrowed = dequantize_fp8(payload, scales, size, x.shape, dtype=out_dtype, backend="torch")
        assert torch.equal(narrowed, restored.to(out_dtype))


def test_layouts_and_granularities_agree():
    x = make_x((6, 40), torch.float32, "cpu")
    flat_payload, flat_scales = quantize_fp8_reference(x.T.contiguous().T, 40)  # non-contiguous input
    row_payload, row_scales = quantize_fp8_reference(x, rowwise=True)
    assert torch.equal(flat_payload.view(torch.uint8), row_payload.view(torch.uint8))
    assert torch.equal(flat_scales, row_scales)
    _, tensor_scale = quantize_fp8_reference(x, None)
    assert torch.equal(tensor_scale, (x.abs().max() / 448.0).view(1))


def test_rejects_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="dtype must be one of"):
        quantize_fp8(x, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rowwise=True needs a 2-D tensor"):
        quantize_fp8(x.view(2, 2, 8), rowwise=True)
    payload, scales = quantize_fp8(x, 8)
    with pytest.raises(ValueError, match="need 2 scales, got 4"):
        dequantize_fp8(payload, scales, 16)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("shape", "block", "rowwise"), CASES + LARGE_CASES)
def test_triton_matches_reference(device, fp8, shape, block, rowwise):
    x = make_x(shape, torch.float32, device)
    payload, scales = quantize_fp8(x, block, fp8, rowwise=rowwise, backend="triton")
    want_payload, want_scales = quantize_fp8(x, block, fp8, rowwise=rowwise, backend="torch")
    assert torch.equal(scales, want_scales)
    assert_payload_matches(payload, want_payload, fp8, exact=device == "cuda")
    size = block_of(x, block, rowwise)
    # (fp32 -> bf16 casts are wrong in the interpreter too; bf16 output is covered by the gpu test.)
    for out_dtype in (torch.float32, torch.float16):
        restored = dequantize_fp8(want_payload, want_scales, size, x.shape, out_dtype, backend="triton")
        assert torch.equal(
            restored, dequantize_fp8_reference(want_payload, want_scales, size, x.shape, out_dtype)
        )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_denormal_blocks_stay_finite(device, backend):
    """A block whose amax / fp8_max underflows (amax below ~1e-42, e.g. a gradient of a rarely used embedding
    row) gets the smallest normal fp32 as scale instead of 0: no division by zero, no NaN in the payload."""
    x = torch.zeros(4 * 256, device=device)
    x[3], x[256 + 7], x[512 + 9] = 1e-44, -3e-43, 2e-39  # blocks 0-2: denormal amax; block 3: all zero
    payload, scales = quantize_fp8(x, 256, torch.float8_e4m3fn, backend=backend)
    tiny = torch.finfo(torch.float32).tiny
    assert torch.equal(scales.cpu(), torch.tensor([tiny, tiny, 2e-39 / 448, 1.0]).clamp_min(tiny))
    restored = dequantize_fp8(payload, scales, 256, backend=backend)
    assert torch.isfinite(restored).all()
    assert (restored - x).abs().max() <= 2e-39 * 2.0**-4  # within e4m3 rounding of the largest value


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "block", "rowwise"), [*CASES, *LARGE_CASES, ((4096, 4096), 256, False)])
def test_triton_cast_is_exact_cuda(cuda, fp8, dtype, shape, block, rowwise):
    x = make_x(shape, dtype, cuda)
    payload, scales = quantize_fp8(x, block, fp8, rowwise=rowwise, backend="triton")
    want_payload, want_scales = quantize_fp8_reference(x, block, fp8, rowwise=rowwise)
    assert torch.equal(scales, want_scales)
    assert torch.equal(payload.view(torch.uint8), want_payload.view(torch.uint8))
    size = block_of(x, block, rowwise)
    restored = dequantize_fp8(payload, scales, size, x.shape, dtype, backend="triton")
    assert torch.equal(restored, dequantize_fp8_reference(payload, scales, size, x.shape, dtype))

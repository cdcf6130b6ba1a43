import math

import pytest
import torch
import torch.nn.functional as F
from fp8_payload import assert_payload_matches

from forge_lightning.kernels import cross_entropy, fused_linear_cross_entropy
from forge_lightning.kernels.cross_entropy import _chunk_size, linear_cross_entropy_unfused

IGNORE = -100


def make_inputs(n_tokens, hidden, vocab, dtype, device, transposed=False):
    if transposed:
        h = torch.randn(hidden, n_tokens, dtype=dtype, device=device).T
    else:
        h = torch.randn(n_tokens, hidden, dtype=dtype, device=device)
    weight = (torch.randn(vocab, hidden, device=device) / math.sqrt(hidden) * 3).to(dtype)
    labels = torch.randint(0, vocab, (n_tokens,), device=device)
    labels[torch.rand(n_tokens, device=device) < 0.25] = IGNORE
    return h.requires_grad_(), weight.requires_grad_(), labels


def run(fn, h, weight, labels, reduction, upstream=None, **kwargs):
    h.grad = weight.grad = None
    loss = fn(h, weight, labels, reduction=reduction, **kwargs)
    (loss * upstream).sum().backward() if reduction == "none" else (loss * 0.37).backward()
    return loss.detach(), h.grad, weight.grad


OPTIONS = [dict(), dict(z_loss=1e-3, label_smoothing=0.1)]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "zloss+smoothing"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference_and_unfused(device, assert_close, dtype, reduction, options):
    # 37 tokens in chunks of 8 (partial last chunk), odd hidden and vocab, transposed hidden states.
    h, weight, labels = make_inputs(37, 33, 101, dtype, device, transposed=True)
    upstream = torch.randn(37, device=device)
    fused = dict(reduction=reduction, upstream=upstream, chunk_size=8, **options)
    got = run(fused_linear_cross_entropy, h, weight, labels, backend="triton", **fused)
    ref = run(fused_linear_cross_entropy, h, weight, labels, backend="torch", **fused)
    unfused = run(linear_cross_entropy_unfused, h, weight, labels, reduction, upstream, **options)
    for want in (ref, unfused):
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype
            # fp32 loss math everywhere; half-precision inputs differ only through the rounded logits / grads.
            assert_close(
                g, w, dtype if g is not got[0] else torch.float32, factor=1 if dtype == torch.float32 else 2
            )


def test_large_vocab_spans_several_tiles(device, assert_close):
    # V > the kernel's 4096-wide tile: exercises the online logsumexp across tiles.
    h, weight, labels = make_inputs(9, 16, 4133, torch.float32, device)
    got = run(fused_linear_cross_entropy, h, weight, labels, "sum", label_smoothing=0.2, backend="triton")
    want = run(linear_cross_entropy_unfused, h, weight, labels, "sum", label_smoothing=0.2)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, torch.float32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sum_divided_by_count_equals_mean_and_f_cross_entropy(device, backend):
    h, weight, labels = make_inputs(2 * 19, 24, 50, torch.float32, device)
    h3, labels2 = h.detach().view(2, 19, 24).requires_grad_(), labels.view(2, 19)
    total = fused_linear_cross_entropy(h3, weight, labels2, reduction="sum", chunk_size=5, backend=backend)
    (total / (labels2 != IGNORE).sum()).backward()
    grads = (h3.grad.clone(), weight.grad.clone())
    h3.grad = weight.grad = None
    mean = fused_linear_cross_entropy(h3, weight, labels2, backend=backend)
    mean.backward()
    torch.testing.assert_close(total / (labels2 != IGNORE).sum(), mean)
    torch.testing.assert_close(grads, (h3.grad, weight.grad))
    torch.testing.assert_close(mean, F.cross_entropy((h3 @ weight.T).flatten(0, 1), labels2.flatten()))


def test_per_token_losses_keep_the_label_shape(device):
    h, weight, labels = make_inputs(3 * 5, 8, 30, torch.float32, device)
    per_token = fused_linear_cross_entropy(
        h.view(3, 5, 8), weight, labels.view(3, 5), reduction="none", backend="triton"
    )
    assert per_token.shape == (3, 5)
    assert (per_token.flatten()[labels == IGNORE] == 0).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_ignored(device, backend):
    h, weight, _ = make_inputs(6, 8, 30, torch.float32, device)
    labels = torch.full((6,), IGNORE, device=device)
    total = fused_linear_cross_entropy(h, weight, labels, reduction="sum", backend=backend)
    total.backward()
    assert total.item() == 0 and not h.grad.any() and not weight.grad.any()
    assert fused_linear_cross_entropy(h, weight, labels, backend=backend).isnan()  # as F.cross_entropy


def test_no_grad_path_matches(device):
    h, weight, labels = make_inputs(21, 16, 40, torch.float32, device)
    with torch.no_grad():
        evaluated = fused_linear_cross_entropy(h, weight, labels, z_loss=1e-2, chunk_size=4, backend="triton")
    trained = fused_linear_cross_entropy(h, weight, labels, z_loss=1e-2, chunk_size=4, backend="triton")
    torch.testing.assert_close(evaluated, trained.detach())


def test_second_backward_raises():
    h, weight, labels = make_inputs(5, 8, 30, torch.float32, "cpu")
    loss = fused_linear_cross_entropy(h, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_half_precision_on_cpu(assert_close, dtype):
    h, weight, labels = make_inputs(29, 32, 77, dtype, "cpu")
    got = run(
        fused_linear_cross_entropy, h, weight, labels, "sum", chunk_size=8, backend="torch", z_loss=1e-3
    )
    want = run(linear_cross_entropy_unfused, h, weight, labels, "sum", z_loss=1e-3)
    assert_close(got[0], want[0], torch.float32)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert_close(g, w, dtype, factor=2)


def test_autocast_runs_the_gemms_in_the_autocast_dtype_and_returns_fp32_gradients(assert_close):
    h, weight, labels = make_inputs(29, 32, 77, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(fused_linear_cross_entropy, h, weight, labels, "mean", chunk_size=8, backend="torch")
    assert got[1].dtype == got[2].dtype == torch.float32  # the fp32 masters' gradients
    h_bf16, w_bf16 = (h.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_())
    want = run(fused_linear_cross_entropy, h_bf16, w_bf16, labels, "mean", chunk_size=8, backend="torch")
    assert_close(got[0], want[0], torch.float32)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert_close(g, w.float(), torch.bfloat16)


def test_chunk_size_rule():
    for n_tokens, vocab in [(32768, 128256), (32768, 32000), (7, 128256), (1, 10), (4096, 1 << 30)]:
        chunk = _chunk_size(n_tokens, vocab)
        assert 1 <= chunk <= n_tokens
        assert chunk == n_tokens or chunk & (chunk - 1) == 0
        assert chunk == n_tokens or chunk * vocab <= 1 << 28 or chunk == 16
    assert _chunk_size(32768, 128256) == 2048
    assert _chunk_size(32768, 32000) == 8192


def test_rejects_bad_arguments():
    h, weight, labels = make_inputs(4, 8, 30, torch.float32, "cpu")
    with pytest.raises(ValueError, match="reduction must be"):
        fused_linear_cross_entropy(h, weight, labels, reduction="avg")
    with pytest.raises(ValueError, match="must share a dtype"):
        fused_linear_cross_entropy(h, weight.half(), labels)
    with pytest.raises(ValueError, match="labels shape"):
        fused_linear_cross_entropy(h, weight, labels[:3])
    with pytest.raises(ValueError, match="label_smoothing"):
        fused_linear_cross_entropy(h, weight, labels, label_smoothing=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference_cuda(cuda, assert_close, dtype, reduction):
    h, weight, labels = make_inputs(4099, 512, 32003, dtype, cuda)
    upstream = torch.randn(4099, device=cuda)
    options = dict(z_loss=1e-4, label_smoothing=0.05)
    fused = dict(reduction=reduction, upstream=upstream, chunk_size=1024, **options)
    got = run(fused_linear_cross_entropy, h, weight, labels, backend="triton", **fused)
    ref = run(fused_linear_cross_entropy, h, weight, labels, backend="torch", **fused)
    # The oracle runs in fp32 end to end: in fp16, autograd's own d(mean loss)/d(logits) (~1e-8 here) would
    # underflow to subnormals before its matmuls.
    h32, weight32 = h.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    oracle = run(linear_cross_entropy_unfused, h32, weight32, labels, reduction, upstream, **options)
    assert_close(got[0], ref[0], torch.float32)  # same logits, fp32 loss math
    for g, w in zip(got[1:], ref[1:], strict=True):
        assert_close(g, w, dtype, factor=2)
    for g, w in zip(got, oracle, strict=True):  # differs through the rounded logits and gradients
        assert_close(g, w, dtype, factor=2)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("z_loss", [0.0, 1e-4], ids=["one-weight-gemm", "zloss-gemm-per-chunk"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp8_matmuls_stay_close_to_high_precision(reduction, z_loss):
    # e4m3 hidden states / weight and e5m2 logit gradients (the CPU emulation of the scaled GEMMs): the total loss
    # within 1% (per token 3%), the gradients within the few percent per-tensor FP8 rounding gives; 48 tokens in
    # chunks of 16.
    h, weight, labels = make_inputs(48, 64, 256, torch.float32, "cpu")
    upstream = torch.randn(48)
    common = dict(reduction=reduction, upstream=upstream, chunk_size=16, z_loss=z_loss, backend="torch")
    fp8 = run(fused_linear_cross_entropy, h, weight, labels, fp8=True, **common)
    exact = run(fused_linear_cross_entropy, h, weight, labels, **common)
    assert _rel(fp8[0].sum(), exact[0].sum()) < 0.01 and _rel(fp8[0], exact[0]) < 0.03  # total, per token
    for got, want in zip(fp8[1:], exact[1:], strict=True):
        assert 1e-4 < _rel(got, want) < 0.1  # rounded (not the exact path), and close


def test_fp8_weight_gradient_groups_agree(monkeypatch):
    # Without z-loss the weight gradient is one GEMM per group of chunks whose transposed e5m2 gradients fit the
    # buffer. 45 tokens (not a multiple of the GEMM's 16: zero-padded) in chunks of 8: one group, or groups of 16
    # tokens (two chunks each, the last partial) added up; the same payloads, summed in another order.
    h, weight, labels = make_inputs(45, 32, 128, torch.float32, "cpu")
    common = dict(reduction="mean", chunk_size=8, fp8=True, backend="torch")
    one_group = run(fused_linear_cross_entropy, h, weight, labels, **common)
    monkeypatch.setattr(cross_entropy, "_FP8_GRAD_BUFFER_BYTES", 128 * 16)
    groups = run(fused_linear_cross_entropy, h, weight, labels, **common)
    for got, want in zip(groups, one_group, strict=True):
        assert _rel(got, want) < 1e-5
    exact = run(
        fused_linear_cross_entropy, h, weight, labels, reduction="mean", chunk_size=8, backend="torch"
    )
    assert 1e-4 < _rel(groups[2], exact[2]) < 0.1


def _fp8_grad_inputs(n_rows, vocab, device):
    torch.manual_seed(0)
    logits = (torch.randn(n_rows, vocab, device=device) * 4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n_rows,), device=device)
    labels[::5] = IGNORE
    loss, lse = torch.empty(n_rows, device=device), torch.empty(n_rows, device=device)
    opts = cross_entropy._LossOptions(IGNORE, 1e-3, 0.1)
    cross_entropy._chunk_loss_torch(logits, labels, loss, None, opts, lse)
    grad_scale = torch.rand(n_rows, device=device) + 0.5
    scale = cross_entropy._E5M2_MAX / cross_entropy._grad_bound(grad_scale, lse, labels, opts)
    return logits, labels, lse, grad_scale, opts, scale


def _fp8_grads(kernel, logits, labels, lse, grad_scale, opts, scale):
    n_rows, vocab = logits.shape
    out = torch.empty(n_rows, vocab, dtype=torch.float8_e5m2, device=logits.device)
    out_t = torch.zeros(vocab, n_rows + 7, dtype=torch.float8_e5m2, device=logits.device)[:, 3 : 3 + n_rows]
    kernel(logits, labels, lse, grad_scale, opts, scale, out, out_t)
    return out, out_t


def test_fp8_gradient_kernel_matches_reference(device):
    # 150 rows x 300 vocabulary entries: partial 128-tiles both ways; both layouts, into a strided transposed view.
    inputs = _fp8_grad_inputs(150, 300, device)
    got = _fp8_grads(cross_entropy._chunk_grad_fp8_triton, *inputs)
    want = _fp8_grads(cross_entropy._chunk_grad_fp8_torch, *inputs)
    assert_payload_matches(got[0], want[0], torch.float8_e5m2, exact=False)  # exp differs by an fp32 ulp
    assert torch.equal(got[1].view(torch.uint8), got[0].t().view(torch.uint8))
    dequantized = want[0].float() / inputs[-1]
    exact = cross_entropy._logit_grad(inputs[0].float(), inputs[1], inputs[2], inputs[4])
    exact = exact * torch.where(inputs[1] != IGNORE, inputs[3], 0.0)[:, None]
    assert (dequantized - exact).abs().max() <= 0.125 * exact.abs().max()  # e5m2: 2 mantissa bits
    assert (dequantized[inputs[1] == IGNORE] == 0).all()


def test_fp8_needs_gemm_tile_multiples():
    h, weight, labels = make_inputs(8, 33, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiples of 16"):
        fused_linear_cross_entropy(h, weight, labels, fp8=True, backend="torch")


@pytest.mark.gpu
def test_fp8_scaled_mm_matches_the_emulation(cuda):
    h, weight, labels = make_inputs(4096, 512, 32000, torch.bfloat16, cuda)
    common = dict(reduction="mean", chunk_size=1024, fp8=True)
    got = run(fused_linear_cross_entropy, h, weight, labels, **common)
    cpu = [t.detach().cpu().float() for t in (h, weight)]
    want = run(
        fused_linear_cross_entropy, cpu[0].requires_grad_(), cpu[1].requires_grad_(), labels.cpu(),
        backend="torch", **common,
    )  # fmt: skip
    assert _rel(got[0].cpu(), want[0]) < 1e-3
    for g, w in zip(got[1:], want[1:], strict=True):  # fast accumulation and bf16 outputs on the GPU
        assert _rel(g.cpu(), w) < 0.02
    for g, w in zip(got[1:], want[1:], strict=True):
        assert _rel(g.cpu(), w) < 0.03

"""cuDNN's fused FP8 attention against exact attention and its torch emulation (run on a Hopper GPU: ``-m gpu``).

Tolerances are relative L2 errors: e4m3 keeps 3 mantissa bits, so q / k / v / P / O each carry up to 2^-4
relative rounding; together they give output errors of a few percent, the gradients (dO, dS and dQ / dK / dV
rounded too) somewhat more.
"""

import pytest
import torch
import torch.nn.functional as F

from forge_lightning.contracts import Component, ParallelPlan
from forge_lightning.kernels.fp8_attention import (
    DELAYED,
    HISTORY,
    FP8AttentionScales,
    cudnn_fp8_attention_available,
    fp8_attention,
)
from forge_lightning.modules.llm import DecoderLM, LLMConfig
from forge_lightning.performance import PerformanceConfig, apply_performance

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cudnn_fp8():
    reason = cudnn_fp8_attention_available()
    if reason is not None:
        pytest.skip(reason)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _inputs(batch, heads, kv_heads, seq, head_dim, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h):  # [B, h, S, D] as a transposed view of [B, S, h, D], as the attention layers produce
        x = torch.randn(batch, seq, h, head_dim, device="cuda", generator=generator, dtype=torch.bfloat16)
        return x.transpose(1, 2).requires_grad_()

    return rand(heads), rand(kv_heads), rand(kv_heads)


def _run(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return out, dq, dk, dv


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "head_dim"),
    [(8, 2, 512, 128), (4, 4, 384, 128), (16, 8, 1024, 128)],
)
def test_cudnn_fp8_attention_matches_exact_attention(heads, kv_heads, seq, head_dim):
    q, k, v = _inputs(2, heads, kv_heads, seq, head_dim, seed=seq + head_dim)
    grad_out = torch.randn(2, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    gqa = heads != kv_heads

    def exact(q, k, v):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=gqa)

    scales = FP8AttentionScales()
    reference = _run(exact, q, k, v, grad_out.float())
    emulated = _run(lambda *t: fp8_attention(*t, FP8AttentionScales(), backend="torch"), q, k, v, grad_out)
    for step in range(3):  # the first backward pass measures |dS|; later ones use the history
        cudnn = _run(lambda *t: fp8_attention(*t, scales, backend="cudnn"), q, k, v, grad_out)
        assert cudnn[0].dtype == torch.bfloat16 and cudnn[0].shape == q.shape
        assert _rel(cudnn[0], reference[0]) < 0.08, f"output, step {step}: {_rel(cudnn[0], reference[0]):.3f}"
        assert _rel(cudnn[0], emulated[0]) < 0.08, f"output vs emulation, step {step}"
        for name, ours, ref in zip(("dq", "dk", "dv"), cudnn[1:], reference[1:]):
            assert torch.isfinite(ours).all(), name
            assert _rel(ours, ref) < 0.15, f"{name}, step {step}: {_rel(ours, ref):.3f}"
    assert scales.amax is not None and scales.amax.shape == (len(DELAYED), HISTORY)
    assert torch.isfinite(scales.amax).all() and (scales.amax > 0).all()


def test_cudnn_fp8_attention_is_causal():
    q, k, v = _inputs(1, 4, 2, 256, 128, seed=0)
    out = fp8_attention(q, k, v, FP8AttentionScales(), backend="cudnn")
    v2 = v.detach().clone()
    v2[:, :, 128:] = v2[:, :, 128:].flip(2)  # later positions reordered (same amax, so the same scale)
    out2 = fp8_attention(q.detach(), k.detach(), v2, FP8AttentionScales(), backend="cudnn")
    torch.testing.assert_close(out[:, :, :128].float(), out2[:, :, :128].float(), atol=0.0, rtol=0.0)


def test_hopper_head_dim_64_is_refused_with_the_reason():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the head_dim limit is Hopper's")
    q, k, v = _inputs(1, 4, 4, 128, 64, seed=1)
    with pytest.raises(ValueError, match="head_dim 128 only"):
        fp8_attention(q, k, v, FP8AttentionScales(), backend="cudnn")


def test_model_with_fp8_attention_trains_like_bf16():
    # Heads of 128 (cuDNN's FP8 backward on Hopper), compiled blocks: the graph breaks around the cuDNN calls.
    config = LLMConfig.load(
        {
            "model_type": "llama", "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1024,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "tie_word_embeddings": False,
        }
    )  # fmt: skip
    torch.manual_seed(0)
    plain = DecoderLM(config).to("cuda", torch.bfloat16)
    fast = DecoderLM(config).to("cuda", torch.bfloat16)
    fast.load_state_dict(plain.state_dict())

    def plan(model):
        return ParallelPlan(components=[Component(name="llm", module=model, blocks=list(model.model.layers))])

    apply_performance(plan(plain), PerformanceConfig(compile=False), "cuda")
    apply_performance(plan(fast), PerformanceConfig(fp8={"recipe": "tensorwise", "attention": True}), "cuda")
    tokens = torch.randint(0, 1024, (2, 513), device="cuda")
    results = []
    for model in (plain, fast):
        for _ in range(2):  # the second step uses the delayed dS / dQ / dK / dV scales
            model.zero_grad(set_to_none=True)
            logits = model(tokens[:, :-1]).float()
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (fp8_loss, fp8_grads) = results
    assert abs(fp8_loss - ref_loss) / ref_loss < 0.02
    for name, grad in ref_grads.items():
        assert _rel(fp8_grads[name], grad) < 0.25, name
    layers = [m for m in fast.modules() if getattr(m, "fp8_scales", None) is not None]
    assert len(layers) == 2 and all(m.fp8_scales.amax is not None for m in layers)

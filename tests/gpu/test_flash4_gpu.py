"""FlashAttention-4 (``flash_attn.cute``) on a Hopper / Blackwell GPU against SDPA: dense causal and non-causal,
GQA, cross-attention, packed documents (varlen), forward and q/k/v gradients, through ``attention()``, a
compiled block (eager and activation-checkpointed) and a small decoder's training step.

Each check prints its error and fails with the case and tensor it was measuring. Errors are
max |actual - expected| / max |expected| against SDPA on the same bf16 inputs (``TOL``); FA4's own error against an
fp64 reference is printed beside it.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from forge_lightning.kernels import flash4
from forge_lightning.modules.layers import DocumentMask

attn = importlib.import_module(
    "forge_lightning.modules.layers.attention"
)  # the package exports `attention()`

_REASON = flash4.device_unsupported("cuda") if torch.cuda.is_available() else "needs a CUDA GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]

TOL = {"out": 2e-2, "grad": 3e-2, "model_grad": 5e-2, "loss": 1e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max().clamp_min(1e-30)
    return ((actual.double() - expected.double()).abs().max() / scale).item()


def check(case: str, name: str, actual: torch.Tensor, expected: torch.Tensor, bound: float) -> None:
    assert actual.shape == expected.shape, (
        f"{case} {name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert torch.isfinite(actual).all(), f"{case} {name}: FA4 returned non-finite values"
    err = rel_err(actual, expected)
    print(f"{case} {name}: relative max error vs SDPA {err:.2e} (bound {bound:.0e})")
    assert err <= bound, f"{case} {name}: relative max error vs SDPA {err:.3g} > {bound:.3g}"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of FA4 forward / backward kernel calls (the real kernels, wrapped)."""
    forward, backward = flash4._load_kernels()
    counts = {"forward": 0, "backward": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(
        flash4, "_load_kernels", lambda: (counted("forward", forward), counted("backward", backward))
    )
    return counts


def run(fn, q, k, v, upstream):
    """Forward and backward of ``fn(q, k, v)``; returns the output and the q, k, v gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(upstream)
    return [out.detach(), q.grad, k.grad, v.grad]


def compare(case, actual, expected):
    for name, a, e in zip(["out", "dq", "dk", "dv"], actual, expected, strict=True):
        check(case, name, a, e, TOL["out" if name == "out" else "grad"])


def random_inputs(B, S, H, K, D, S_kv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g)
    k, v = (torch.randn(B, K, S_kv or S, D, generator=g) for _ in range(2))
    upstream = torch.randn(B, H, S, D, generator=g)
    return [t.to("cuda", torch.bfloat16) for t in (q, k, v, upstream)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
@pytest.mark.parametrize(
    ("B", "S", "H", "K", "D"),
    [
        (2, 1024, 8, 8, 128),
        (2, 1000, 32, 8, 64),
        (1, 777, 12, 12, 128),
        (2, 512, 16, 1, 64),
    ],
    ids=["mha_d128", "gqa4_d64", "odd_len_d128", "mqa_d64"],
)
def test_dense_fa4_matches_sdpa(calls, causal, B, S, H, K, D):
    case = f"dense {'causal' if causal else 'non-causal'} B={B} S={S} H={H} K={K} D={D}"
    q, k, v, upstream = random_inputs(B, S, H, K, D)
    expected = run(lambda *t: attn.attention(*t, causal=causal), q, k, v, upstream)
    attn.set_attention_kernel("fa4")
    actual = run(lambda *t: attn.attention(*t, causal=causal), q, k, v, upstream)
    assert calls == {"forward": 1, "backward": 1}, f"{case}: FA4 kernel calls {calls}, expected one of each"
    compare(case, actual, expected)
    attn.set_attention_kernel("sdpa")
    exact = run(lambda *t: attn.attention(*t, causal=causal), *(t.double() for t in (q, k, v, upstream)))
    print(
        f"{case}: FA4 out vs fp64 {rel_err(actual[0], exact[0]):.2e}, SDPA vs fp64 {rel_err(expected[0], exact[0]):.2e}"
    )


@pytest.mark.parametrize("D", [72, 80], ids=["siglip_d72", "qwen_vit_d80"])
def test_unverified_head_dims_stay_on_sdpa_under_auto(calls, D):
    """Head dims outside SUPPORTED_HEAD_DIMS (FA4's Hopper backward gave wrong dq at 72): auto keeps SDPA."""
    q, k, v, upstream = random_inputs(2, 256, 16, 16, D)
    expected = run(lambda *t: attn.attention(*t, causal=True), q, k, v, upstream)
    attn.set_attention_kernel("fa4", chosen=True)
    actual = run(lambda *t: attn.attention(*t, causal=True), q, k, v, upstream)
    assert calls == {"forward": 0, "backward": 0}, f"head dim {D}: FA4 kernel calls {calls}, expected none"
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)


def test_non_causal_cross_attention_fa4_matches_sdpa(calls):
    case = "cross-attention S_q=300 S_kv=512"
    q, k, v, upstream = random_inputs(2, 300, 12, 12, 128, S_kv=512)
    expected = run(lambda *t: attn.attention(*t, causal=False), q, k, v, upstream)
    attn.set_attention_kernel("fa4")
    actual = run(lambda *t: attn.attention(*t, causal=False), q, k, v, upstream)
    assert calls == {"forward": 1, "backward": 1}, f"{case}: FA4 kernel calls {calls}, expected one of each"
    compare(case, actual, expected)


def packed_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows, start = [], 0
    for lengths in lengths_per_row:
        ids = torch.repeat_interleave(torch.arange(start, start + len(lengths)), torch.tensor(lengths))
        rows.append(ids)
        start += len(lengths)
    return torch.stack(rows).cuda()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
@pytest.mark.parametrize("K", [8, 2], ids=["mha", "gqa4"])
def test_varlen_fa4_matches_sdpa_with_the_document_mask(calls, causal, K):
    case = f"varlen {'causal' if causal else 'non-causal'} K={K}"
    document_ids = packed_ids([[100, 1, 300, 111], [512]])  # a single token, odd lengths, one full row
    q, k, v, upstream = random_inputs(2, 512, 8, K, 64)
    dense = DocumentMask.build(document_ids, "sdpa", causal=causal)
    expected = run(lambda *t: attn.attention(*t, causal=causal, documents=dense), q, k, v, upstream)
    varlen = DocumentMask.build(document_ids, "fa4", causal=causal)
    actual = run(lambda *t: attn.attention(*t, causal=causal, documents=varlen), q, k, v, upstream)
    assert calls == {"forward": 1, "backward": 1}, f"{case}: FA4 kernel calls {calls}, expected one of each"
    compare(case, actual, expected)


def test_auto_packed_backend_is_fa4_once_the_kernel_is():
    attn.set_attention_kernel("fa4", chosen=True)
    documents = DocumentMask.build(packed_ids([[10, 22]]), "auto")
    assert documents.backend == "fa4" and documents.chosen, (documents.backend, documents.chosen)


def test_auto_falls_back_to_sdpa_for_fp32(calls):
    attn.set_attention_kernel("fa4", chosen=True)
    q, k, v, upstream = (t.float() for t in random_inputs(1, 128, 4, 4, 64))
    out = attn.attention(q, k, v, causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert calls["forward"] == 0, "fp32 inputs reached FA4 instead of SDPA"
    torch.testing.assert_close(out, expected)


class Block(torch.nn.Module):
    """Projections around ``attention()``: the unit the strategies compile and checkpoint."""

    def __init__(self, dim: int = 512, heads: int = 8, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.q(x_BSD).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x_BSD).view(B, S, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = attn.attention(q, k, v, causal=True)
        return x_BSD + self.o(out.transpose(1, 2).reshape(B, S, -1))


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_compiled_block_on_fa4_matches_eager_sdpa(calls, checkpointing):
    from forge_lightning.contracts import Component, ParallelPlan
    from forge_lightning.performance import apply_activation_checkpointing, apply_compile
    from forge_lightning.performance.config import DEFAULT_SELECTIVE_SAVE

    case = f"compiled block, activation checkpointing {checkpointing}"
    torch.manual_seed(0)
    reference = Block().cuda().bfloat16()
    block = Block().cuda().bfloat16()
    block.load_state_dict(reference.state_dict())
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    out_ref = reference(x)
    out_ref.float().square().mean().backward()

    plan = ParallelPlan(components=[Component(name="blocks", module=block, blocks=[block])])
    apply_activation_checkpointing(plan, checkpointing, tuple(DEFAULT_SELECTIVE_SAVE))
    apply_compile(plan, enabled=True)
    attn.set_attention_kernel("fa4")
    out = block(x)
    out.float().square().mean().backward()
    assert calls["forward"] >= 1 and calls["backward"] == 1, f"{case}: FA4 kernel calls {calls}"
    if checkpointing == "selective":
        assert calls["forward"] == 1, f"{case}: the FA4 forward was recomputed ({calls}) instead of saved"
    check(case, "out", out, out_ref, TOL["out"])
    for (name, p), (_, p_ref) in zip(block.named_parameters(), reference.named_parameters(), strict=True):
        check(case, f"grad {name}", p.grad, p_ref.grad, TOL["model_grad"])


def test_decoder_training_step_with_apply_performance_matches_sdpa(calls):
    """``performance.attention.kernel: fa4`` applied by ``apply_performance`` to a small decoder (compiled blocks,
    packed rows on ``auto``): the same loss and gradients as SDPA."""
    from forge_lightning.kernels import fused_linear_cross_entropy
    from forge_lightning.modules.llm import DecoderLM, LLMConfig
    from forge_lightning.performance import PerformanceConfig, apply_performance

    config = LLMConfig.from_preset(
        "debug", vocab_size=512, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=2
    )
    torch.manual_seed(0)
    reference = DecoderLM(config).cuda().bfloat16()
    model = DecoderLM(config).cuda().bfloat16()
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 512, (2, 257), device="cuda")
    document_ids = packed_ids([[60, 1, 195], [256]])

    def loss_of(lm):
        hidden = lm.model(tokens[:, :-1], document_ids=document_ids)
        return fused_linear_cross_entropy(hidden.flatten(0, 1), lm.lm_head.weight, tokens[:, 1:].flatten())

    loss_ref = loss_of(reference)
    loss_ref.backward()

    from forge_lightning.contracts import Component, ParallelPlan

    plan = ParallelPlan(components=[Component(name="llm", module=model, blocks=list(model.model.layers))])
    applied = apply_performance(plan, PerformanceConfig(attention={"kernel": "fa4"}), "cuda")
    assert "attention.kernel" in applied and attn.attention_kernel() == "fa4", attn.attention_kernel()
    loss = loss_of(model)
    loss.backward()
    assert calls["forward"] >= 1 and calls["backward"] >= 1, f"decoder step: FA4 kernel calls {calls}"
    err = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
    print(f"decoder step: loss {loss.item():.5f} vs SDPA {loss_ref.item():.5f} (relative {err:.2e})")
    assert err <= TOL["loss"], f"decoder step: loss relative error {err:.3g} > {TOL['loss']}"
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        check("decoder step", f"grad {name}", p.grad, p_ref.grad, TOL["model_grad"])


def test_fp32_block_under_bf16_autocast_runs_on_fa4(calls):
    """``bf16-mixed``: fp32 weights, queries / keys cast to bf16 for FA4 as SDPA casts them."""
    case = "fp32 block under bf16 autocast"
    torch.manual_seed(0)
    block = Block().cuda()
    x = torch.randn(2, 512, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = block(x)
        attn.set_attention_kernel("fa4")
        out = block(x)
    assert calls["forward"] == 1, f"{case}: FA4 kernel calls {calls}, expected one forward"
    check(case, "out", out.float(), expected.float(), TOL["out"])

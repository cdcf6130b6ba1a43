"""FlashAttention-4 backend on CPU: dispatch, config validation, fallbacks, layouts, custom ops under compile and
activation checkpointing, with a stand-in for FA4's kernels (FA4 runs on Hopper / Blackwell only; the real kernel
is tested in tests/gpu/test_flash4_gpu.py).

The stand-in has the signature of ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd`` and computes
attention in fp32 in FA4's layouts (``[B, S, H, D]`` dense, ``[T, H, D]`` varlen, lse ``[B, H, S]`` / ``[H, T]``).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from forge_lightning.kernels import flash4
from forge_lightning.performance import PerformanceConfig, resolve
from forge_lightning.performance.config import DEFAULT_SELECTIVE_SAVE
from forge_lightning.performance.transforms import _selective_context

attn = importlib.import_module(
    "forge_lightning.modules.layers.attention"
)  # the package exports `attention()`


def _per_sequence(fn, q, k, v, causal, cu_seqlens, *rest):
    """``fn`` over each batch row (dense ``[B, S, H, D]``) or each document (varlen ``[T, H, D]``)."""
    if cu_seqlens is None:
        results = zip(*(fn(q[b], k[b], v[b], causal, *(t[b] for t in rest)) for b in range(len(q))))
        return [torch.stack(r) for r in results]
    bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    results = zip(*(fn(q[i:j], k[i:j], v[i:j], causal, *(t[i:j] for t in rest)) for i, j in bounds))
    return [torch.cat(r) for r in results]


def _probabilities(q_SHD, k_SKD, v_SKD, causal):
    """fp32 ``[H, S, D]`` queries, expanded keys / values and the attention probabilities ``[H, S_q, S_kv]``."""
    rep = q_SHD.shape[1] // k_SKD.shape[1]
    q_HSD = q_SHD.float().transpose(0, 1)
    k_HSD, v_HSD = (t.float().transpose(0, 1).repeat_interleave(rep, 0) for t in (k_SKD, v_SKD))
    scores = q_HSD @ k_HSD.transpose(1, 2) / math.sqrt(q_SHD.shape[-1])
    if causal:
        n = q_SHD.shape[0]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return q_HSD, k_HSD, v_HSD, scores


def _forward_one(q_SHD, k_SKD, v_SKD, causal):
    _, _, v_HSD, scores = _probabilities(q_SHD, k_SKD, v_SKD, causal)
    out = (scores.softmax(-1) @ v_HSD).transpose(0, 1).to(q_SHD.dtype)
    return out, scores.logsumexp(
        -1
    ).T  # lse [S, H]: stacked / concatenated along the tokens, transposed below


def _backward_one(q_SHD, k_SKD, v_SKD, causal, dout_SHD):
    q_HSD, k_HSD, v_HSD, scores = _probabilities(q_SHD, k_SKD, v_SKD, causal)
    p = scores.softmax(-1)
    do_HSD = dout_SHD.float().transpose(0, 1)
    dv, dp = p.transpose(1, 2) @ do_HSD, do_HSD @ v_HSD.transpose(1, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / math.sqrt(q_SHD.shape[-1])
    dq, dk = ds @ k_HSD, ds.transpose(1, 2) @ q_HSD
    K = k_SKD.shape[1]

    def grouped(x_HSD):  # sum the query heads sharing a key/value head -> [S, K, D]
        return x_HSD.unflatten(0, (K, -1)).sum(1).transpose(0, 1).to(q_SHD.dtype)

    return dq.transpose(0, 1).to(q_SHD.dtype), grouped(dk), grouped(dv)


class StandIn:
    """FA4's private forward / backward entry points, counted."""

    def __init__(self) -> None:
        self.forwards = self.backwards = 0

    def forward(self, q, k, v, *, causal, return_lse, cu_seqlens_q=None, cu_seqlens_k=None, **lengths):
        assert return_lse and q.is_contiguous() and q.shape[-1] == k.shape[-1]
        assert cu_seqlens_q is cu_seqlens_k
        self.forwards += 1
        out, lse_SH = _per_sequence(_forward_one, q, k, v, causal, cu_seqlens_q)
        return out, lse_SH.transpose(-1, -2).contiguous(), None, None, None  # lse [B, H, S] or [H, T]

    def backward(
        self, q, k, v, out, dout, lse, softmax_scale, causal, softcap, *, cu_seqlens_q=None, **lengths
    ):
        assert softmax_scale is None and softcap == 0.0 and dout.is_contiguous()
        self.backwards += 1
        return tuple(_per_sequence(_backward_one, q, k, v, causal, cu_seqlens_q, dout))


@pytest.fixture
def fa4(monkeypatch: pytest.MonkeyPatch) -> StandIn:
    """FA4 'installed': the stand-in kernels, CPU accepted as its device, the process kernel restored after."""
    stand_in = StandIn()
    monkeypatch.setattr(flash4, "_load_kernels", lambda: (stand_in.forward, stand_in.backward))
    monkeypatch.setattr(flash4, "device_unsupported", lambda device: None)
    monkeypatch.setattr(attn, "_kernel", attn._kernel)
    return stand_in


def _qkv(B=2, S=24, H=4, K=2, D=64, dtype=torch.bfloat16, kv_len=None):
    """[B, H, S, D] queries and [B, K, S_kv, D] keys / values, as the layers pass them."""
    q = torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, kv_len or S, K, D, dtype=dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(B, kv_len or S, K, D, dtype=dtype).transpose(1, 2).requires_grad_()
    return q, k, v


def _grads(fn, q, k, v):
    out = fn(q, k, v)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_dense_attention_on_fa4_matches_sdpa(fa4: StandIn, causal: bool, kv_heads: int, assert_close) -> None:
    q, k, v = _qkv(K=kv_heads)
    expected, expected_grads = _grads(lambda *t: attn.attention(*t, causal=causal), q, k, v)
    attn.set_attention_kernel("fa4")
    out, grads = _grads(lambda *t: attn.attention(*t, causal=causal), q, k, v)
    assert (fa4.forwards, fa4.backwards) == (1, 1)
    assert_close(out, expected, torch.bfloat16)
    for got, want in zip(grads, expected_grads):
        assert_close(got, want, torch.bfloat16)


def test_non_causal_cross_attention_takes_fa4(fa4: StandIn, assert_close) -> None:
    q, k, v = _qkv(S=16, kv_len=40)
    expected = attn.attention(q, k, v, causal=False)
    attn.set_attention_kernel("fa4")
    assert_close(attn.attention(q, k, v, causal=False), expected, torch.bfloat16)
    assert fa4.forwards == 1


def test_autocast_inputs_reach_fa4_in_the_autocast_dtype(fa4: StandIn, assert_close) -> None:
    """Under bf16 autocast, fp32 queries / keys (RoPE and q/k norms in fp32) go to FA4 in bf16, as SDPA's do."""
    q, k, v = _qkv(dtype=torch.float32)
    documents = attn.DocumentMask.build(torch.tensor([[0] * 12 + [1] * 12] * 2), "fa4")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = attn.attention(q, k, v, causal=True)
        packed_expected = attn.attention(
            q, k, v, causal=True, documents=attn.DocumentMask.build(documents.document_ids, "sdpa")
        )
        attn.set_attention_kernel("fa4")
        out = attn.attention(q, k, v, causal=True)
        packed = attn.attention(q, k, v, causal=True, documents=documents)
    assert fa4.forwards == 2 and out.dtype == packed.dtype == torch.bfloat16
    assert_close(out, expected, torch.bfloat16)
    assert_close(packed, packed_expected.to(torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_on_fa4_varlen_match_the_dense_mask(
    fa4: StandIn, causal: bool, assert_close
) -> None:
    document_ids = torch.tensor([[0] * 10 + [1] * 9 + [2] * 5, [0] * 3 + [1] * 21])
    q, k, v = _qkv()
    dense = attn.DocumentMask.build(document_ids, "sdpa", causal=causal)
    expected, expected_grads = _grads(lambda *t: attn.attention(*t, causal=causal, documents=dense), q, k, v)
    varlen = attn.DocumentMask.build(document_ids, "fa4", causal=causal)
    assert varlen.cu_seqlens.tolist() == [0, 10, 19, 24, 27, 48] and varlen.max_seqlen == 21
    out, grads = _grads(lambda *t: attn.attention(*t, causal=causal, documents=varlen), q, k, v)
    assert (fa4.forwards, fa4.backwards) == (1, 1)
    assert_close(out, expected, torch.bfloat16)
    for got, want in zip(grads, expected_grads):
        assert_close(got, want, torch.bfloat16)


def test_auto_packed_backend_follows_the_process_kernel(fa4: StandIn) -> None:
    cuda = torch.device("cuda")
    assert attn.resolve_attention_backend("auto", cuda) == "flex"
    attn.set_attention_kernel("fa4", chosen=True)
    assert attn.resolve_attention_backend("auto", cuda) == "fa4"
    assert attn.resolve_attention_backend("auto", cuda, varying_shapes=True) == "fa4"
    assert attn.resolve_attention_backend("auto", torch.device("cpu")) == "sdpa"
    assert attn.resolve_attention_backend("flex", cuda) == "flex"


def test_masked_and_cached_calls_stay_on_sdpa(fa4: StandIn) -> None:
    attn.set_attention_kernel("fa4")
    q, k, v = _qkv(S=4, kv_len=12)
    attn.attention(q, k, v, causal=True)  # queries appended to a KV cache
    attn.attention(*_qkv(), causal=False, mask=torch.ones(24, 24, dtype=torch.bool))
    assert fa4.forwards == 0


@pytest.mark.parametrize(
    ("dtype", "head_dim", "match"),
    [
        (torch.float32, 32, "bf16 / fp16"),
        (torch.bfloat16, 256, "64 or 128"),
        (torch.bfloat16, 72, "64 or 128"),
    ],
)
def test_unsupported_inputs_raise_when_asked_and_fall_back_under_auto(
    fa4: StandIn, dtype: torch.dtype, head_dim: int, match: str
) -> None:
    q, k, v = _qkv(D=head_dim, dtype=dtype)
    expected = attn.attention(q, k, v, causal=True)
    attn.set_attention_kernel("fa4")
    with pytest.raises(ValueError, match=f"performance.attention.kernel 'fa4': .*{match}"):
        attn.attention(q, k, v, causal=True)
    attn.set_attention_kernel("fa4", chosen=True)
    torch.testing.assert_close(attn.attention(q, k, v, causal=True), expected)
    documents = attn.DocumentMask.build(torch.tensor([[0] * 12 + [1] * 12] * 2), "fa4")
    with pytest.raises(ValueError, match=f"attention_backend 'fa4': .*{match}"):
        attn.attention(q, k, v, causal=True, documents=documents)
    documents.chosen = True
    dense = attn.DocumentMask.build(documents.document_ids, "sdpa")
    torch.testing.assert_close(
        attn.attention(q, k, v, causal=True, documents=documents),
        attn.attention(q, k, v, causal=True, documents=dense),
    )
    assert fa4.forwards == 0


def test_cpu_tensors_are_refused_by_an_explicit_fa4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attn, "_kernel", attn._kernel)
    attn.set_attention_kernel("fa4")
    with pytest.raises(ValueError, match="needs a CUDA GPU, got device 'cpu'"):
        attn.attention(*_qkv(), causal=True)


def test_compiled_block_traces_the_custom_ops_with_their_fake_kernels(fa4: StandIn) -> None:
    attn.set_attention_kernel("fa4")
    proj = torch.nn.Linear(64, 64, dtype=torch.bfloat16)

    def block(q, k, v):
        return proj(attn.attention(q, k, v, causal=True))

    q, k, v = _qkv()
    expected, expected_grads = _grads(block, q, k, v)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out, grads = _grads(compiled, q, k, v)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_custom_ops_pass_opcheck(fa4: StandIn) -> None:
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in _qkv(S=8))
    torch.library.opcheck(flash4._forward, (q, k, v, None, 0, True))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    flat = [t.detach().reshape(16, *t.shape[2:]).requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(flash4._forward, (*flat, cu, 11, False))


def test_selective_checkpointing_saves_the_fa4_forward(fa4: StandIn) -> None:
    from torch.utils.checkpoint import checkpoint

    attn.set_attention_kernel("fa4")
    q, k, v = _qkv()
    context = _selective_context(tuple(DEFAULT_SELECTIVE_SAVE))
    out = checkpoint(
        lambda *t: attn.attention(*t, causal=True), q, k, v, use_reentrant=False, context_fn=context
    )
    out.float().sum().backward()
    assert (fa4.forwards, fa4.backwards) == (1, 1)  # saved, not recomputed
    checkpoint(
        lambda *t: attn.attention(*t, causal=True), q, k, v, use_reentrant=False
    ).float().sum().backward()
    assert (fa4.forwards, fa4.backwards) == (3, 2)  # full checkpointing recomputes it


def test_config_rejects_unknown_kernels() -> None:
    with pytest.raises(ValueError, match=r"performance.attention.kernel \('flash'\) must be one of"):
        PerformanceConfig(attention={"kernel": "flash"})
    assert PerformanceConfig(attention={"packed": "fa4"}).attention.packed == "fa4"


def test_resolve_refuses_fa4_where_it_cannot_run_and_auto_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("kernel", "packed"):
        with pytest.raises(ValueError, match=f"performance.attention.{name} 'fa4': .*needs a CUDA GPU"):
            resolve(PerformanceConfig(attention={name: "fa4"}), "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"needs a Hopper \(sm90\) or Blackwell \(sm100\) GPU, got sm80"):
        resolve(PerformanceConfig(attention={"kernel": "fa4"}), "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(
        flash4, "import_error", lambda: f"flash_attn.cute does not import; {flash4.INSTALL_HINT}"
    )
    with pytest.raises(ValueError, match="pip install flash-attn-4"):
        resolve(PerformanceConfig(attention={"kernel": "fa4"}), "cuda")
    auto = resolve(PerformanceConfig(), "cuda")
    assert (auto.attention_kernel, auto.attention_kernel_chosen) == ("sdpa", True)
    assert "pip install flash-attn-4" in auto.attention_kernel_note
    monkeypatch.setattr(flash4, "import_error", lambda: None)
    assert resolve(PerformanceConfig(), "cuda").attention_kernel == "fa4"
    assert resolve(PerformanceConfig(attention={"kernel": "sdpa"}), "cuda").attention_kernel == "sdpa"
    both = resolve(PerformanceConfig(attention={"kernel": "sdpa", "packed": "fa4"}), "cuda")
    assert (both.attention_kernel, both.packed) == ("sdpa", "fa4")


def test_import_error_says_how_to_install() -> None:
    reason = flash4.import_error()
    if reason is None:
        pytest.skip("flash_attn.cute imports here")
    assert "pip install flash-attn-4" in reason


def test_flash4_attention_checks_its_inputs(fa4: StandIn, assert_close) -> None:
    q = torch.randn(2, 8, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 12, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"as many queries \(8\) as keys \(12\)"):
        flash4.flash4_attention(q, k, k, causal=True)
    with pytest.raises(ValueError, match=r"key/value heads \(3\) must divide query heads \(4\)"):
        flash4.flash4_attention(q, k[:, :, :3], k[:, :, :3], causal=False)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        flash4.flash4_attention(q[0], q[0], q[0], causal=True, cu_seqlens=torch.tensor([0, 8]), max_seqlen=8)
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
    assert_close(flash4.flash4_attention(q, k, k, causal=False), expected.transpose(1, 2), torch.bfloat16)


def test_megatron_twin_refuses_fa4() -> None:
    from types import SimpleNamespace

    from forge_lightning.modules.llm.megatron.twin import DecoderTwin

    def twin_with(**attention):  # `_performance` reads `build.performance` and `.recompute`
        return SimpleNamespace(
            build=SimpleNamespace(performance=PerformanceConfig(attention=attention), recompute=None)
        )

    with pytest.raises(
        ValueError, match=r"performance.attention.kernel \('fa4'\) is not applied under Megatron"
    ):
        DecoderTwin._performance(twin_with(kernel="fa4"))
    with pytest.raises(
        ValueError, match=r"performance.attention.packed \('fa4'\) is not applied under Megatron"
    ):
        DecoderTwin._performance(twin_with(packed="fa4"))
    assert DecoderTwin._performance(twin_with(kernel="sdpa"))[1] == "none"

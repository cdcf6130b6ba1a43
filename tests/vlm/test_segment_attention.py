"""Bidirectional packed-document attention (what vision encoders use for windows and frames) against attention
over each segment alone."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from forge_lightning.modules.layers import DocumentMask, attention
from forge_lightning.modules.layers.attention import resolve_attention_backend


def _separately(q, k, v, lengths):
    chunks = zip(*(x.split(lengths, dim=2) for x in (q, k, v)))
    return torch.cat([F.scaled_dot_product_attention(*chunk) for chunk in chunks], dim=2)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_bidirectional_documents_attend_within_each_segment(backend):
    torch.manual_seed(0)
    lengths = [5, 1, 12, 7]
    q, k, v = (torch.randn(1, 2, sum(lengths), 8) for _ in range(3))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    documents = DocumentMask.build(ids, backend, causal=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention on CPU warns that it is unfused
        out = attention(q, k, v, causal=False, documents=documents)
    torch.testing.assert_close(out, _separately(q, k, v, lengths), rtol=1e-5, atol=1e-6)


def test_causality_must_match_the_mask():
    q = torch.randn(1, 2, 6, 8)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    with pytest.raises(
        ValueError, match=r"causal \(False\) differs from the packed-document mask's \(True\)"
    ):
        attention(q, q, q, causal=False, documents=DocumentMask.build(ids, "sdpa"))
    with pytest.raises(
        ValueError,
        match=r"pass causal=False or build the mask with DocumentMask.build\(\.\.\., causal=True\)",
    ):
        attention(q, q, q, causal=True, documents=DocumentMask.build(ids, "sdpa", causal=False))
    assert DocumentMask.build(ids, "sdpa").dense[0, 0, 1, 2].item() is False  # the default stays causal


def test_auto_picks_varlen_for_encoders_on_cuda():
    cuda = torch.device("cuda")  # resolution reads the device type only: no GPU needed
    assert resolve_attention_backend("auto", cuda) == "flex"  # an LLM's fixed-shape packed rows
    assert resolve_attention_backend("auto", cuda, varying_shapes=True) == "varlen"
    assert resolve_attention_backend("auto", torch.device("cpu"), varying_shapes=True) == "sdpa"


def test_a_varlen_mask_takes_fp32_inputs_only_when_auto_chose_it():
    """FlashAttention takes fp16 / bf16: a varlen mask chosen by ``auto`` serves fp32 inputs (an encoder evaluated
    without autocast) with SDPA on the dense mask; an explicit ``varlen`` refuses them with the fix."""
    torch.manual_seed(0)
    lengths = [5, 1, 12, 7]
    q, k, v = (torch.randn(1, 2, sum(lengths), 8) for _ in range(3))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    cu_seqlens = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    varlen = {"backend": "varlen", "cu_seqlens": cu_seqlens, "max_seqlen": max(lengths), "causal": False}
    chosen = DocumentMask(ids, **varlen, chosen=True)
    out = attention(q, k, v, causal=False, documents=chosen)
    torch.testing.assert_close(out, _separately(q, k, v, lengths), rtol=1e-5, atol=1e-6)
    with pytest.raises(
        ValueError, match=r"'varlen' \(FlashAttention\) takes fp16 / bf16 inputs, got torch.float32"
    ):
        attention(q, k, v, causal=False, documents=DocumentMask(ids, **varlen))

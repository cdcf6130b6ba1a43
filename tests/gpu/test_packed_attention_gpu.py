"""Packed-document attention on CUDA: every kernel backend against SDPA with the explicit block-diagonal mask.

Random packed batches hold several documents per row with irregular lengths (single tokens included), documents
that run past the end of a row into the next one, and rows that end with a padding document. ``flex`` (compiled
FlexAttention), ``varlen`` (FlashAttention varlen, bf16 only) and ``auto`` must give the same forward outputs and
q/k/v gradients as ``sdpa``, a small decoder the same training step, and ``CausalLM`` the same per-document loss
as each document run alone.

Tolerances are max |actual - expected| / max |expected| (losses: relative), see ``TOL``.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from forge_lightning.datamodules.packing import PackedDataset, pad_collate
from forge_lightning.kernels import fused_linear_cross_entropy
from forge_lightning.modules.layers import DocumentMask
from forge_lightning.modules.layers.attention import attention, resolve_attention_backend
from forge_lightning.modules.llm import CausalLM, DecoderLM, LLMConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Allowed error per dtype: attention outputs / q,k,v gradients / model gradients / losses (relative).
TOL = {
    torch.float32: {"out": 1e-4, "grad": 1e-4, "model_grad": 1e-4, "loss": 1e-5},
    torch.bfloat16: {"out": 2e-2, "grad": 3e-2, "model_grad": 5e-2, "loss": 1e-2},
}
BACKENDS = ["flex", "varlen", "auto"]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max().clamp_min(1e-30)
    return ((actual.double() - expected.double()).abs().max() / scale).item()


def supported(backends: list[str], dtype_cases: list) -> list:
    """``(backend, *dtype case)`` parameters, leaving out fp32 with ``varlen`` (FlashAttention takes fp16 / bf16
    only; ``auto`` picks another backend for fp32, which the ``auto`` cases cover)."""
    cases = []
    for backend in backends:
        for case in dtype_cases:
            case = case if isinstance(case, tuple) else (case,)
            if not (backend == "varlen" and case[0] == "fp32"):
                cases.append((backend, *case))
    return cases


def random_document_ids(
    rows: int, seq: int, generator: torch.Generator, pad_last_row: int = 0
) -> torch.Tensor:
    """``[rows, seq]`` non-decreasing document ids of one token stream cut into rows.

    Lengths are irregular (1 to 97 tokens, now and then a long one), so documents run across row ends (the
    next row starts with the same id: every backend must still cut them there). The last ``pad_last_row``
    tokens of the last row form one padding document, as ``PackedDataset`` emits.
    """
    total = rows * seq - pad_last_row
    lengths = []
    while sum(lengths) < total:
        long = torch.rand((), generator=generator).item() < 0.15
        high = seq + seq // 2 if long else 97
        lengths.append(int(torch.randint(1, high, (), generator=generator)))
    lengths[-1] -= sum(lengths) - total
    lengths = [n for n in lengths if n > 0] + ([pad_last_row] if pad_last_row else [])
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.view(rows, seq)


def run_attention(q, k, v, document_ids, backend, upstream):
    """Forward and backward of packed attention; returns the output and the q, k, v gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, documents=DocumentMask.build(document_ids, backend))
    out.backward(upstream)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize(
    ("backend", "dtype_name", "seq"), supported(BACKENDS, [("bf16", 256), ("bf16", 300), ("fp32", 256)])
)
def test_document_attention_matches_sdpa(backend, dtype_name, seq):
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(seq)
    B, H, K, D = 2, 4, 2, 64  # the head layout of small_config(), so compiled kernels are shared
    document_ids = random_document_ids(B, seq, g, pad_last_row=23).cuda()
    q, k, v = (torch.randn(B, heads, seq, D, generator=g).to("cuda", dtype) for heads in (H, K, K))
    upstream = torch.randn(B, H, seq, D, generator=g).to("cuda", dtype)

    expected = run_attention(q, k, v, document_ids, "sdpa", upstream)
    actual = run_attention(q, k, v, document_ids, backend, upstream)
    exact = run_attention(*(t.double() for t in (q, k, v)), document_ids, "sdpa", upstream.double())
    for name, a, e, x in zip(["out", "dq", "dk", "dv"], actual, expected, exact, strict=True):
        err = rel_err(a, e)
        print(
            f"{backend} {dtype_name} S={seq} {name}: vs sdpa {err:.2e}, vs fp64 {rel_err(a, x):.2e} "
            f"(sdpa vs fp64 {rel_err(e, x):.2e})"
        )
        bound = TOL[dtype]["out" if name == "out" else "grad"]
        assert err <= bound, f"{name}: relative max error {err:.3g} > {bound:.3g}"


def test_auto_resolves_to_flex_on_cuda():
    assert resolve_attention_backend("auto", torch.device("cuda")) == "flex"
    assert resolve_attention_backend("auto", torch.device("cuda"), varying_shapes=True) == "varlen"


def test_auto_varlen_takes_fp32_inputs_through_sdpa():
    """An encoder's mask chosen by ``auto`` (varlen) serves fp32 inputs with SDPA, bf16 ones with FlashAttention."""
    torch.manual_seed(0)
    document_ids = torch.tensor([[0] * 40 + [1] * 25 + [2] * 31], device="cuda")
    q, k, v = (torch.randn(1, 4, 96, 64, device="cuda") for _ in range(3))
    documents = DocumentMask.build(document_ids, "auto", causal=False, varying_shapes=True)
    assert documents.backend == "varlen"
    reference = attention(
        q, k, v, causal=False, documents=DocumentMask.build(document_ids, "sdpa", causal=False)
    )
    torch.testing.assert_close(attention(q, k, v, causal=False, documents=documents), reference)
    half = attention(*(t.bfloat16() for t in (q, k, v)), causal=False, documents=documents)
    torch.testing.assert_close(half.float(), reference, atol=3e-2, rtol=3e-2)


def small_config() -> LLMConfig:
    return LLMConfig.from_preset(
        "debug", vocab_size=512, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2
    )


@pytest.mark.parametrize(("backend", "dtype_name"), supported(BACKENDS, ["bf16", "fp32"]))
def test_decoder_training_step_matches_sdpa(backend, dtype_name):
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    config = small_config()
    g = torch.Generator().manual_seed(1)
    document_ids = random_document_ids(2, 256, g, pad_last_row=17).cuda()
    tokens = torch.randint(0, config.vocab_size, (2, 257), generator=g).cuda()
    input_ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[document_ids != torch.roll(document_ids, -1, dims=1)] = -100  # no target across a boundary
    base = DecoderLM(config).to("cuda", dtype)

    def train_step(name):
        model = copy.deepcopy(base)
        model.model.attention_backend = name
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

        def loss_fn():
            logits = model(input_ids, document_ids=document_ids).float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

        loss = loss_fn()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        return loss.detach(), grads, loss_fn().detach()

    loss_ref, grads_ref, after_ref = train_step("sdpa")
    loss, grads, after = train_step(backend)
    tol = TOL[dtype]
    worst = max(grads, key=lambda n: rel_err(grads[n], grads_ref[n]))
    print(
        f"{backend} {dtype_name}: loss {loss.item():.6f} vs sdpa {loss_ref.item():.6f}, after step "
        f"{after.item():.6f} vs {after_ref.item():.6f}, worst grad {worst} {rel_err(grads[worst], grads_ref[worst]):.2e}"
    )
    torch.testing.assert_close(loss, loss_ref, rtol=tol["loss"], atol=0)
    torch.testing.assert_close(after, after_ref, rtol=tol["loss"], atol=0)
    for name in grads_ref:
        err = rel_err(grads[name], grads_ref[name])
        assert err <= tol["model_grad"], f"{name}: relative max error {err:.3g} > {tol['model_grad']:.3g}"


def _samples(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(0, vocab, (n + 1,), generator=g)
        labels = tokens[1:].clone()
        labels[: n // 3] = -100  # a masked prompt
        out.append({"input_ids": tokens[:-1], "labels": labels})
    return out


@pytest.mark.parametrize(("backend", "dtype_name"), supported(["sdpa", *BACKENDS], ["bf16", "fp32"]))
def test_causal_lm_packed_loss_equals_unpacked(backend, dtype_name):
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    module = CausalLM(config=small_config().to_hf(), performance={"attention": {"packed": backend}}).to(
        "cuda", dtype
    )
    # Row 0 is filled to its last token by its final document; row 1 ends with padding.
    lengths = [37, 1, 64, 113, 41, 90, 17, 5, 77, 2]
    samples = _samples(lengths, module.config.vocab_size, seed=2)
    bins = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert sum(lengths[i] for i in bins[0]) == 256
    batch = pad_collate([PackedDataset(samples, bins, seq_length=256)[i] for i in range(2)])
    batch = {k: v.cuda() for k, v in batch.items()}

    def token_losses(b):
        hidden = module.model.hidden_states(
            b["input_ids"], position_ids=b.get("position_ids"), document_ids=b.get("document_ids")
        )
        return fused_linear_cross_entropy(hidden, module.model.lm_head.weight, b["labels"], reduction="none")

    def grads_of(loss):
        module.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in module.named_parameters()}

    alone = [{k: v[None].cuda() for k, v in s.items()} for s in samples]
    packed_sum, packed_count = module.loss_sum(batch)
    packed_grads = grads_of(packed_sum)
    alone_sums = [module.loss_sum(b) for b in alone]
    alone_grads = grads_of(sum(s for s, _ in alone_sums))
    assert int(packed_count) == sum(int(c) for _, c in alone_sums)

    # Per document: the mean loss of its trained tokens inside the packed rows and alone.
    packed_tokens = token_losses(batch).detach()
    tol, worst = TOL[dtype]["loss"], 0.0
    for row, row_bin in enumerate(bins):
        start = 0
        for i in row_bin:
            trained = alone[i]["labels"][0] != -100
            got = packed_tokens[row, start : start + lengths[i]][trained].mean()
            want = token_losses(alone[i]).detach()[0][trained].mean()
            worst = max(worst, abs(got.item() - want.item()) / abs(want.item()))
            torch.testing.assert_close(got, want, rtol=tol, atol=0, msg=f"document {i}")
            start += lengths[i]
    total = sum(s for s, _ in alone_sums).detach()
    grad_err = max(rel_err(packed_grads[n], alone_grads[n]) for n in alone_grads)
    print(
        f"{backend} {dtype_name}: packed loss {packed_sum.item() / packed_count.item():.6f}, unpacked "
        f"{total.item() / packed_count.item():.6f}, worst per-document rel err {worst:.2e}, grads {grad_err:.2e}"
    )
    torch.testing.assert_close(packed_sum.detach(), total, rtol=tol, atol=0)
    assert grad_err <= TOL[dtype]["model_grad"]

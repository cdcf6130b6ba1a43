"""KV-cache decoding: equality with full forwards and with transformers' greedy generate; sampling filters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from forge_lightning.modules.llm import DecoderLM, LLMConfig, generate, sample_next_token, save_pretrained

VOCAB = 256
CONFIGS = {
    "llama-gqa": dict(),
    "qwen3": dict(architecture="qwen3", qk_norm=True, head_dim=32, tie_word_embeddings=True),
    "qwen2-mqa": dict(architecture="qwen2", attention_bias=True, num_kv_heads=1),
}


def build_model(name: str = "llama-gqa", seed: int = 0) -> DecoderLM:
    """A tiny model whose random weights give peaked, position-dependent next-token distributions."""
    torch.manual_seed(seed)
    model = DecoderLM(LLMConfig.from_preset("debug", vocab_size=VOCAB, **CONFIGS[name]))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2 if param_name.endswith("bias") else 0.1)
    return model


def prompt(batch_size: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_without_cache(model: DecoderLM, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    ids = input_ids
    for _ in range(max_new_tokens):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_greedy_equals_full_forward_greedy(name: str) -> None:
    model = build_model(name)
    input_ids = prompt()
    out = generate(model, input_ids, max_new_tokens=12)
    assert out.shape == (2, 19) and out.dtype == torch.long
    assert torch.equal(out, greedy_without_cache(model, input_ids, 12))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers_generate(name: str, tmp_path: Path) -> None:
    model = build_model(name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        save_pretrained(model, model.config, tmp_path)
    )
    input_ids = prompt()
    expected = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=12,
        min_new_tokens=12,
    )
    assert torch.equal(generate(model, input_ids, max_new_tokens=12), expected)


def test_chunked_prefill_with_cache_equals_one_full_forward() -> None:
    model = build_model("qwen3").eval()
    input_ids = prompt(length=20)
    full = model(input_ids)
    kv_cache = model.init_kv_cache(batch_size=2, max_len=20)
    chunks = [model(chunk, kv_cache=kv_cache) for chunk in input_ids.split([9, 1, 6, 4], dim=1)]
    assert kv_cache[0].length == 20
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"KV cache overflow: 21 positions needed"):
        model(input_ids[:, :1], kv_cache=kv_cache)


def test_eos_ends_a_sequence_and_pads_it() -> None:
    model = build_model()
    input_ids = prompt()
    greedy = generate(model, input_ids, max_new_tokens=10)
    eos = greedy[0, 7 + 3].item()  # the first row's fourth new token
    out = generate(model, input_ids, max_new_tokens=10, eos_token_id=[eos, VOCAB + 1])
    row0_new = out[0, 7:]
    stop = (row0_new == eos).nonzero()[0].item()
    assert stop <= 3 and torch.all(row0_new[stop:] == eos)
    assert torch.equal(out[0, : 7 + stop + 1], greedy[0, : 7 + stop + 1])

    single = generate(model, input_ids[:1], max_new_tokens=10, eos_token_id=eos)
    assert single.shape[1] == 7 + stop + 1  # decoding stops once every row has finished


def test_top_k_sampling_is_reproducible_and_stays_in_the_top_k() -> None:
    model = build_model()
    input_ids = prompt()

    def draw(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return generate(model, input_ids, max_new_tokens=16, temperature=1.5, top_k=3, generator=generator)

    out = draw(0)
    assert torch.equal(out, draw(0))
    assert not torch.equal(out, draw(1))
    with torch.no_grad():
        logits = model(out[:, :-1])[:, 6:]  # the logits each new token was drawn from
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == out[:, 7:, None]).any(-1).all()
    assert not torch.equal(out, generate(model, input_ids, max_new_tokens=16))  # it did sample


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    generator = torch.Generator().manual_seed(0)
    tokens = sample_next_token(logits, temperature=1.0, top_p=0.7, generator=generator)
    counts = torch.bincount(tokens, minlength=4)
    assert counts[2:].sum() == 0 and counts[0] > counts[1] > 0  # 0.5 + 0.3 reaches 0.7; renormalised 5 : 3
    assert abs(counts[0].item() / 2000 - 0.625) < 0.05
    top_k_1 = sample_next_token(logits, temperature=1.0, top_k=1, generator=generator)
    assert torch.all(top_k_1 == 0)


def test_training_mode_is_restored_and_nothing_is_recorded() -> None:
    model = build_model().train()
    out = generate(model, prompt(), max_new_tokens=2)
    assert model.training and not out.requires_grad
    model.eval()
    generate(model, prompt(), max_new_tokens=2)
    assert not model.training
    assert torch.equal(generate(model, prompt(), max_new_tokens=0), prompt())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_k=5), r"top_k \(5\) and top_p \(None\) only apply when sampling"),
        (dict(temperature=-1.0), r"temperature \(-1.0\) must be non-negative"),
        (dict(temperature=1.0, top_p=1.5), r"top_p \(1.5\) must be in \(0, 1\]"),
        (dict(temperature=1.0, top_k=0), r"top_k \(0\) must be positive"),
    ],
)
def test_invalid_sampling_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate(build_model(), prompt(), max_new_tokens=4, **kwargs)

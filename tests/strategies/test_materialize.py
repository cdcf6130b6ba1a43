"""Meta-device materialization keeps the model's own initialisation (not torch's per-layer defaults)."""

import dataclasses

import pytest
import torch
from torch import nn

from forge_lightning.modules.llm import LLMConfig
from forge_lightning.modules.llm.model import DecoderLM
from forge_lightning.strategies.materialize import has_meta_tensors, materialize_module


def _tiny() -> LLMConfig:
    return LLMConfig.from_preset("debug")


def test_meta_materialization_equals_eager_init():
    """Same seed before the init: identical weights and buffers, including the tied head and RoPE buffers."""
    eager = DecoderLM(_tiny())
    torch.manual_seed(0)
    eager.init_weights()
    with torch.device("meta"):
        lazy = DecoderLM(_tiny())
    assert has_meta_tensors(lazy)
    torch.manual_seed(0)
    materialize_module(nn.ModuleDict({"model": lazy}), torch.device("cpu"))
    assert not has_meta_tensors(lazy)
    want = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    got = {**dict(lazy.named_parameters()), **dict(lazy.named_buffers())}
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_linear_layers_follow_the_model_scheme():
    """Projections are N(0, initializer_range), not Kaiming-uniform (whose std is 1 / sqrt(3 fan_in))."""
    config = _tiny()
    with torch.device("meta"):
        model = DecoderLM(config)
    materialize_module(model, torch.device("cpu"))
    weights = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, nn.Linear)])
    assert weights.std().item() == pytest.approx(config.initializer_range, rel=0.05)
    assert weights.abs().max().item() > 3 * config.initializer_range  # a normal draw, not a bounded uniform


def test_modules_without_init_fall_back_to_reset_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    materialize_module(model, torch.device("cpu"))
    assert torch.isfinite(model[0].weight).all() and torch.equal(model[1].weight, torch.ones(4))


def test_no_meta_tensors_is_a_no_op():
    model = nn.Linear(3, 3)
    before = model.weight.clone()
    materialize_module(model, torch.device("cpu"))
    assert torch.equal(model.weight, before)


def test_tied_head_stays_the_embedding():
    """A tied output head is still the embedding matrix after materialization (one parameter, trained once)."""
    config = dataclasses.replace(_tiny(), tie_word_embeddings=True)
    with torch.device("meta"):
        model = DecoderLM(config)
    materialize_module(model, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for name, p in model.named_parameters() if name != "lm_head.weight"
    )

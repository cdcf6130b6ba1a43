"""The plain Pi0.5 module: the prefix KV cache, which parameters receive gradients, config validation."""

from __future__ import annotations

import pytest
import torch

from forge_lightning.modules.embodied import Pi05, Pi05Config, Pi05Inputs, load_lerobot_checkpoint


@pytest.fixture(scope="module")
def model(fixture_dir) -> Pi05:
    return load_lerobot_checkpoint(Pi05(Pi05Config.from_preset("debug")), fixture_dir).eval()


@pytest.fixture()
def model_inputs(inputs, expected) -> Pi05Inputs:
    return Pi05Inputs(
        expected["images_preprocessed"], expected["image_masks"], inputs["tokens"], inputs["token_mask"]
    )


def test_kv_cache_equals_recomputing_the_prefix(model, model_inputs, inputs):
    calls = []
    hook = model.llm.layers[0].register_forward_hook(lambda *args: calls.append(1))
    try:
        cached = model.predict_action_chunk(model_inputs, noise=inputs["sample_noise"], num_steps=5)
        backbone_runs_cached = len(calls)
        recomputed = model.predict_action_chunk(
            model_inputs, noise=inputs["sample_noise"], num_steps=5, use_cache=False
        )
    finally:
        hook.remove()
    assert backbone_runs_cached == 1 and len(calls) - backbone_runs_cached == 5
    torch.testing.assert_close(cached, recomputed, rtol=0, atol=1e-6)
    assert cached.shape == (2, 5, 6) and torch.isfinite(cached).all()


def test_exactly_the_unused_parameters_get_no_gradient(fixture_dir, model_inputs, inputs):
    model = load_lerobot_checkpoint(Pi05(Pi05Config.from_preset("debug")), fixture_dir)
    actions = torch.zeros_like(inputs["noise"])
    model.forward_loss(model_inputs, actions, inputs["noise"], inputs["time"]).mean().backward()
    unused = {id(p) for p in model.unused_parameters()}
    for name, param in model.named_parameters():
        if id(param) in unused:
            assert param.grad is None, name
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert len(unused) == 7  # last backbone layer: q, o, post-attention norm, 3 MLP projections; final norm


def test_sampled_flow_times_follow_the_config():
    torch.manual_seed(0)
    model = Pi05(Pi05Config.from_preset("debug"))
    time = model.sample_time(4096)
    assert time.dtype == torch.float32 and time.min() >= 0.001 and time.max() <= 1.0
    # Beta(1.5, 1) has mean 0.6: scaled by 0.999 and offset by 0.001.
    assert abs(time.mean().item() - (0.6 * 0.999 + 0.001)) < 0.02


def test_config_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match=r"action_expert.head_dim \(8\) must equal llm.head_dim \(16\)"):
        Pi05Config.from_preset(
            "debug",
            action_expert={"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "head_dim": 8},
        )
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(8\)"):
        Pi05Config.from_preset(
            "debug", llm={"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_kv_heads": 3}
        )
    with pytest.raises(KeyError, match="unknown Pi0.5 preset 'pi06'"):
        Pi05Config.from_preset("pi06")


@pytest.mark.parametrize("name", ["debug", "pi05-base"])
def test_presets_build(name):
    config = Pi05Config.from_preset(name)
    assert Pi05Config.load(config.to_dict()) == config
    with torch.device("meta"):
        model = Pi05(config)
    assert len(model.llm.layers) == len(model.action_expert.layers) == config.llm.num_layers


def test_both_vision_tower_layouts_load_to_the_same_parameters(fixture_dir):
    """lerobot files from recent transformers drop the SigLIP ``vision_model`` level; both layouts map the same."""
    from safetensors.torch import load_file

    from forge_lightning.modules.embodied.checkpoint import from_lerobot_state_dict

    state = load_file(str(fixture_dir / "model.safetensors"))
    flat = {k.replace(".vision_tower.vision_model.", ".vision_tower."): v for k, v in state.items()}
    assert flat.keys() != state.keys()
    nested, flattened = from_lerobot_state_dict(state), from_lerobot_state_dict(flat)
    assert nested.keys() == flattened.keys()
    assert all(nested[k] is flattened[k] for k in nested)


def _math_attention(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **_):
    """SDPA as plain matmuls, so that torch's FLOP counter sees the attention."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else scores + attn_mask
        )
    return scores.softmax(-1) @ v


def test_training_flops_formula_counts_the_forward_matmuls(monkeypatch):
    """The FLOPs the benchmarks report: 3x the forward's matmuls and attention, as torch's counter sees them."""
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _math_attention)
    config = Pi05Config.from_preset("debug")
    model, batch, cameras = Pi05(config), 2, 3
    size, length = config.vision.image_size, config.tokenizer_max_length
    inputs = Pi05Inputs(
        torch.rand(batch, cameras, 3, size, size) * 2 - 1,
        torch.ones(batch, cameras, dtype=torch.bool),
        torch.randint(0, config.vocab_size, (batch, length)),
        torch.ones(batch, length, dtype=torch.bool),
    )
    actions = torch.randn(batch, config.chunk_size, config.max_action_dim)
    with FlopCounterMode(display=False) as counter:
        model.forward_loss(inputs, actions, torch.randn_like(actions), torch.rand(batch))
    counts = counter.get_flop_counts()
    per_sample = sum(  # the time embedding and the adaptive norms' modulation: once per sample, not per token
        sum(counts[name].values())
        for name in counts
        if name.endswith(("time_mlp_in", "time_mlp_out", "norm.dense"))
    )
    forward = (counter.get_total_flops() - per_sample) / batch
    assert config.training_flops_per_sample(cameras) == pytest.approx(3 * forward, rel=1e-9)

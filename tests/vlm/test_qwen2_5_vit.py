"""The Qwen2.5-VL vision encoder against transformers' own, on a tiny random encoder (fp32, CPU).

Outputs must agree to ``rtol=atol=1e-5`` (measured: <= 4e-6), every parameter's gradient to ``rtol=1e-4`` and an
``atol`` of 2e-5 times that gradient's largest magnitude (at least 2e-5): weight gradients sum over every patch and
reach ~20, so fp32 summation order alone moves them by up to ~5e-5 (measured: <= 5e-6 of the largest entry). The
window layout must be the one transformers computes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.vision_utils import get_vision_window_index

from forge_lightning.modules.vlm.patches import frame_ids, window_order
from forge_lightning.modules.vlm.qwen2_5_vit import (
    PRESETS,
    Qwen25VisionConfig,
    Qwen25VisionTransformer,
    from_hf_state_dict,
    load_hf_vision_weights,
    to_hf_state_dict,
)

OUT_TOL = {"rtol": 1e-5, "atol": 1e-5}

# Depth 4 with full attention at blocks 1 and 3; 56-pixel windows are 2 x 2 merged tokens (4 x 4 patches).
HF_VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=48,
    fullatt_block_indexes=[1, 3],
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,
)

INPUTS = {
    "two-images": [[1, 4, 6], [1, 8, 4]],
    "video-and-image": [[2, 6, 4], [1, 4, 8]],
    "one-window-image": [[1, 2, 2], [1, 6, 6]],
}
# Windows of 2 x 2 merged tokens over the merged grids (h/2 x w/2 per frame): 2 + 2, 2 + 2 (video) + 2, 1 + 4.
WINDOWS = {"two-images": 4, "video-and-image": 6, "one-window-image": 5}


def _randomize(model: torch.nn.Module) -> None:
    """Redraw every parameter so each one matters: norms around 1, biases N(0, 0.2), weights N(0, 1/fan_in)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif param.ndim == 1:
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, param[0].numel() ** -0.5)


@pytest.fixture(scope="module")
def pair() -> tuple[Qwen2_5_VisionTransformerPretrainedModel, Qwen25VisionTransformer]:
    """transformers' encoder with random weights, and ours with the same weights loaded as a ``visual.`` dict."""
    torch.manual_seed(0)
    hf_config = Qwen2_5_VLVisionConfig(**HF_VISION)
    reference = Qwen2_5_VisionTransformerPretrainedModel(hf_config)
    _randomize(reference)
    ours = Qwen25VisionTransformer(Qwen25VisionConfig.from_hf(hf_config.to_dict()))
    assert ours.config == Qwen25VisionConfig.from_preset("debug")
    state = {f"visual.{k}": v for k, v in reference.state_dict().items()}
    load_hf_vision_weights(ours, state)
    return reference, ours


def _pixels(config: Qwen25VisionConfig, grid: list[list[int]], seed: int = 0) -> torch.Tensor:
    num_patches = sum(t * h * w for t, h, w in grid)
    return torch.randn(num_patches, config.patch_dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", INPUTS)
def test_window_layout_matches_transformers(name):
    config = Qwen25VisionConfig.from_preset("debug")
    grid = INPUTS[name]
    grids = [tuple(g) for g in grid]
    order, window_ids = window_order(grids, config.spatial_merge_size, config.window_units)
    hf_order, hf_cu = get_vision_window_index(
        torch.tensor(grid), config.spatial_merge_size, config.window_size, config.patch_size
    )
    assert order.tolist() == hf_order.tolist()
    units_per_window = torch.unique_consecutive(window_ids, return_counts=True)[1]
    cu = torch.cat(
        [torch.zeros(1, dtype=torch.long), units_per_window.cumsum(0) * config.spatial_merge_size**2]
    )
    assert cu.tolist() == hf_cu.tolist()
    assert window_ids.unique().numel() == WINDOWS[name]
    # Reordering keeps every frame contiguous (so the per-frame segments hold in window order too).
    frame_of_unit = frame_ids(grids)[:: config.spatial_merge_size**2]
    assert torch.equal(frame_of_unit[order], frame_of_unit)


@pytest.mark.parametrize("name", INPUTS)
def test_outputs_and_gradients_match_transformers(pair, name):
    reference, ours = pair
    grid = torch.tensor(INPUTS[name])
    pixels = _pixels(ours.config, INPUTS[name])
    reference.zero_grad()
    ours.zero_grad()
    expected = reference(pixels, grid_thw=grid).pooler_output
    got = ours(pixels, grid)
    assert got.shape == (pixels.shape[0] // 4, 48)
    torch.testing.assert_close(got, expected, **OUT_TOL)

    projection = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (expected * projection).sum().backward()
    (got * projection).sum().backward()
    reference_grads = dict(reference.named_parameters())
    for param_name, param in ours.named_parameters():
        expected_grad = reference_grads[param_name].grad
        atol = 2e-5 * max(1.0, expected_grad.abs().max().item())
        torch.testing.assert_close(param.grad, expected_grad, rtol=1e-4, atol=atol, msg=param_name)


def test_flex_backend_matches_sdpa(pair):
    _, ours = pair
    flex = Qwen25VisionTransformer(ours.config, attention_backend="flex")
    flex.load_state_dict(ours.state_dict())
    grid = torch.tensor(INPUTS["video-and-image"])
    pixels = _pixels(ours.config, INPUTS["video-and-image"])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention on CPU warns that it is unfused
        torch.testing.assert_close(flex(pixels, grid), ours(pixels, grid), **OUT_TOL)


def test_loads_model_visual_keys_of_the_full_model():
    torch.manual_seed(0)
    text = dict(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 2, 8]},
    )
    full = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=HF_VISION))
    _randomize(full.model.visual)
    state = full.state_dict()
    assert any(k.startswith("model.visual.") for k in state)
    ours = load_hf_vision_weights(
        Qwen25VisionTransformer(Qwen25VisionConfig.from_hf(full.config.to_dict())), state
    )
    grid = torch.tensor(INPUTS["video-and-image"])
    pixels = _pixels(ours.config, INPUTS["video-and-image"])
    with torch.no_grad():
        expected = full.model.visual(pixels, grid_thw=grid).pooler_output
        torch.testing.assert_close(ours(pixels, grid), expected, **OUT_TOL)


def test_state_dict_round_trip(pair):
    reference, ours = pair
    for prefix in ("visual.", "model.visual."):
        exported = to_hf_state_dict(ours, prefix=prefix)
        assert sorted(exported) == sorted(prefix + k for k in reference.state_dict())
        assert from_hf_state_dict(exported).keys() == ours.state_dict().keys()
    reference.load_state_dict({k.removeprefix("visual."): v for k, v in to_hf_state_dict(ours).items()})


def test_weight_mismatches_are_named(pair):
    _, ours = pair
    state = to_hf_state_dict(ours)
    with pytest.raises(ValueError, match="none found"):
        from_hf_state_dict({"model.language_model.embed_tokens.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="both found"):
        from_hf_state_dict({**state, **to_hf_state_dict(ours, prefix="model.visual.")})
    del state["visual.blocks.2.attn.qkv.bias"]
    with pytest.raises(ValueError, match=r"missing: blocks\.2\.attn\.qkv\.bias"):
        load_hf_vision_weights(ours, state)
    other = Qwen25VisionTransformer(Qwen25VisionConfig.from_preset("debug", out_hidden_size=16))
    with pytest.raises(
        ValueError, match=r"of another shape: merger\.mlp\.2\.bias \[16\] \(encoder: \[48\]\)"
    ):
        load_hf_vision_weights(ours, to_hf_state_dict(other))


@pytest.mark.parametrize(
    ("pixels_shape", "grid", "match"),
    [
        (
            (30, 1176),
            [[1, 4, 6], [1, 4, 4]],
            r"pixel_values holds 30 patches but grid_thw \(\[\[1, 4, 6\], \[1, 4, 4\]\]\) describes 40",
        ),
        (
            (30, 1176),
            [[1, 5, 6]],
            r"grid_thw\[0\] \(\[1, 5, 6\]\): h and w must be multiples of spatial_merge_size",
        ),
        ((24, 1176), [[1, 4, 6], [0, 2, 2]], r"grid_thw\[1\] \(\[0, 2, 2\]\) must hold positive sizes"),
        ((24, 1176), [1, 4, 6], r"grid_thw must be an integer tensor \[num_images, 3\]"),
        ((24, 588), [[1, 4, 6]], r"pixel_values must be \[num_patches, 1176\]"),
    ],
)
def test_bad_inputs_raise(pair, pixels_shape, grid, match):
    _, ours = pair
    pixels, grid_thw = torch.zeros(pixels_shape), torch.tensor(grid)
    with pytest.raises(ValueError, match=match):
        ours(pixels, grid_thw)


def test_float_grid_is_refused(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="integer tensor"):
        ours(torch.zeros(24, 1176), torch.tensor([[1.0, 4.0, 6.0]]))


def test_config_from_and_to_hf():
    legacy = {
        **HF_VISION,
        "in_chans": 3,
        "tokens_per_second": 2,
        "hidden_act": "silu",
        "model_type": "qwen2_5_vl",
    }
    legacy.pop("window_size")
    config = Qwen25VisionConfig.from_hf({"vision_config": legacy})
    assert (config.num_layers, config.full_attention_layers, config.window_size) == (4, [1, 3], 112)
    hf = Qwen2_5_VLVisionConfig(**config.to_hf())
    assert Qwen25VisionConfig.from_hf(hf.to_dict()) == config
    assert (
        Qwen25VisionConfig.from_hf({**legacy, "rope_parameters": {"rope_theta": 500.0}}).rope_theta == 500.0
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_heads": 3}, r"vision\.num_heads \(3\) must divide vision\.hidden_size \(32\)"),
        ({"num_heads": 16}, "heads of a multiple of 4"),
        ({"full_attention_layers": [1, 4]}, r"in \[0, 4\) .* out of range: \[4\]"),
        ({"window_size": 20}, r"vision\.window_size \(20\) must cover at least one merged token"),
        ({"hidden_act": "gelu"}, r"vision\.hidden_act \('gelu'\) is not supported"),
        ({"patch_size": [14, 14]}, r"vision\.patch_size \(\[14, 14\]\) must be a positive integer"),
        ({"num_layers": 0}, r"vision\.num_layers \(0\) must be a positive integer"),
        ({"rope_theta": 0.0}, r"vision\.rope_theta \(0\.0\) must be positive"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        Qwen25VisionConfig.from_preset("debug", **overrides)


def test_hf_config_errors():
    with pytest.raises(ValueError, match="lacks required fields: depth"):
        Qwen25VisionConfig.from_hf({k: v for k, v in HF_VISION.items() if k != "depth"})
    with pytest.raises(ValueError, match=r"in_channels \(3\) and in_chans \(1\) disagree"):
        Qwen25VisionConfig.from_hf({**HF_VISION, "in_channels": 3, "in_chans": 1})
    with pytest.raises(ValueError, match="only 'axial'"):
        Qwen25VisionConfig.from_hf({**HF_VISION, "rope_parameters": {"rope_type": "default"}})


@pytest.mark.parametrize("name", PRESETS)
def test_presets_build(name):
    config = Qwen25VisionConfig.from_preset(name)
    assert config.head_dim % 4 == 0 and config.patch_dim == 1176
    if name != "debug":  # 112-pixel windows: 4 x 4 merged tokens
        assert (config.window_units, config.full_attention_layers) == (4, [7, 15, 23, 31])


def test_meta_build_then_init():
    config = Qwen25VisionConfig.from_preset("debug")
    with torch.device("meta"):
        encoder = Qwen25VisionTransformer(config)
    encoder.to_empty(device="cpu")
    encoder.init_weights()
    assert torch.equal(encoder.blocks[0].norm1.weight, torch.ones(32))
    assert torch.equal(encoder.blocks[0].attn.qkv.bias, torch.zeros(96))
    assert 0.01 < encoder.patch_embed.proj.weight.std() < 0.03
    reference = Qwen25VisionTransformer(config)
    torch.testing.assert_close(encoder.rotary_pos_emb.inv_freq, reference.rotary_pos_emb.inv_freq)
    grid = torch.tensor(INPUTS["two-images"])
    assert encoder(_pixels(config, INPUTS["two-images"]), grid).isfinite().all()

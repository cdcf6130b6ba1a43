"""Pi0.5's image path is the VLM family's SigLIP tower: lerobot's vision tensors land where transformers'
``SiglipVisionModel`` puts them, its numbers and gradients are transformers', and what Pi0.5 cannot use is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import SiglipVisionConfig as HFSiglipVisionConfig
from transformers import SiglipVisionModel as HFSiglipVisionModel

from forge_lightning.modules.embodied import Pi05, Pi05Config, SiglipConfig, load_lerobot_checkpoint
from forge_lightning.modules.vlm.siglip import SiglipVisionTransformer, load_hf_siglip_weights

TOL = 1e-5
_LEROBOT_SIGLIP = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model."


@pytest.fixture(scope="module")
def model(fixture_dir) -> Pi05:
    return load_lerobot_checkpoint(Pi05(Pi05Config.from_preset("debug")), fixture_dir)


def test_vision_tower_is_transformers_siglip_on_the_lerobot_weights(model, fixture_dir, expected):
    """The fixture's SigLIP tensors, read into transformers' SiglipVisionModel by their lerobot names, give the
    hidden state, input gradient and weight gradients of our tower (which loaded them through our layout)."""
    assert isinstance(model.vision.tower, SiglipVisionTransformer)
    state = load_file(str(fixture_dir / "model.safetensors"))
    siglip = {k.removeprefix(_LEROBOT_SIGLIP): v for k, v in state.items() if k.startswith(_LEROBOT_SIGLIP)}
    reference = HFSiglipVisionModel(HFSiglipVisionConfig(**model.config.vision.to_hf()))
    reference.load_state_dict(siglip, strict=True)  # transformers 5's names: no vision_model level
    pixels = expected["images_preprocessed"].flatten(0, 1)  # [B * cameras, 3, 32, 32] in [-1, 1]
    ours_in, theirs_in = pixels.clone().requires_grad_(True), pixels.clone().requires_grad_(True)
    ours = model.vision.tower.last_hidden_state(ours_in)
    theirs = reference(theirs_in).last_hidden_state
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    weights = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(0))
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, atol=TOL, rtol=0)
    hf_params = dict(reference.named_parameters())
    ours_params = dict(model.vision.tower.named_parameters())
    assert ours_params.keys() == hf_params.keys()
    for name, param in ours_params.items():
        torch.testing.assert_close(param.grad, hf_params[name].grad, atol=TOL, rtol=1e-4, msg=name)


def test_tokens_are_the_projected_last_hidden_state(model, expected):
    pixels = expected["images_preprocessed"].flatten(0, 1)
    with torch.no_grad():
        tokens = model.vision(pixels)
        projected = model.vision.projector(model.vision.tower.last_hidden_state(pixels))
    assert tokens.shape == (pixels.shape[0], model.config.vision.num_patches, model.config.llm.hidden_size)
    assert torch.equal(tokens, projected)


def test_tower_round_trips_through_transformers_names(model):
    """The tower's parameters are transformers' names: the VLM family's SigLIP loader fills a bare tower."""
    tower = load_hf_siglip_weights(
        SiglipVisionTransformer(model.config.vision), model.vision.tower.state_dict()
    )
    for name, tensor in tower.state_dict().items():
        assert torch.equal(tensor, model.vision.tower.state_dict()[name]), name


def test_vision_config_refuses_what_pi05_does_not_use():
    sizes = dataclasses.asdict(Pi05Config.from_preset("debug").vision)
    with pytest.raises(
        ValueError, match=r"vision.feature_layer \(-2\) selects LLaVA's features.*leave it at -1"
    ):
        SiglipConfig(**{**sizes, "feature_layer": -2})
    with pytest.raises(ValueError, match=r"vision.feature_select_strategy \('default'\) selects LLaVA's"):
        Pi05Config.from_preset("debug", vision={**sizes, "feature_select_strategy": "default"})
    with pytest.raises(ValueError, match=r"vision.patch_size \(5\) must divide vision.image_size \(32\)"):
        SiglipConfig(**{**sizes, "patch_size": 5})
    with pytest.raises(ValueError, match=r"vision.hidden_act \('relu'\) is not supported"):
        SiglipConfig(**{**sizes, "hidden_act": "relu"})


def test_a_checkpoint_that_does_not_fit_is_refused_by_name(fixture_dir, tmp_path):
    state = load_file(str(fixture_dir / "model.safetensors"))
    del state[_LEROBOT_SIGLIP + "encoder.layers.1.self_attn.q_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"the Pi0.5 weights of .* do not fit the model's config \(missing: "
        r"vision\.tower\.encoder\.layers\.1\.self_attn\.q_proj\.weight\)",
    ):
        load_lerobot_checkpoint(Pi05(Pi05Config.from_preset("debug")), tmp_path / "model.safetensors")


def test_image_path_keeps_openpi_initialisation():
    """Not SigLIP's own scheme: every linear N(0, initializer_range) with zero biases, the positions too, after
    construction and after building on the meta device (``to_empty`` + ``init_weights``) alike."""
    config = Pi05Config.from_preset("quickstart", initializer_range=0.05)
    torch.manual_seed(0)
    built = Pi05(config)
    with torch.device("meta"):
        late = Pi05(config)
    late.to_empty(device="cpu")
    late.init_weights()
    for model in (built, late):
        vision = model.vision
        linears = [m for m in vision.modules() if isinstance(m, torch.nn.Linear)]
        assert len(linears) == 6 * config.vision.num_layers + 1
        weights = torch.cat([m.weight.flatten() for m in linears])
        assert abs(weights.std().item() - 0.05) < 0.005 and all(not m.bias.any() for m in linears)
        positions = vision.tower.embeddings.position_embedding.weight
        assert abs(positions.std().item() - 0.05) < 0.01
        norms = [m for m in vision.modules() if isinstance(m, torch.nn.LayerNorm)]
        assert all(torch.equal(n.weight, torch.ones_like(n.weight)) and not n.bias.any() for n in norms)
        assert torch.isfinite(vision.tower.embeddings.patch_embedding.weight).all()

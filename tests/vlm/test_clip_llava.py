"""LLaVA-1.5's layout (CLIP tower, MLP projector, Llama) against transformers' ``LlavaForConditionalGeneration`` on
tiny random checkpoints (fp32): logits within 1e-4 (max abs), the loss within 1e-5 (relative), every gradient within
1e-4 (relative L2), for rows of two images, none and one, right-padded; with LLaVA-1.5's selection (layer -2, the
class token dropped) and with two layers and every token. The CLIP tower alone matches ``CLIPVisionModel``'s hidden
states within 1e-5; exports load in transformers; a model composed from a ``CLIPVisionModel`` (or ``CLIPModel``) and
a Llama checkpoint trains and exports as LLaVA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llava_parity import (
    LOGITS_TOL,
    assert_matches_transformers,
    assert_tower_matches,
    assert_trains,
    max_logits_diff,
    randomize,
    text,
)
from qwen_vl_parity import right_padded
from tiny import TINY_LLM, TINY_SIGLIP_VISION
from transformers import (
    AutoModelForCausalLM,
    CLIPConfig,
    CLIPModel,
    CLIPVisionConfig,
    CLIPVisionModel,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from forge_lightning.modules.vlm import VLMConfig, build_vlm, from_pretrained, save_pretrained
from forge_lightning.modules.vlm.clip import ClipVisionConfig, ClipVisionTransformer
from forge_lightning.modules.vlm.siglip import load_hf_siglip_weights

VOCAB = 512
IMAGE = 500
SIZE = TINY_SIGLIP_VISION["image_size"]
TINY_CLIP_VISION = TINY_SIGLIP_VISION  # the same sizes: 16 x 16 images, 16 patches and a class token
TOWER_TOL = 1e-5
# vision_feature_layer, vision_feature_select_strategy: LLaVA-1.5's, and two layers with the class token kept.
CASES = {"llava-1.5": (-2, "default"), "two_layers_full": ([0, -1], "full")}


def _hf_config(case: str) -> LlavaConfig:
    layer, strategy = CASES[case]
    return LlavaConfig(
        vision_config=CLIPVisionConfig(**TINY_CLIP_VISION),
        text_config={**TINY_LLM, "vocab_size": VOCAB},
        image_token_index=IMAGE,
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
    )


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory) -> tuple[LlavaForConditionalGeneration, object]:
    path = tmp_path_factory.mktemp(request.param)
    hf = randomize(LlavaForConditionalGeneration(_hf_config(request.param)))
    hf.save_pretrained(path)
    return hf, from_pretrained(path)


def _batch(tokens_per_image: int) -> dict[str, torch.Tensor]:
    """Three right-padded rows: two images, none, one image."""
    image = [IMAGE] * tokens_per_image
    ids, mask = right_padded(
        [text(3, 0) + image + text(4, 1) + image + text(2, 2), text(7, 3), text(2, 4) + image + text(5, 5)]
    )
    pixels = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(6))
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels)


def test_config_reads_as_clip(pair) -> None:
    _, model = pair
    assert (model.config.vision_type, model.config.projector_type) == ("clip", "mlp")
    assert model.config.vision.hidden_act == "quick_gelu" and model.config.vision.layer_norm_eps == 1e-5
    strategy = model.config.vision.feature_select_strategy
    assert model.config.vision.tokens_per_image == (16 if strategy == "default" else 17)


def test_logits_loss_and_gradients_match_transformers(pair) -> None:
    hf, model = pair
    unused = assert_matches_transformers(model, hf, _batch(model.config.vision.tokens_per_image), (IMAGE,))
    assert unused >= 2  # post_layernorm at least: it normalises only the pooled class token


def test_saved_checkpoint_loads_in_transformers(pair, tmp_path: Path) -> None:
    hf, model = pair
    out = save_pretrained(model, model.config, tmp_path / "ours")
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["model_type"] == "clip_vision_model"
    assert "vision_use_head" not in config["vision_config"]
    assert config["image_seq_length"] == model.config.vision.tokens_per_image
    loaded = LlavaForConditionalGeneration.from_pretrained(out).eval()
    assert max_logits_diff(model, loaded, _batch(model.config.vision.tokens_per_image)) <= LOGITS_TOL
    again = from_pretrained(out)
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert VLMConfig.from_hf(config).vision == model.config.vision


def test_vision_config_without_model_type_reads_as_clip() -> None:
    """transformers reads a LLaVA ``vision_config`` without ``model_type`` as CLIP; so do we."""
    hf = _hf_config("llava-1.5").to_dict()
    del hf["vision_config"]["model_type"]
    assert VLMConfig.from_hf(hf).vision_type == "clip"


def test_clip_tower_matches_transformers() -> None:
    reference = randomize(CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP_VISION)))
    config = ClipVisionConfig.from_hf(reference.config.to_dict(), feature_layer=[1, -2])
    assert config == ClipVisionConfig.from_preset("debug", feature_layer=[1, -2])
    assert (config.num_tokens, config.tokens_per_image) == (17, 16)
    tower = load_hf_siglip_weights(ClipVisionTransformer(config), reference.state_dict())
    pixels = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    assert assert_tower_matches(tower, reference, pixels, TOWER_TOL).shape == (2, 16, 64)


def test_fresh_clip_tower_is_initialised() -> None:
    tower = ClipVisionTransformer(ClipVisionConfig.from_preset("debug"))
    assert tower.embeddings.patch_embedding.bias is None
    assert tower.embeddings.class_embedding.std().item() == pytest.approx(32**-0.5, rel=0.5)
    assert torch.equal(tower.pre_layrnorm.weight, torch.ones(32))


@pytest.mark.parametrize("whole_clip", [False, True])
def test_composed_from_a_clip_and_a_llama_checkpoint_trains_and_exports(
    tmp_path: Path, whole_clip: bool
) -> None:
    if whole_clip:  # CLIPModel: image and text towers and their projections; only the vision tower is read
        text_config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        clip = randomize(CLIPModel(CLIPConfig(vision_config=TINY_CLIP_VISION, text_config=text_config)))
        vision_state = clip.vision_model.state_dict()
    else:
        clip = randomize(CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP_VISION)))
        vision_state = clip.state_dict()
    clip.save_pretrained(tmp_path / "clip")
    llama = randomize(
        AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_LLM, "vocab_size": VOCAB})), seed=1
    )
    llama.save_pretrained(tmp_path / "llama")
    model = build_vlm(
        {
            "vision": {"pretrained": str(tmp_path / "clip")},
            "llm": {"pretrained": str(tmp_path / "llama")},
            "image_token_id": IMAGE,
        }
    )
    assert model.config.vision_type == "clip" and model.config.vision.feature_select_strategy == "default"
    assert vision_state.keys() == model.vision.state_dict().keys()
    assert all(torch.equal(v, model.vision.state_dict()[k]) for k, v in vision_state.items())

    batch = _batch(model.config.vision.tokens_per_image)
    assert_trains(model, batch, (IMAGE,))
    out = save_pretrained(model, model.config, tmp_path / "llava")
    hf = LlavaForConditionalGeneration.from_pretrained(out).eval()
    assert max_logits_diff(model, hf, batch) <= LOGITS_TOL


def test_wrong_number_of_image_tokens_names_the_class_token(pair) -> None:
    _, model = pair
    per_image = model.config.vision.tokens_per_image
    batch = _batch(per_image + 1)
    with pytest.raises(ValueError, match=r"\(image_size // patch_size\) \*\* 2 \+ 1 \(the class token\)"):
        model(**batch)

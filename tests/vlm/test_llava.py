"""LLaVA with a SigLIP tower against transformers' ``LlavaForConditionalGeneration`` on tiny random checkpoints
(fp32), with a Llama, a Qwen3 and a Qwen2 language model: logits within 1e-4 (max abs), the loss within 1e-5 (relative),
every parameter's gradient within 1e-4 (relative L2), for rows of two images, one image and none, right-padded.
Checkpoints load from every layout transformers writes and ours load in transformers with the same logits; a model
composed from a SigLIP and a Qwen3 checkpoint trains and exports as LLaVA. The SigLIP tower alone matches
``SiglipVisionModel``'s hidden states within 1e-5."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from llava_parity import (
    assert_matches_transformers,
    assert_tower_matches,
    assert_trains,
    max_logits_diff,
    randomize,
)
from safetensors.torch import save_file
from tiny import TINY_LLM, TINY_QWEN3_TEXT, TINY_SIGLIP_VISION
from transformers import AutoModelForCausalLM, LlavaConfig, LlavaForConditionalGeneration, Qwen3Config
from transformers import SiglipConfig as HFSiglipConfig
from transformers import SiglipModel as HFSiglipModel
from transformers import SiglipVisionConfig as HFSiglipVisionConfig
from transformers import SiglipVisionModel as HFSiglipVisionModel

from forge_lightning.modules.llm import LLMConfig
from forge_lightning.modules.vlm import (
    SiglipVisionConfig,
    SiglipVisionTransformer,
    VisionLanguageModel,
    VLMConfig,
    build_vlm,
    from_pretrained,
    save_pretrained,
)
from forge_lightning.modules.vlm.siglip import load_hf_siglip_weights

VOCAB = 512
IMAGE = 500
SIZE = TINY_SIGLIP_VISION["image_size"]
LOGITS_TOL, LOSS_TOL, GRAD_TOL, TOWER_TOL = 1e-4, 1e-5, 1e-4, 1e-5

# Text model, vision_feature_layer, vision_feature_select_strategy: LLaVA-1.5's selection with a tied Llama, two
# concatenated layers with all tokens with Qwen3, the last layer without its first token with Qwen2 (q/k/v biases).
CASES = {
    "llama": ({**TINY_LLM, "vocab_size": VOCAB}, -2, "default"),
    "qwen3": ({**TINY_QWEN3_TEXT, "vocab_size": VOCAB}, [-3, -1], "full"),
    "qwen2": ({**TINY_QWEN3_TEXT, "model_type": "qwen2", "vocab_size": VOCAB}, -1, "default"),
}


def _hf_config(case: str, *, use_head: bool = False) -> LlavaConfig:
    text, layer, strategy = CASES[case]
    return LlavaConfig(
        vision_config=HFSiglipVisionConfig(**TINY_SIGLIP_VISION, vision_use_head=use_head),
        text_config=text,
        image_token_index=IMAGE,
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
    )


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory) -> tuple[str, LlavaForConditionalGeneration, VisionLanguageModel]:
    """transformers' LLaVA with random weights, saved by transformers and read back by ``from_pretrained``."""
    path = tmp_path_factory.mktemp(request.param)
    hf = randomize(LlavaForConditionalGeneration(_hf_config(request.param)))
    hf.save_pretrained(path)
    return request.param, hf, from_pretrained(path)


def _tokens_per_image(model: VisionLanguageModel) -> int:
    return model.config.vision.tokens_per_image


def _text(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _batch(tokens_per_image: int) -> dict[str, torch.Tensor]:
    """Three right-padded rows: two images, none, one image."""
    image = [IMAGE] * tokens_per_image
    rows = [
        _text(3, 0) + image + _text(4, 1) + image + _text(2, 2),
        _text(7, 3),
        _text(2, 4) + image + _text(5, 5),
    ]
    seq = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), seq, dtype=torch.long), torch.zeros(len(rows), seq, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = torch.tensor(row), 1
    pixels = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(6))
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels)


def test_logits_loss_and_gradients_match_transformers(pair) -> None:
    _, hf, model = pair
    unused = assert_matches_transformers(model, hf, _batch(_tokens_per_image(model)), (IMAGE,))
    assert unused > 0  # post_layernorm at least: LLaVA takes hidden states from before it


def test_saved_checkpoint_loads_in_transformers(pair, tmp_path: Path) -> None:
    case, _, model = pair
    out = save_pretrained(model, model.config, tmp_path / "ours", max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    prefixes = {".".join(k.split(".")[:2]) for k in index["weight_map"]}
    expected = {
        "vision_tower.vision_model",
        "multi_modal_projector.linear_1",
        "multi_modal_projector.linear_2",
    }
    expected |= {"language_model.model"} | (
        set() if model.config.llm.tie_word_embeddings else {"language_model.lm_head"}
    )
    assert prefixes == expected
    hf = LlavaForConditionalGeneration.from_pretrained(out).eval()
    assert hf.config.vision_feature_layer == CASES[case][1]
    assert max_logits_diff(model, hf, _batch(_tokens_per_image(model))) <= LOGITS_TOL
    again = from_pretrained(out)
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("layout", ["in_memory", "transformers_save_with_head"])
def test_reads_every_layout_transformers_writes(tmp_path: Path, layout: str) -> None:
    """transformers 5's in-memory names (``model.vision_tower.*``), and its own save of a tower with the pooling
    head (``vision_tower.*``, ``language_model.model.*``; the head is skipped)."""
    hf = randomize(LlavaForConditionalGeneration(_hf_config("qwen3", use_head=layout != "in_memory")))
    if layout == "in_memory":
        hf.config.save_pretrained(tmp_path)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    else:
        hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert max_logits_diff(model, hf, _batch(_tokens_per_image(model))) <= LOGITS_TOL


def test_tensors_in_two_layouts_or_of_no_component_are_named(tmp_path: Path) -> None:
    hf = LlavaForConditionalGeneration(_hf_config("qwen3"))
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    name = "model.vision_tower.post_layernorm.bias"
    for extra, match in (
        (
            {"vision_tower.vision_model.post_layernorm.bias": state[name].clone()},
            rf"holds tensors twice.*{name} and",
        ),
        (
            {"logit_scale": torch.zeros(1)},
            r"tensors outside the vision encoder, projector and language model: logit",
        ),
    ):
        save_file({**state, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            from_pretrained(tmp_path)


def test_composed_from_a_siglip_and_a_qwen3_checkpoint_trains_and_exports(tmp_path: Path) -> None:
    torch.manual_seed(0)
    siglip = randomize(
        HFSiglipVisionModel(HFSiglipVisionConfig(**TINY_SIGLIP_VISION))
    )  # with its pooling head
    siglip.save_pretrained(tmp_path / "siglip")
    qwen3 = randomize(AutoModelForCausalLM.from_config(Qwen3Config(**CASES["qwen3"][0])), seed=1)
    qwen3.save_pretrained(tmp_path / "qwen3")
    spec = {
        "vision": {"pretrained": str(tmp_path / "siglip"), "feature_layer": -1},
        "projector": "mlp",
        "llm": {"pretrained": str(tmp_path / "qwen3")},
        "image_token_id": IMAGE,
    }
    model = build_vlm(spec)
    assert model.config.vision.feature_select_strategy == "full" and model.config.llm.architecture == "qwen3"
    vision = {k: v for k, v in siglip.state_dict().items() if not k.startswith("head.")}
    assert vision.keys() == model.vision.state_dict().keys()
    assert all(torch.equal(v, model.vision.state_dict()[k]) for k, v in vision.items())
    llm = model.llm.state_dict()
    assert qwen3.state_dict().keys() == llm.keys()
    assert all(torch.equal(v, llm[k]) for k, v in qwen3.state_dict().items())

    batch = _batch(_tokens_per_image(model))
    assert_trains(model, batch, (IMAGE,))

    out = save_pretrained(model, model.config, tmp_path / "llava")
    hf = LlavaForConditionalGeneration.from_pretrained(out).eval()
    assert max_logits_diff(model, hf, batch) <= LOGITS_TOL


def test_composition_reads_a_siglip_model_checkpoint_and_a_preset_llm(tmp_path: Path) -> None:
    """A whole ``SiglipModel`` (image and text towers) gives its vision tower; a preset name gives a fresh LLM."""
    text = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    full = randomize(HFSiglipModel(HFSiglipConfig(vision_config=TINY_SIGLIP_VISION, text_config=text)))
    full.save_pretrained(tmp_path)
    model = build_vlm({"vision": {"pretrained": str(tmp_path)}, "llm": "debug", "image_token_id": 3})
    assert model.config.projector_type == "mlp"  # LLaVA's, by default
    reference = full.vision_model.state_dict()
    for name, tensor in model.vision.state_dict().items():
        assert torch.equal(tensor, reference[name]), name


def test_siglip_tower_matches_transformers() -> None:
    reference = randomize(HFSiglipVisionModel(HFSiglipVisionConfig(**TINY_SIGLIP_VISION)))
    config = SiglipVisionConfig.from_hf(
        reference.config.to_dict(), feature_layer=[1, -2], feature_select_strategy="default"
    )
    assert config == SiglipVisionConfig.from_preset(
        "debug", feature_layer=[1, -2], feature_select_strategy="default"
    )
    tower = load_hf_siglip_weights(SiglipVisionTransformer(config), reference.state_dict())
    pixels = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    features = assert_tower_matches(tower, reference, pixels, TOWER_TOL)
    assert features.shape == (2, config.tokens_per_image, config.out_hidden_size) == (2, 15, 64)


def test_config_round_trips_through_transformers() -> None:
    hf = _hf_config("qwen3").to_dict()
    config = VLMConfig.from_hf(hf)
    assert (config.vision_type, config.projector_type, config.image_token_id) == ("siglip", "mlp", IMAGE)
    assert config.vision.feature_layer == [-3, -1] and config.vision.out_hidden_size == 64
    assert config.video_token_id is None and config.tokens_per_second is None
    assert VLMConfig.from_hf(config.to_hf()) == config
    back = LlavaConfig(**config.to_hf())
    assert back.image_token_id == IMAGE and back.image_seq_length == 16
    assert back.vision_config.num_hidden_layers == 3 and back.text_config.model_type == "qwen3"


def _tiny_config(**overrides) -> VLMConfig:
    fields = {
        "vision": {"type": "siglip", **dataclasses.asdict(SiglipVisionConfig.from_preset("debug"))},
        "llm": LLMConfig.from_hf({**TINY_LLM, "vocab_size": VOCAB}),
        "image_token_id": IMAGE,
    }
    return VLMConfig(**{**fields, **overrides})


def test_wrong_number_of_image_tokens_is_named(pair) -> None:
    case, _, model = pair
    per_image = _tokens_per_image(model)
    batch = _batch(per_image)
    first = int((batch["input_ids"][0] == IMAGE).nonzero()[0])
    batch["input_ids"][0, first] = 7
    count = 3 * per_image
    with pytest.raises(
        ValueError,
        match=rf"pixel_values give {count} image features \(3 images x {per_image}.*must hold {count} <image> "
        rf"tokens \(image_token_id\), but {count - 1} were found",
    ):
        model(**batch)
    del batch["pixel_values"]
    with pytest.raises(ValueError, match=rf"hold {count - 1} <image> tokens but no image pixels"):
        model(**batch)
    with pytest.raises(ValueError, match=r"vision.type 'siglip' does not take image_grid_thw"):
        model(**_batch(per_image), image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match=r"pixel_values must be \[num_images, 3, 16, 16\]"):
        model(**{**_batch(per_image), "pixel_values": torch.zeros(3, 3, 8, 8)})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"vision": {"type": "dinov2"}},
            r"vision.type \('dinov2'\) is not supported; supported: qwen2_5_vit, qwen3_vit, siglip, clip, "
            "siglip_anyres",
        ),
        ({"projector": "linear"}, r"projector \('linear'\) is not supported; supported: none, mlp"),
        (
            {"projector": {"type": "mlp", "hidden_act": "tanh"}},
            r"projector.hidden_act \('tanh'\) is not supported",
        ),
        (
            {"projector": "none"},
            r"vision.out_hidden_size \(32\) must equal llm.hidden_size \(64\) with projector 'none'",
        ),
        ({"image_token_id": None}, r"image_token_id must be set for vision.type 'siglip' \(LLaVA\)"),
        (
            {"image_token_id": VOCAB},
            r"image_token_id \(512\) must be a token id in \[0, llm.vocab_size=512\)",
        ),
        ({"video_token_id": 5}, r"video_token_id \(5\) is not used by vision.type 'siglip' \(LLaVA\)"),
        (
            {"vision": {"type": "siglip", "pretrained": "dir"}},
            r"vision.pretrained names a checkpoint .*build_vlm",
        ),
    ],
)
def test_config_errors_name_the_field(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _tiny_config(**overrides)


def test_vision_and_family_checks() -> None:
    with pytest.raises(
        ValueError,
        match=r"vision.feature_layer \(\[4\]\) must be one or more hidden-state indices in \[-4, 3\]",
    ):
        SiglipVisionConfig.from_preset("debug", feature_layer=4)
    with pytest.raises(ValueError, match=r"feature_select_strategy \('cls'\) must be one of default, full"):
        SiglipVisionConfig.from_preset("debug", feature_select_strategy="cls")
    mrope = LLMConfig.from_hf(
        {
            **TINY_LLM,
            "vocab_size": VOCAB,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]},
        }
    )
    with pytest.raises(ValueError, match=r"llm.rope_scaling has an mrope_section, but vision.type 'siglip'"):
        _tiny_config(llm=mrope)
    wide = _tiny_config(vision=SiglipVisionConfig.from_preset("debug", hidden_size=64), projector="none")
    with pytest.raises(
        ValueError, match=r"a LLaVA checkpoint \(LlavaForConditionalGeneration\) has projector 'mlp'"
    ):
        wide.to_hf()
    hf = _hf_config("llama").to_dict()
    hf["vision_config"]["model_type"] = "dinov2"
    with pytest.raises(ValueError, match=r"vision_config model_type \('dinov2'\) is not supported"):
        VLMConfig.from_hf(hf)


def test_composition_errors_name_the_checkpoint(tmp_path: Path) -> None:
    qwen3 = AutoModelForCausalLM.from_config(Qwen3Config(**CASES["qwen3"][0]))
    qwen3.save_pretrained(tmp_path / "qwen3")
    with pytest.raises(
        ValueError,
        match=r"holds a 'qwen3' checkpoint; supported encoder checkpoints: siglip_vision_model, siglip, "
        "clip_vision_model, clip",
    ):
        build_vlm({"vision": {"pretrained": str(tmp_path / "qwen3")}, "llm": "debug", "image_token_id": 3})
    with pytest.raises(FileNotFoundError, match=r"llm.pretrained: no config.json in"):
        build_vlm(
            {
                "vision": {
                    "type": "siglip",
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_layers": 1,
                    "num_heads": 2,
                },
                "llm": {"pretrained": str(tmp_path / "nowhere")},
                "image_token_id": 3,
            }
        )

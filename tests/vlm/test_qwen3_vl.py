"""The composed Qwen3-VL model against transformers' ``Qwen3VLForConditionalGeneration`` on a tiny random checkpoint
(fp32): logits within 1e-4 (max abs), the loss within 1e-5 (relative), every parameter's gradient within 1e-4
(relative L2), for several images per sample beside a text-only row, a video beside an image and a video alone
(DeepStack features at image and video tokens, interleaved M-RoPE, one placeholder run per video frame); checkpoints
written by us load in transformers with the same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from qwen_vl_parity import (
    END,
    IMAGE,
    START,
    VIDEO,
    VOCAB,
    assert_export_loads,
    assert_matches_transformers,
    assert_tied_round_trip,
    hf_checkpoint,
    pixels,
    placeholders,
    right_padded,
    text,
)
from tiny import TINY_QWEN3_VL_TEXT
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from forge_lightning.modules.vlm import VisionLanguageModel, VLMConfig, from_pretrained
from forge_lightning.modules.vlm.qwen3_vit import Qwen3VisionConfig

PATCH = 4
# Three decoder layers and two DeepStack layers: the third decoder layer gets no vision features.
TEXT = dict(
    vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **{**TINY_QWEN3_VL_TEXT, "num_hidden_layers": 3}
)
VISION = dict(
    depth=3,
    deepstack_visual_indexes=[0, 2],
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=PATCH,
    num_position_embeddings=16,  # a 4 x 4 learned grid, resampled up and down to the grids below
)
IMG_A, IMG_B, IMG_C, VID = (1, 4, 6), (1, 6, 4), (1, 2, 2), (2, 4, 4)


def _hf_config() -> Qwen3VLConfig:
    return Qwen3VLConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


def _hf_checkpoint(path: Path, tie: bool = False) -> Qwen3VLForConditionalGeneration:
    return hf_checkpoint(Qwen3VLForConditionalGeneration, Qwen3VLConfig, TEXT, VISION, path, tie)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Qwen3VLForConditionalGeneration, VisionLanguageModel]:
    path = tmp_path_factory.mktemp("hf")
    hf = _hf_checkpoint(path)
    return hf, from_pretrained(path)


def _video(grid: tuple[int, int, int], seed: int) -> list[int]:
    """A video as Qwen3-VL's processor writes it: per temporal patch, a timestamp (``<0.5 seconds>``, two text
    tokens here) and the frame's own placeholder run."""
    return sum((text(2, seed + k) + placeholders(VIDEO, (1, *grid[1:])) for k in range(grid[0])), [])


def _batch(case: str) -> dict[str, torch.Tensor]:
    if case == "two_images_and_text_only":
        ids, mask = right_padded(
            [
                text(3, 0)
                + placeholders(IMAGE, IMG_A)
                + text(4, 1)
                + placeholders(IMAGE, IMG_B)
                + text(2, 2),
                text(9, 3),
                text(2, 4) + placeholders(IMAGE, IMG_C) + text(3, 5),
            ]
        )
        return dict(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=pixels([IMG_A, IMG_B, IMG_C], 0, PATCH),
            image_grid_thw=torch.tensor([IMG_A, IMG_B, IMG_C]),
        )
    video = dict(pixel_values_videos=pixels([VID], 2, PATCH), video_grid_thw=torch.tensor([VID]))
    if case == "video":
        ids, mask = right_padded([text(2, 6) + _video(VID, 20) + text(3, 7), text(4, 8)])
        return dict(input_ids=ids, attention_mask=mask, **video)
    ids, mask = right_padded(
        [text(2, 9) + _video(VID, 30) + text(3, 10) + placeholders(IMAGE, IMG_A) + text(2, 11)]
    )
    return dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pixels([IMG_A], 1, PATCH),
        image_grid_thw=torch.tensor([IMG_A]),
        **video,
    )


@pytest.mark.parametrize("case", ["two_images_and_text_only", "video_and_image", "video"])
def test_logits_loss_and_gradients_match_transformers(pair, case: str) -> None:
    assert_matches_transformers(*pair, _batch(case))


def test_deepstack_features_reach_the_language_model(pair) -> None:
    """With the DeepStack mergers' outputs zeroed the logits change, but not on the text-only row."""
    _, model = pair
    batch = _batch("two_images_and_text_only")
    keep = batch["attention_mask"].bool()
    fc2 = [m.linear_fc2 for m in model.vision.deepstack_merger_list]
    saved = [(fc.weight.clone(), fc.bias.clone()) for fc in fc2]
    with torch.no_grad():
        full = model(**batch)
        try:
            for fc in fc2:
                fc.weight.zero_()
                fc.bias.zero_()
            without = model(**batch)
        finally:
            for fc, (w, b) in zip(fc2, saved):
                fc.weight.copy_(w)
                fc.bias.copy_(b)
    assert (full - without)[keep].abs().max() > 1e-3
    assert torch.equal(full[1], without[1])


def test_layer_residuals_add_after_their_decoder_layers(pair) -> None:
    """The hook alone: a residual after layer 0 equals running layer 0, adding it, then the rest by hand."""
    llm = pair[1].llm
    ids = torch.tensor([text(7, 40)])
    extra = torch.randn(1, 7, llm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(
            llm.hidden_states(ids), llm.hidden_states(ids, layer_residuals=[torch.zeros_like(extra)])
        )
        got = llm.hidden_states(ids, layer_residuals=[extra])
        m = llm.model
        rope = m.rotary_emb(torch.arange(7)[None])
        x = m.layers[0](m.embed_tokens(ids), rope) + extra
        for layer in m.layers[1:]:
            x = layer(x, rope)
        assert torch.equal(got, m.norm(x))
    with pytest.raises(ValueError, match="layer_residuals holds 4 tensors but the model has 3 layers"):
        llm.hidden_states(ids, layer_residuals=[extra] * 4)


def test_saved_checkpoint_loads_in_transformers(pair, tmp_path: Path) -> None:
    out = assert_export_loads(
        pair[1], Qwen3VLForConditionalGeneration, _batch("video_and_image"), tmp_path / "ours"
    )
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "qwen3_vl" and saved["vision_config"]["deepstack_visual_indexes"] == [0, 2]


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    hf = _hf_checkpoint(tmp_path / "hf", tie=True)
    batch = _batch("two_images_and_text_only")
    assert_tied_round_trip(hf, Qwen3VLForConditionalGeneration, tmp_path / "hf", batch, tmp_path / "ours")


def test_wrong_number_of_image_tokens_is_named(pair) -> None:
    _, model = pair
    batch = _batch("two_images_and_text_only")
    first = int((batch["input_ids"][0] == IMAGE).nonzero()[0])
    batch["input_ids"][0, first] = 7  # one <|image_pad|> fewer than the three images give
    with pytest.raises(ValueError, match=r"must hold 13 <\|image_pad\|> tokens .* but 12 were found"):
        model(**batch)
    del batch["pixel_values"]
    with pytest.raises(ValueError, match=r"hold 12 <\|image_pad\|> tokens but no image pixels"):
        model(**batch)


def test_bad_video_inputs_are_named(pair) -> None:
    _, model = pair
    batch = _batch("video")
    with pytest.raises(ValueError, match=r"vision.type 'qwen3_vit' does not take second_per_grid_ts"):
        model(**batch, second_per_grid_ts=torch.tensor([1.0]))
    # Qwen2.5-VL's layout (one run for the whole video) instead of one run per frame after its timestamp.
    row = text(2, 6) + placeholders(VIDEO, VID) + text(3, 7)
    batch["input_ids"], batch["attention_mask"] = right_padded([row])
    with pytest.raises(ValueError, match=r"placeholder run \(id 251\) is longer than the 4 tokens"):
        model(**batch)
    batch = _batch("video")
    del batch["video_grid_thw"]
    with pytest.raises(ValueError, match="video pixels need their video_grid_thw"):
        model(**batch)


def test_config_reads_and_round_trips() -> None:
    hf = _hf_config().to_dict()
    config = VLMConfig.from_hf(hf)
    assert config.vision_type == "qwen3_vit" and config.family.name == "Qwen3-VL"
    assert config.vision.deepstack_layers == [0, 2] and config.vision.grid_side == 4
    assert config.llm.mrope_interleaved and config.llm.mrope_section == [6, 5, 5] and config.llm.qk_norm
    assert config.tokens_per_second is None
    assert VLMConfig.from_hf(config.to_hf()) == config
    legacy = {**hf, "vision_config": {**hf["vision_config"], "model_type": "qwen3_vl"}}  # early releases
    assert VLMConfig.from_hf(legacy) == config
    back = Qwen3VLConfig(**config.to_hf())
    assert back.vision_config.deepstack_visual_indexes == [0, 2] and back.text_config.num_hidden_layers == 3


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda c: c["vision_config"].update(out_hidden_size=48),
            r"vision.out_hidden_size \(48\) must equal",
        ),
        (
            lambda c: c["vision_config"].update(deepstack_visual_indexes=[0, 3]),
            r"vision.deepstack_layers \(\[0, 3\]\) must be distinct block indices in \[0, 3\)",
        ),
        (
            lambda c: c["vision_config"].update(num_position_embeddings=15),
            r"vision.num_position_embeddings \(15\) must be a square number",
        ),
        (
            lambda c: c["vision_config"].update(hidden_act="relu6"),
            r"vision.hidden_act \('relu6'\) is not supported",
        ),
        (
            lambda c: c["text_config"].update(num_hidden_layers=1),
            r"vision.deepstack_layers \(\[0, 2\]\) feed 2 decoder layers, but llm.num_layers is 1",
        ),
        (lambda c: c.update(video_token_id=IMAGE), "the special token ids must differ"),
        (
            lambda c: c.update(model_type="qwen3_vl_moe"),
            r"model_type \('qwen3_vl_moe'\) must be 'qwen3_vl' for a vision_config of model_type 'qwen3_vl_vision'",
        ),
        (lambda c: c.update(model_type="qwen2_5_vl"), r"model_type \('qwen2_5_vl'\) must be 'qwen3_vl'"),
    ],
)
def test_config_errors_name_the_field(change, match: str) -> None:
    hf = _hf_config().to_dict()
    change(hf)
    with pytest.raises(ValueError, match=match):
        VLMConfig.from_hf(hf)


def test_config_needs_interleaved_multimodal_rope() -> None:
    config = VLMConfig.from_hf(_hf_config().to_dict())
    chunked = dataclasses.asdict(config.llm) | {
        "rope_scaling": {"rope_type": "default", "mrope_section": [6, 5, 5]}
    }
    with pytest.raises(
        ValueError, match=r"mrope_interleaved \(False\) must be True for architecture 'qwen3_vl_text'"
    ):
        VLMConfig(vision=config.vision, llm=chunked)
    qwen2_5_vision = dict(
        hidden_size=32,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        out_hidden_size=64,
        full_attention_layers=[0],
    )
    with pytest.raises(ValueError, match="a Qwen2.5-VL language model takes chunked multimodal RoPE"):
        VLMConfig(vision={"type": "qwen2_5_vit", **qwen2_5_vision}, llm=config.llm)
    tokens = dict(
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
    )
    vision = {"type": "qwen3_vit", **dataclasses.asdict(config.vision)}
    assert VLMConfig(vision=vision, llm=config.llm, **tokens) == config


def test_vision_preset_builds() -> None:
    config = Qwen3VisionConfig.from_preset("debug")
    assert config.deepstack_layers == [0, 1] and config.patch_dim == 3 * 2 * 4 * 4
    with pytest.raises(KeyError, match="unknown vision preset 'big'"):
        Qwen3VisionConfig.from_preset("big")

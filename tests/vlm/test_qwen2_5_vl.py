"""The composed Qwen2.5-VL model against transformers' ``Qwen2_5_VLForConditionalGeneration`` on a tiny random
checkpoint (fp32): logits within 1e-4 (max abs), the loss within 1e-5 (relative), every parameter's gradient within
1e-4 (relative L2); checkpoints written by us load in transformers with the same logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from qwen2_5_vl_case import IMG_A, IMG_B, IMG_C, PATCH, TEXT, VID, VISION
from qwen2_5_vl_case import hf_config as _hf_config
from qwen_vl_parity import (
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
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from forge_lightning.modules.vlm import VisionLanguageModel, VLMConfig, from_pretrained


def _hf_checkpoint(path: Path, tie: bool = False) -> Qwen2_5_VLForConditionalGeneration:
    return hf_checkpoint(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, TEXT, VISION, path, tie)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Qwen2_5_VLForConditionalGeneration, VisionLanguageModel]:
    path = tmp_path_factory.mktemp("hf")
    hf = _hf_checkpoint(path)
    return hf, from_pretrained(path)


def _batch(case: str) -> dict[str, torch.Tensor]:
    if case == "two_images_and_text_only":
        rows = [
            text(3, 0) + placeholders(IMAGE, IMG_A) + text(4, 1) + placeholders(IMAGE, IMG_B) + text(2, 2),
            text(9, 3),
        ]
        ids, mask = right_padded(rows)
        return dict(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=pixels([IMG_A, IMG_B], 0, PATCH),
            image_grid_thw=torch.tensor([IMG_A, IMG_B]),
        )
    ids, mask = right_padded(
        [text(2, 4) + placeholders(VIDEO, VID) + text(3, 5) + placeholders(IMAGE, IMG_C) + text(2, 6)]
    )
    return dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pixels([IMG_C], 1, PATCH),
        image_grid_thw=torch.tensor([IMG_C]),
        pixel_values_videos=pixels([VID], 2, PATCH),
        video_grid_thw=torch.tensor([VID]),
        second_per_grid_ts=torch.tensor([1.5]),
    )


@pytest.mark.parametrize("case", ["two_images_and_text_only", "video_and_image"])
def test_logits_loss_and_gradients_match_transformers(pair, case: str) -> None:
    assert_matches_transformers(*pair, _batch(case))


def test_saved_checkpoint_loads_in_transformers(pair, tmp_path: Path) -> None:
    assert_export_loads(
        pair[1], Qwen2_5_VLForConditionalGeneration, _batch("video_and_image"), tmp_path / "ours"
    )


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    hf = _hf_checkpoint(tmp_path / "hf", tie=True)
    batch = _batch("two_images_and_text_only")
    assert_tied_round_trip(hf, Qwen2_5_VLForConditionalGeneration, tmp_path / "hf", batch, tmp_path / "ours")


def test_wrong_number_of_image_tokens_is_named(pair) -> None:
    _, model = pair
    batch = _batch("two_images_and_text_only")
    first = int((batch["input_ids"][0] == IMAGE).nonzero()[0])
    batch["input_ids"][0, first] = 7  # one <|image_pad|> fewer than the two images give
    with pytest.raises(ValueError, match=r"must hold 12 <\|image_pad\|> tokens .* but 11 were found"):
        model(**batch)
    del batch["pixel_values"]
    with pytest.raises(ValueError, match=r"hold 11 <\|image_pad\|> tokens but no image pixels"):
        model(**batch)


def test_config_reads_both_layouts_and_round_trips() -> None:
    hf = _hf_config().to_dict()
    config = VLMConfig.from_hf(hf)
    assert config.vision.num_layers == 2 and config.llm.hidden_size == 64 and config.tokens_per_second == 2
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id) == (
        IMAGE,
        VIDEO,
        START,
    )
    flat = {
        **{k: v for k, v in hf.items() if k != "text_config"},
        **hf["text_config"],
        "model_type": "qwen2_5_vl",
    }
    assert VLMConfig.from_hf(flat) == config
    assert VLMConfig.from_hf(config.to_hf()) == config
    back = Qwen2_5_VLConfig(**config.to_hf())
    assert back.text_config.hidden_size == 64 and back.vision_config.fullatt_block_indexes == [1]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda c: c["vision_config"].update(out_hidden_size=48),
            r"vision.out_hidden_size \(48\) must equal",
        ),
        (lambda c: c.update(image_token_id=VOCAB), r"image_token_id \(256\) must be a token id"),
        (lambda c: c.update(video_token_id=IMAGE), "the special token ids must differ"),
        (lambda c: c.update(model_type="llava"), r"model_type \('llava'\) must be 'qwen2_5_vl'"),
    ],
)
def test_config_errors_name_the_field(change, match: str) -> None:
    hf = _hf_config().to_dict()
    change(hf)
    with pytest.raises(ValueError, match=match):
        VLMConfig.from_hf(hf)


def test_config_needs_multimodal_rope_and_a_known_encoder() -> None:
    config = VLMConfig.from_hf(_hf_config().to_dict())
    llm = dataclasses.asdict(config.llm) | {"rope_scaling": None, "architecture": "qwen2"}
    with pytest.raises(ValueError, match="llm.rope_scaling has no mrope_section"):
        VLMConfig(vision=config.vision, llm=llm)
    with pytest.raises(ValueError, match=r"vision.type \('dinov2'\) is not supported"):
        VLMConfig(vision={"type": "dinov2"}, llm=config.llm)


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = right_padded([row[::-1] for row in rows])
    return ids.flip(1), mask.flip(1)


def test_left_padded_rows_match_transformers(pair) -> None:
    """Left padding (what batched generation pads): positions count from each row's first real token."""
    ids, mask = _left_padded(
        [
            text(3, 0) + placeholders(IMAGE, IMG_A) + text(2, 2),
            text(9, 3),
            text(1, 4) + placeholders(IMAGE, IMG_C),
        ]
    )
    batch = dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pixels([IMG_A, IMG_C], 0, PATCH),
        image_grid_thw=torch.tensor([IMG_A, IMG_C]),
    )
    assert not mask[:, 0].all() and mask[:, -1].all()  # rows of different lengths, padded on the left
    assert_matches_transformers(*pair, batch)

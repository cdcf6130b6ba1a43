"""LLaVA-OneVision (SigLIP tower, MLP projector, ``image_newline``, any-resolution tiling) against transformers'
``LlavaOnevisionForConditionalGeneration`` on a tiny random checkpoint (fp32) with a Qwen2 language model: a batch
of two images of different sizes, a text-only row and one image, right-padded; logits within 1e-4 (max abs), the loss
within 1e-5 (relative), every gradient within 1e-4 (relative L2). The image sizes cover wide and tall unpadding and
tile features shrunk to ``vision_aspect_ratio``'s max tiles. Our export loads in transformers with the same logits
and reads back tensor for tensor; the token count matches transformers' processor."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from llava_parity import (
    LOGITS_TOL,
    assert_matches_transformers,
    assert_trains,
    max_logits_diff,
    randomize,
    text,
)
from qwen_vl_parity import right_padded
from safetensors.torch import save_file
from tiny import TINY_QWEN3_TEXT, TINY_SIGLIP_VISION
from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
from transformers import SiglipVisionConfig as HFSiglipVisionConfig
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

from forge_lightning.modules.llm import LLMConfig
from forge_lightning.modules.vlm import VisionLanguageModel, VLMConfig, from_pretrained, save_pretrained
from forge_lightning.modules.vlm.anyres import (
    AnyResVisionConfig,
    best_resolution,
    num_image_tokens,
    num_tiles,
    num_video_tokens,
)

VOCAB = 512
IMAGE, VIDEO = 500, 501
SIZE = TINY_SIGLIP_VISION["image_size"]  # 16: tiles of 4 x 4 features
PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32], [16, 48], [48, 16], [48, 48]]
ASPECT = "anyres_max_2"  # grids over 2 tiles' worth of features are shrunk
TEXT = {**TINY_QWEN3_TEXT, "model_type": "qwen2", "vocab_size": VOCAB}
# Wide (rows cropped, 2 tiles), tall and large (3 x 3 tiles, columns cropped, shrunk), square (1 tile, not cropped).
ROWS = [[(8, 30), (50, 30)], [], [(16, 16)]]


def _hf_config(**overrides) -> LlavaOnevisionConfig:
    fields = dict(
        vision_config=HFSiglipVisionConfig(**TINY_SIGLIP_VISION, vision_use_head=False),
        text_config=TEXT,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio=ASPECT,
    )
    return LlavaOnevisionConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[LlavaOnevisionForConditionalGeneration, object]:
    """transformers' LLaVA-OneVision with random weights, saved by transformers and read by ``from_pretrained``."""
    path = tmp_path_factory.mktemp("onevision")
    hf = randomize(LlavaOnevisionForConditionalGeneration(_hf_config()))
    hf.save_pretrained(path)
    return hf, from_pretrained(path)


def _batch(vision: AnyResVisionConfig, *, padded_pixels: bool = False) -> dict[str, torch.Tensor]:
    rows, sizes = [], []
    for b, images in enumerate(ROWS):
        row = text(3, b)
        for i, size in enumerate(images):
            row += [IMAGE] * num_image_tokens(vision, size) + text(2, 10 * b + i)
        rows.append(row)
        sizes += images
    ids, mask = right_padded(rows)
    tiles = [num_tiles(vision, s) for s in sizes]
    pixels = torch.randn(sum(tiles), 3, SIZE, SIZE, generator=torch.Generator().manual_seed(7))
    if padded_pixels:  # as the processor pads them: [num_images, max_tiles, 3, S, S]
        padded = torch.zeros(len(tiles), max(tiles), 3, SIZE, SIZE)
        for i, image in enumerate(pixels.split(tiles)):
            padded[i, : len(image)] = image
        pixels = padded
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_sizes=torch.tensor(sizes))


def test_the_batch_covers_cropping_and_shrinking(pair) -> None:
    vision = pair[1].config.vision
    sizes = [s for row in ROWS for s in row]
    assert [best_resolution(s, PINPOINTS) for s in sizes] == [(16, 32), (48, 48), (16, 16)]
    # Base tile 4 x 4, then: 4 x 8 tile features cropped to rows 1..2; 12 x 12 cropped to columns 2..9 and shrunk
    # by sqrt(12 * 8 / (2 * 16)) to 6 x 4; 4 x 4 kept. Each row ends in a newline.
    assert [num_image_tokens(vision, s) for s in sizes] == [16 + 2 * 9, 16 + 6 * 5, 16 + 4 * 5]


@pytest.mark.parametrize(
    "size", [(8, 30), (50, 30), (16, 16), (7, 90), (90, 7), (33, 34), (48, 17), (20, 40)]
)
def test_token_count_matches_the_processor(pair, size: tuple[int, int]) -> None:
    """transformers' processor formula (``_get_number_of_features``) without building a tokenizer."""
    vision = pair[1].config.vision
    processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    processor.image_processor = type("P", (), {"image_grid_pinpoints": PINPOINTS})()
    processor.num_image_tokens = vision.grid_side**2
    processor.vision_aspect_ratio = ASPECT
    assert num_image_tokens(vision, size) == processor._get_number_of_features(*size, SIZE, SIZE)


@pytest.mark.parametrize("padded_pixels", [False, True])
def test_logits_loss_and_gradients_match_transformers(pair, padded_pixels: bool) -> None:
    hf, model = pair
    batch = _batch(model.config.vision, padded_pixels=padded_pixels)
    unused = assert_matches_transformers(model, hf, batch, (IMAGE,))
    assert unused == 2  # post_layernorm: OneVision takes the last layer's states before it


def test_saved_checkpoint_loads_in_transformers(pair, tmp_path: Path) -> None:
    hf, model = pair
    out = save_pretrained(model, model.config, tmp_path / "ours", max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    prefixes = {".".join(k.split(".")[:2]) for k in index["weight_map"]}
    assert prefixes == {
        "image_newline",
        "vision_tower.vision_model",
        "multi_modal_projector.linear_1",
        "multi_modal_projector.linear_2",
        "language_model.model",
        "language_model.lm_head",
    }
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llava_onevision" and config["vision_aspect_ratio"] == ASPECT
    assert config["image_grid_pinpoints"] == PINPOINTS and config["video_token_index"] == VIDEO
    again_hf = LlavaOnevisionForConditionalGeneration.from_pretrained(out).eval()
    assert max_logits_diff(model, again_hf, _batch(model.config.vision)) <= LOGITS_TOL
    again = from_pretrained(out)
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    read = VLMConfig.from_hf(config)
    assert (read.vision, read.projector, read.video_token_id) == (
        model.config.vision,
        model.config.projector,
        VIDEO,
    )


def test_reads_transformers_in_memory_names(pair, tmp_path: Path) -> None:
    hf, _ = pair
    hf.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    model = from_pretrained(tmp_path)
    assert max_logits_diff(model, hf, _batch(model.config.vision)) <= LOGITS_TOL


def test_config_defaults_are_transformers() -> None:
    """A config.json with only the sub-configs and token ids reads with transformers' defaults (all 36 pinpoints)."""
    hf = LlavaOnevisionConfig(
        vision_config=HFSiglipVisionConfig(**TINY_SIGLIP_VISION),
        text_config=TEXT,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
    ).to_dict()
    del hf["image_grid_pinpoints"], hf["vision_aspect_ratio"]
    config = VLMConfig.from_hf(hf)
    assert (config.vision_type, config.projector_type) == ("siglip_anyres", "mlp_newline")
    assert config.vision.vision_aspect_ratio == "anyres_max_9" and config.vision.max_tiles == 9
    assert len(config.vision.image_grid_pinpoints) == 36 and config.vision.image_grid_pinpoints[-1] == [
        96,
        96,
    ]
    assert not config.llm.tie_word_embeddings and config.llm.architecture == "qwen2"


def _tiny(**vision) -> VLMConfig:
    fields = {
        **dataclasses.asdict(AnyResVisionConfig.from_preset("debug")),
        "image_grid_pinpoints": PINPOINTS,
    }
    return VLMConfig(
        vision={"type": "siglip_anyres", **fields, **vision},
        llm=LLMConfig.from_hf(TEXT),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
    )


@pytest.mark.parametrize(
    ("vision", "match"),
    [
        (
            {"image_grid_pinpoints": [[16, 24]]},
            r"image_grid_pinpoints must be \[height, width\] pairs of positive "
            r"multiples of vision.image_size \(16\); these are not: \[\[16, 24\]\]",
        ),
        ({"vision_aspect_ratio": "anyres"}, r"vision_aspect_ratio \('anyres'\) must be 'anyres_max_N'"),
        (
            {"feature_select_strategy": "default"},
            r"feature_select_strategy \('default'\) must be 'full' for "
            "siglip_anyres",
        ),
        ({"patch_size": 17}, r"vision.patch_size \(17\) must not exceed vision.image_size \(16\)"),
    ],
)
def test_vision_config_errors_name_the_field(vision: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _tiny(**vision)


def test_family_config_errors() -> None:
    with pytest.raises(
        ValueError,
        match=r"projector \('mlp'\) cannot feed vision.type 'siglip_anyres' "
        r"\(LLaVA-OneVision\): it needs projector 'mlp_newline'",
    ):
        dataclasses.replace(_tiny(), projector="mlp")
    with pytest.raises(
        ValueError, match=r"video_token_id \(151647\) must be a token id in \[0, llm.vocab_size=512\)"
    ):
        dataclasses.replace(_tiny(), video_token_id=None)


def test_bad_inputs_are_named(pair) -> None:
    _, model = pair
    batch = _batch(model.config.vision)
    with pytest.raises(ValueError, match=r"needs image_sizes \(\[num_images, 2\]"):
        model(**{**batch, "image_sizes": None})
    with pytest.raises(
        ValueError, match=r"pixel_values hold 12 tiles, but image_sizes give 15 \(\[3, 10, 2\]"
    ):
        model(**{**batch, "pixel_values": batch["pixel_values"][:12]})
    ids = batch["input_ids"].clone()
    ids[0, 3] = 7
    count = int((batch["input_ids"] == IMAGE).sum())
    with pytest.raises(
        ValueError, match=rf"image_sizes give {count} image features .*but {count - 1} were found"
    ):
        model(**{**batch, "input_ids": ids})
    with pytest.raises(
        ValueError,
        match=r"pixel_values_videos give 9 video features \(1 video\(s\) of 2 frames: 9 each, .*but 0 were found",
    ):
        model(**batch, pixel_values_videos=torch.zeros(1, 2, 3, SIZE, SIZE))
    with pytest.raises(ValueError, match=r"pixel_values_videos must be \[num_videos, num_frames, 3"):
        model(**batch, pixel_values_videos=torch.zeros(2, 3, SIZE, SIZE))
    with pytest.raises(
        ValueError, match=r"batch_num_images \(\[2, 2\]: images per sample\) must be non-negative and add up"
    ):
        model(**batch, batch_num_images=torch.tensor([2, 2]))


# A multi-image row (each image its base tile alone), a row of two 3-frame videos, a tiled image, text only.
MIXED_IMAGES = [[(8, 30), (50, 30)], [], [(20, 40)], []]
MIXED_VIDEOS = [0, 2, 0, 0]
FRAMES = 3


def _mixed_batch(vision: AnyResVisionConfig, *, padded_pixels: bool = False) -> dict[str, torch.Tensor]:
    """The batch as transformers' processor lays it out: ``batch_num_images`` counts the rows with images."""
    rows, sizes, tiles, counts = [], [], [], []
    for b, (images, videos) in enumerate(zip(MIXED_IMAGES, MIXED_VIDEOS)):
        tiled = len(images) == 1
        row = text(3, b)
        for i, size in enumerate(images):
            row += [IMAGE] * num_image_tokens(vision, size, tiled) + text(2, 10 * b + i)
            tiles.append(num_tiles(vision, size, tiled))
        for i in range(videos):
            row += [VIDEO] * num_video_tokens(vision, FRAMES) + text(2, 20 * b + i)
        rows.append(row)
        sizes += images
        counts += [len(images)] if images else []
    ids, mask = right_padded(rows)
    generator, S = torch.Generator().manual_seed(11), vision.image_size
    pixels = torch.randn(sum(tiles), 3, S, S, generator=generator)
    if padded_pixels:
        padded = torch.zeros(len(tiles), max(tiles), 3, S, S)
        for i, image in enumerate(pixels.split(tiles)):
            padded[i, : len(image)] = image
        pixels = padded
    videos = torch.randn(sum(MIXED_VIDEOS), FRAMES, 3, S, S, generator=generator)
    return dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pixels,
        image_sizes=torch.tensor(sizes),
        batch_num_images=torch.tensor(counts),
        pixel_values_videos=videos,
    )


def test_mixed_batch_token_counts(pair) -> None:
    """Base tile + one newline in the multi-image row; 3 frames of 2 x 2 pooled features + one newline per video;
    the tiled image as before (counts equal transformers' processor rule for each)."""
    vision = pair[1].config.vision
    assert vision.grid_side == 4
    assert [num_image_tokens(vision, s, False) for s in MIXED_IMAGES[0]] == [17, 17]
    assert num_video_tokens(vision, FRAMES) == 3 * 4 + 1
    processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    processor.num_image_tokens = vision.grid_side**2
    processor.vision_feature_select_strategy = "full"
    processor.video_token = "<video>"
    video = processor.replace_video_token({"pixel_values_videos": torch.zeros(1, FRAMES, 3, SIZE, SIZE)}, 0)
    assert video == "<video>" * num_video_tokens(vision, FRAMES)
    processor.image_token = "<image>"
    inputs = {"batch_num_images": [2, 1], "image_sizes": [[8, 30], [50, 30], [20, 40]]}
    inputs["pixel_values"] = torch.zeros(3, 1, 3, SIZE, SIZE)
    processor.image_processor = type("P", (), {"image_grid_pinpoints": PINPOINTS})()
    processor.vision_aspect_ratio = ASPECT
    counts = [processor.replace_image_token(inputs, i).count("<image>") for i in range(3)]
    assert counts == [17, 17, num_image_tokens(vision, (20, 40))]


@pytest.mark.parametrize("padded_pixels", [False, True])
def test_mixed_batch_matches_transformers(pair, padded_pixels: bool) -> None:
    """Multi-image row, video row, single-image row and text-only row in one batch: logits, loss, gradients."""
    hf, model = pair
    batch = _mixed_batch(model.config.vision, padded_pixels=padded_pixels)
    assert_matches_transformers(model, hf, batch, (IMAGE, VIDEO))


def test_odd_feature_grid_matches_transformers(tmp_path: Path) -> None:
    """Tiles of 22 pixels with patches of 4 (5 features a side, the last 2 pixels unread, as SigLIP's 384 / 14):
    video frames pool 5 x 5 to 3 x 3."""
    S = 22
    vision = {**TINY_SIGLIP_VISION, "image_size": S}
    pinpoints = [[S, S], [S, 2 * S], [2 * S, S], [2 * S, 2 * S], [3 * S, 3 * S]]
    config = _hf_config(
        vision_config=HFSiglipVisionConfig(**vision, vision_use_head=False), image_grid_pinpoints=pinpoints
    )
    hf = randomize(LlavaOnevisionForConditionalGeneration(config))
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert model.config.vision.grid_side == 5 and num_video_tokens(model.config.vision, FRAMES) == 3 * 9 + 1
    assert_matches_transformers(model, hf, _mixed_batch(model.config.vision), (IMAGE, VIDEO))


def test_mixed_batch_zero_counts_and_errors(pair) -> None:
    """``batch_num_images`` with the text rows as zeros reads the same; a video-token count that differs is
    named."""
    hf, model = pair
    batch = _mixed_batch(model.config.vision)
    zeros = {**batch, "batch_num_images": torch.tensor([2, 0, 1, 0])}
    with torch.no_grad():
        torch.testing.assert_close(model(**zeros), model(**batch), atol=0, rtol=0)
    assert max_logits_diff(model, hf, zeros) <= LOGITS_TOL
    ids = batch["input_ids"].clone()
    ids[1, 3] = 7
    with pytest.raises(ValueError, match=r"pixel_values_videos give 26 video features .*but 25 were found"):
        model(**{**batch, "input_ids": ids})


def test_fresh_model_trains(pair) -> None:
    """A model built from the config (fresh weights, ``image_newline`` included) learns the batch."""
    torch.manual_seed(0)
    model = VisionLanguageModel(pair[1].config)
    assert model.projector.image_newline.std().item() == pytest.approx(64**-0.5, rel=0.5)
    batch = _batch(model.config.vision)
    assert_trains(model, batch, (IMAGE,))
    assert model.projector.image_newline.grad is not None

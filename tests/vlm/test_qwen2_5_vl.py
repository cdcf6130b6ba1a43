"""The composed Qwen2.5-VL model against transformers' ``Qwen2_5_VLForConditionalGeneration`` on a tiny random
checkpoint (fp32): logits within 1e-4 (max abs), the loss within 1e-5 (relative), every parameter's gradient within
1e-4 (relative L2); checkpoints written by us load in transformers with the same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from llm_parity import randomize_weights
from qwen2_5_vl_case import IMAGE, IMG_A, IMG_B, IMG_C, START, VID, VIDEO, VOCAB
from qwen2_5_vl_case import hf_config as _hf_config
from qwen2_5_vl_case import patches as _pixels
from qwen2_5_vl_case import text_ids as _text
from qwen2_5_vl_case import vision_ids as _vision
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from forge_lightning.modules.vlm import VisionLanguageModel, VLMConfig, from_pretrained, save_pretrained

LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4


def _hf_checkpoint(path: Path, tie: bool = False) -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(_hf_config(tie)).float().eval()
    randomize_weights(hf, weight_std=0.1)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Qwen2_5_VLForConditionalGeneration, VisionLanguageModel]:
    path = tmp_path_factory.mktemp("hf")
    hf = _hf_checkpoint(path)
    return hf, from_pretrained(path)


def _right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    seq = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), seq, dtype=torch.long), torch.zeros(len(rows), seq, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = torch.tensor(row), 1
    return ids, mask


def _batch(case: str) -> dict[str, torch.Tensor]:
    if case == "two_images_and_text_only":
        rows = [
            _text(3, 0) + _vision(IMAGE, IMG_A) + _text(4, 1) + _vision(IMAGE, IMG_B) + _text(2, 2),
            _text(9, 3),
        ]
        ids, mask = _right_padded(rows)
        return dict(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=_pixels([IMG_A, IMG_B], 0),
            image_grid_thw=torch.tensor([IMG_A, IMG_B]),
        )
    ids, mask = _right_padded(
        [_text(2, 4) + _vision(VIDEO, VID) + _text(3, 5) + _vision(IMAGE, IMG_C) + _text(2, 6)]
    )
    return dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=_pixels([IMG_C], 1),
        image_grid_thw=torch.tensor([IMG_C]),
        pixel_values_videos=_pixels([VID], 2),
        video_grid_thw=torch.tensor([VID]),
        second_per_grid_ts=torch.tensor([1.5]),
    )


def _hf_logits(hf: Qwen2_5_VLForConditionalGeneration, batch: dict, **kwargs) -> tuple[torch.Tensor, object]:
    ids = batch["input_ids"]
    token_types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()  # the processor's mm_token_type_ids
    out = hf(**batch, mm_token_type_ids=token_types, **kwargs)
    return out.logits, out


def _labels(batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    ignore = (batch["attention_mask"] == 0) | (ids == IMAGE) | (ids == VIDEO)
    return ids.masked_fill(ignore, -100)


def _hf_name(name: str) -> str:
    if name.startswith("vision."):
        return "model.visual." + name.removeprefix("vision.")
    if name.startswith("llm.model."):
        return "model.language_model." + name.removeprefix("llm.model.")
    return name.removeprefix("llm.")


@pytest.mark.parametrize("case", ["two_images_and_text_only", "video_and_image"])
def test_logits_loss_and_gradients_match_transformers(pair, case: str) -> None:
    hf, model = pair
    hf.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    batch, labels = _batch(case), _labels(_batch(case))
    keep = batch["attention_mask"].bool()

    logits = model(**batch)
    hf_logits, out = _hf_logits(hf, batch, labels=labels)
    logits_err = (logits - hf_logits)[keep].abs().max().item()
    assert logits_err <= LOGITS_TOL, logits_err

    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert abs(loss.item() - out.loss.item()) <= LOSS_TOL * out.loss.item()

    loss.backward()
    out.loss.backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    names = {_hf_name(name) for name, _ in model.named_parameters()}
    assert names == hf_grads.keys()
    for name, p in model.named_parameters():
        want = hf_grads[_hf_name(name)]
        rel = ((p.grad - want).norm() / want.norm()).item()
        assert rel <= GRAD_TOL, f"{name}: relative gradient error {rel:.2e}"


def test_saved_checkpoint_loads_in_transformers(pair, tmp_path: Path) -> None:
    _, model = pair
    out = save_pretrained(model, model.config, tmp_path / "ours", max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in index["weight_map"]} == {
        "model.visual",
        "model.language_model",
        "lm_head.weight",
    }
    assert (out / "generation_config.json").is_file()
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    batch = _batch("video_and_image")
    with torch.no_grad():
        assert (model(**batch) - _hf_logits(hf, batch)[0]).abs().max().item() <= LOGITS_TOL
    again = from_pretrained(out)
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    hf = _hf_checkpoint(tmp_path / "hf", tie=True)
    model = from_pretrained(tmp_path / "hf")
    assert model.config.llm.tie_word_embeddings
    assert model.llm.lm_head.weight is model.llm.model.embed_tokens.weight
    batch = _batch("two_images_and_text_only")
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        assert (model(**batch) - _hf_logits(hf, batch)[0])[keep].abs().max().item() <= LOGITS_TOL
        out = save_pretrained(model, model.config, tmp_path / "ours")
        back = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
        assert (model(**batch) - _hf_logits(back, batch)[0])[keep].abs().max().item() <= LOGITS_TOL


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
    with pytest.raises(ValueError, match=r"vision.type \('clip'\) is not supported"):
        VLMConfig(vision={"type": "clip"}, llm=config.llm)

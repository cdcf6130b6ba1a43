"""Packed rows through ``VisionLanguageModel``: several samples per row (``document_ids``), their images and videos
concatenated in order, give every token the logits, loss and (summed) gradients it has in a padded batch of the
same samples, fp32 within 1e-5: Qwen2.5-VL (multimodal RoPE restarting per document; several images, a video, a
text-only sample; against transformers' unpacked model too) and LLaVA (1-D positions)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from llm_parity import randomize_weights
from qwen2_5_vl_case import IMAGE, IMG_A, IMG_B, IMG_C, VID, VIDEO, hf_config, patches, text_ids, vision_ids
from tiny import TINY_LLM
from transformers import Qwen2_5_VLForConditionalGeneration

from forge_lightning.modules.llm import LLMConfig
from forge_lightning.modules.vlm import (
    SiglipVisionConfig,
    VisionLanguageModel,
    VisionLanguageModule,
    VLMConfig,
    from_pretrained,
)
from forge_lightning.modules.vlm.positions import get_packed_rope_index, get_rope_index

TOL = 1e-5


@dataclasses.dataclass
class Sample:
    ids: list[int]
    media: dict[str, torch.Tensor]  # this sample's pixel inputs (concatenated over samples in order)


def _padded(samples: list[Sample]) -> dict[str, torch.Tensor]:
    seq = max(len(s.ids) for s in samples)
    ids, mask = (
        torch.zeros(len(samples), seq, dtype=torch.long),
        torch.zeros(len(samples), seq, dtype=torch.long),
    )
    for b, s in enumerate(samples):
        ids[b, : len(s.ids)], mask[b, : len(s.ids)] = torch.tensor(s.ids), 1
    return {"input_ids": ids, "attention_mask": mask, **_media(samples)}


def _packed(rows: list[list[Sample]], seq: int) -> dict[str, torch.Tensor]:
    """Rows of ``seq`` tokens: the samples of each, then padding (a document of its own, token 0)."""
    ids, docs = torch.zeros(len(rows), seq, dtype=torch.long), torch.zeros(len(rows), seq, dtype=torch.long)
    for b, row in enumerate(rows):
        cursor = 0
        for d, s in enumerate(row):
            ids[b, cursor : cursor + len(s.ids)], docs[b, cursor : cursor + len(s.ids)] = (
                torch.tensor(s.ids),
                d,
            )
            cursor += len(s.ids)
        docs[b, cursor:] = len(row)
    return {"input_ids": ids, "document_ids": docs, **_media([s for row in rows for s in row])}


def _media(samples: list[Sample]) -> dict[str, torch.Tensor]:
    keys = dict.fromkeys(k for s in samples for k in s.media)
    return {k: torch.cat([s.media[k] for s in samples if k in s.media]) for k in keys}


def _token_losses(logits_BSV: torch.Tensor, ids_BS: torch.Tensor, last_BS: torch.Tensor) -> torch.Tensor:
    """Next-token loss of every position; 0 at each sample's last token (its next token is another's)."""
    labels_BS = torch.roll(ids_BS, -1, dims=1).masked_fill(last_BS, -100)
    losses = F.cross_entropy(
        logits_BSV.flatten(0, 1), labels_BS.flatten(), ignore_index=-100, reduction="none"
    )
    return losses.view(ids_BS.shape)


def _per_sample(model, batch: dict, spans: list[tuple[int, int, int]]) -> tuple[list, list, dict]:
    """Logits and token losses of each sample (``spans``: row, start, length), and the gradients of their sum."""
    model.zero_grad()
    logits_BSV = model(**batch)
    last_BS = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    for row, start, n in spans:
        last_BS[row, start + n - 1] = True
    losses_BS = _token_losses(logits_BSV, batch["input_ids"], last_BS)
    logits = [logits_BSV[row, start : start + n].detach() for row, start, n in spans]
    losses = [losses_BS[row, start : start + n].detach() for row, start, n in spans]
    sum(losses_BS[row, start : start + n].sum() for row, start, n in spans).backward()
    return logits, losses, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _check_packed_equals_padded(model, rows: list[list[Sample]], seq: int) -> None:
    samples = [s for row in rows for s in row]
    padded_spans = [(b, 0, len(s.ids)) for b, s in enumerate(samples)]
    packed_spans = []
    for b, row in enumerate(rows):
        cursor = 0
        for s in row:
            packed_spans.append((b, cursor, len(s.ids)))
            cursor += len(s.ids)
    ref_logits, ref_losses, ref_grads = _per_sample(model, _padded(samples), padded_spans)
    logits, losses, grads = _per_sample(model, _packed(rows, seq), packed_spans)
    for k, (ours, theirs) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0, msg=f"sample {k} logits")
    for k, (ours, theirs) in enumerate(zip(losses, ref_losses)):
        torch.testing.assert_close(ours, theirs, atol=TOL, rtol=TOL, msg=f"sample {k} token losses")
    assert grads.keys() == ref_grads.keys()
    assert any(k.startswith("vision.") for k in grads) and any(k.startswith("llm.") for k in grads)
    for name, grad in grads.items():
        error = (grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12)
        assert error < TOL, (name, float(error))


# ----- Qwen2.5-VL ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> tuple[Qwen2_5_VLForConditionalGeneration, VisionLanguageModel]:
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(hf_config()).float().eval()
    randomize_weights(hf, weight_std=0.1)
    path = tmp_path_factory.mktemp("qwen")
    hf.save_pretrained(path)
    return hf, from_pretrained(path).eval()


def _qwen_samples() -> list[Sample]:
    def image(grids, seed):
        return {"pixel_values": patches(grids, seed), "image_grid_thw": torch.tensor(grids)}

    video = {
        "pixel_values_videos": patches([VID], 9),
        "video_grid_thw": torch.tensor([VID]),
        "second_per_grid_ts": torch.tensor([1.5]),
    }
    two_images = (
        text_ids(3, 0) + vision_ids(IMAGE, IMG_A) + text_ids(4, 1) + vision_ids(IMAGE, IMG_B) + text_ids(2, 2)
    )
    with_video = (
        text_ids(2, 4) + vision_ids(VIDEO, VID) + text_ids(3, 5) + vision_ids(IMAGE, IMG_C) + text_ids(2, 6)
    )
    return [
        Sample(two_images, image([IMG_A, IMG_B], 0)),
        Sample(text_ids(9, 3), {}),
        Sample(text_ids(2, 7) + vision_ids(IMAGE, IMG_C) + text_ids(5, 8), image([IMG_C], 1)),
        Sample(with_video, {**image([IMG_C], 2), **video}),
    ]


def test_qwen2_5_vl_packed_rows_equal_the_padded_batch(qwen) -> None:
    _, model = qwen
    s = _qwen_samples()
    _check_packed_equals_padded(model, [[s[0], s[1]], [s[2], s[3]]], seq=64)  # padding ends each row


def test_qwen2_5_vl_packed_logits_equal_transformers_unpacked(qwen) -> None:
    hf, model = qwen
    samples = _qwen_samples()
    batch = _padded(samples)
    ids = batch["input_ids"]
    with torch.no_grad():
        theirs = hf(**batch, mm_token_type_ids=(ids == IMAGE).int() + 2 * (ids == VIDEO).int()).logits
        ours = model(**_packed([samples], seq=sum(len(s.ids) for s in samples) + 3))
    cursor = 0
    for b, s in enumerate(samples):
        n = len(s.ids)
        torch.testing.assert_close(ours[0, cursor : cursor + n], theirs[b, :n], atol=1e-4, rtol=0)
        cursor += n


def test_packed_mrope_positions_restart_per_document(qwen) -> None:
    _, model = qwen
    samples = _qwen_samples()
    packed = _packed([samples], seq=sum(len(s.ids) for s in samples) + 3)
    positions_3BS = model.tower.packed_positions(
        model.config,
        packed["input_ids"],
        packed["document_ids"],
        packed["image_grid_thw"],
        packed["video_grid_thw"],
        packed["second_per_grid_ts"],
    )
    cursor = 0
    for s in samples:
        n, media = len(s.ids), s.media
        alone, _ = get_rope_index(
            torch.tensor([s.ids]),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            spatial_merge_size=2,
            image_grid_thw=media.get("image_grid_thw"),
            video_grid_thw=media.get("video_grid_thw"),
            second_per_grid_ts=media.get("second_per_grid_ts"),
            tokens_per_second=2 if "video_grid_thw" in media else None,
        )
        assert torch.equal(positions_3BS[:, 0, cursor : cursor + n], alone[:, 0])
        cursor += n
    assert positions_3BS[:, 0, cursor:].tolist() == [[0, 1, 2]] * 3  # the padding document


def test_packed_input_errors_are_named(qwen) -> None:
    _, model = qwen
    samples = _qwen_samples()
    packed = _packed([samples[:2]], seq=80)
    with pytest.raises(ValueError, match="document_ids .* take no attention_mask"):
        model(**packed, attention_mask=torch.ones_like(packed["input_ids"]))
    with pytest.raises(ValueError, match=r"document_ids \[1, 79\] must have input_ids' shape \[1, 80\]"):
        get_packed_rope_index(packed["input_ids"], packed["document_ids"][:, 1:], image_token_id=IMAGE,
                              video_token_id=VIDEO, spatial_merge_size=2)  # fmt: skip
    del packed["image_grid_thw"]
    with pytest.raises(ValueError, match="image pixels need their image_grid_thw"):
        model(**packed)


def _shifted_labels(batch: dict, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """Each sample's next tokens as labels (the data modules' pre-shifted form), -100 elsewhere."""
    labels = torch.full_like(batch["input_ids"], -100)
    for row, start, n in spans:
        labels[row, start : start + n - 1] = batch["input_ids"][row, start + 1 : start + n]
    return labels


def test_module_loss_of_packed_rows_equals_the_padded_batch(qwen, tmp_path) -> None:
    """The module passes packed rows' document_ids and position_ids on: a row of several samples gives the loss
    sum of their padded batch (else the samples would attend to each other at 1-D positions)."""
    hf, _ = qwen
    hf.save_pretrained(tmp_path)
    module = VisionLanguageModule.from_pretrained(tmp_path).float()
    samples = _qwen_samples()
    padded = _padded(samples)
    padded["labels"] = _shifted_labels(padded, [(b, 0, len(s.ids)) for b, s in enumerate(samples)])
    packed = _packed([samples], seq=sum(len(s.ids) for s in samples) + 3)
    starts = [sum(len(s.ids) for s in samples[:k]) for k in range(len(samples))]
    packed["labels"] = _shifted_labels(packed, [(0, start, len(s.ids)) for start, s in zip(starts, samples)])
    packed["position_ids"] = module.model.tower.packed_positions(
        module.config,
        packed["input_ids"],
        packed["document_ids"],
        packed["image_grid_thw"],
        packed["video_grid_thw"],
        packed["second_per_grid_ts"],
    )
    with torch.no_grad():
        padded_sum, padded_tokens = module.loss_sum(padded)
        packed_sum, packed_tokens = module.loss_sum(packed)
        without_documents = module.loss_sum({k: v for k, v in packed.items() if k != "document_ids"})[0]
    assert packed_tokens == padded_tokens == sum(len(s.ids) - 1 for s in samples)
    torch.testing.assert_close(packed_sum, padded_sum, atol=TOL * padded_tokens, rtol=TOL)
    assert abs(float(without_documents - padded_sum)) > 1e-3  # the check can tell documents from one sequence
    # The throughput monitor's counts: the row's padding (3 tokens, a document of its own) is neither tokens nor a
    # sample, so the packed row counts what the padded batch does.
    packed_stats, padded_stats = module.batch_stats(packed), module.batch_stats(padded)
    assert packed_stats["samples"] == padded_stats["samples"] == len(samples)
    assert packed_stats["tokens"] == padded_stats["tokens"] == sum(len(s.ids) for s in samples)
    assert packed_stats["flops"] == pytest.approx(padded_stats["flops"])


# ----- LLaVA (SigLIP, 1-D positions) -------------------------------------------------------------------------------
def test_llava_packed_rows_equal_the_padded_batch() -> None:
    config = VLMConfig(
        vision={"type": "siglip", **dataclasses.asdict(SiglipVisionConfig.from_preset("debug"))},
        llm=LLMConfig.from_hf({**TINY_LLM, "vocab_size": 512}),
        image_token_id=500,
    )
    torch.manual_seed(0)
    model = VisionLanguageModel(config).float()
    randomize_weights(model, weight_std=0.1)
    per_image, size = config.vision.tokens_per_image, config.vision.image_size

    def images(n, seed):
        return {"pixel_values": torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))}

    image = [500] * per_image
    samples = [
        Sample(text_ids(3, 0) + image + text_ids(4, 1) + image + text_ids(2, 2), images(2, 0)),
        Sample(text_ids(7, 3), {}),
        Sample(text_ids(2, 4) + image + text_ids(5, 5), images(1, 1)),
    ]
    longest = max(len(s.ids) for s in samples)
    _check_packed_equals_padded(model, [[samples[0]], [samples[1], samples[2]]], seq=longest + 2)

"""A small real image + text data set and a tiny Qwen2.5-VL that fits its tokenizer, for the packing and load
balancing tests (also imported by their 2-process worker)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from qwen2_5_vl_case import VISION
from tiny import TINY_QWEN2_5_VL_TEXT, write_vlm_tokenizer
from transformers import Qwen2_5_VLConfig

from forge_lightning.datamodules.vlm import VLMDataModule
from forge_lightning.datamodules.vlm.packing import VLMPackedDataset
from forge_lightning.modules.vlm import VisionLanguageModel, VLMConfig

# patch 4, merge 2: 8 x 8 pixels per token; 4 .. 16 tokens (16 .. 64 patches) per image.
OPTIONS = dict(
    processor="qwen2_vl", patch_size=4, min_pixels=8 * 8 * 4, max_pixels=8 * 8 * 16, seq_length=160
)
SIZES = [(60, 45), (100, 30), (200, 150), (24, 24)]
MODEL_KEYS = (
    "input_ids",
    "attention_mask",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "document_ids",
    "position_ids",
)
WORDS = ("the red triangle", "two shapes", "a blue square", "yes", "what colour is it", "count them")


def write_data(root: Path, num_records: int = 12) -> tuple[Path, Path]:
    """``root/tokenizer`` and ``root/train.jsonl``: LLaVA records of 0 to 3 images and answers of varied length."""
    tokenizer = write_vlm_tokenizer(root / "tokenizer")
    rng = np.random.default_rng(0)
    for k, (width, height) in enumerate(SIZES):
        pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{k}.png")
    records = []
    for r in range(num_records):
        images = [f"{(r + j) % len(SIZES)}.png" for j in range(r % 4)]
        question = "<image>" * len(images) + " ".join(WORDS[(r + j) % len(WORDS)] for j in range(1 + r % 3))
        answer = " ".join(WORDS[(2 * r + j) % len(WORDS)] for j in range(1 + (r * 7) % 5))
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        records.append({"id": str(r), "image": images, "conversations": turns})
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    return tokenizer, train


def datamodule(tokenizer: Path, train: Path, **options) -> VLMDataModule:
    """A set-up ``VLMDataModule`` of the data (no workers)."""
    dm = VLMDataModule(
        str(train), str(tokenizer), num_workers=0, pin_memory=False, **{**OPTIONS, "batch_size": 1, **options}
    )
    dm.setup("fit")
    return dm


def hf_config(dm: VLMDataModule) -> Qwen2_5_VLConfig:
    """The config of a tiny Qwen2.5-VL whose vocabulary and image (video) token ids are ``dm``'s tokenizer's; a
    tokenizer without a video token gets one past its vocabulary."""
    vocab = dm.vocab_size + 1
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **TINY_QWEN2_5_VL_TEXT),
        vision_config=VISION,
        **{"video_token_id": vocab - 1, **dm.special_token_ids},
    )


def model(dm: VLMDataModule, seed: int = 0) -> VisionLanguageModel:
    """A tiny random Qwen2.5-VL of :func:`hf_config` (fp32)."""
    torch.manual_seed(seed)
    vlm = VisionLanguageModel(VLMConfig.from_hf(hf_config(dm).to_dict())).float()
    with torch.no_grad():
        for p in vlm.parameters():
            p.normal_(0, 0.1) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return vlm


def token_losses(vlm: VisionLanguageModel, batch: dict) -> torch.Tensor:
    """``[B, S]`` cross-entropy of every position against the batch's (shifted) labels, 0 where ignored."""
    logits_BSV = vlm(**{k: v for k, v in batch.items() if k in MODEL_KEYS})
    labels_BS = batch["labels"]
    losses = F.cross_entropy(
        logits_BSV.flatten(0, 1), labels_BS.flatten(), ignore_index=-100, reduction="none"
    )
    return losses.view(labels_BS.shape)


def per_sample_losses(vlm, dm) -> dict[int, torch.Tensor]:
    """Token losses of every sample, by its index in the scanned samples, from the datamodule's collated batch."""
    dataset = dm.train_dataset
    with torch.no_grad():
        losses_BS = token_losses(vlm, dm.collate_fn([dataset[i] for i in range(len(dataset))]))
    if not isinstance(dataset, VLMPackedDataset):
        return {i: losses_BS[i, :n] for i, n in enumerate(dataset.lengths)}
    out = {}
    for row, members in enumerate(dataset.bins):
        cursor = 0
        for i in members:
            n = dataset.dataset.samples[i].length
            out[i] = losses_BS[row, cursor : cursor + n]
            cursor += n
    return out

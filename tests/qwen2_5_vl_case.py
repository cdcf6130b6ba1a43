"""The tiny Qwen2.5-VL that CPU tests share: its configs and grids, with the Qwen-VL batch helpers under the names
the packing tests use."""

from __future__ import annotations

import torch
from qwen_vl_parity import END, IMAGE, START, VIDEO, VOCAB, Grid, pixels, placeholders, text
from tiny import TINY_QWEN2_5_VL_TEXT
from transformers import Qwen2_5_VLConfig

__all__ = ["END", "IMAGE", "START", "VIDEO", "VOCAB"]

PATCH = 4

TEXT = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **TINY_QWEN2_5_VL_TEXT)
VISION = dict(
    depth=2,
    fullatt_block_indexes=[1],
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=PATCH,
    window_size=4 * PATCH,  # two merged tokens per window side: the grids below span several windows
    tokens_per_second=2,
)
IMG_A, IMG_B, IMG_C, VID = (1, 4, 6), (1, 6, 4), (1, 4, 4), (2, 4, 4)


def hf_config(tie: bool = False) -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=tie,
    )


text_ids = text
vision_ids = placeholders


def patches(grids: list[Grid], seed: int) -> torch.Tensor:
    return pixels(grids, seed, PATCH)

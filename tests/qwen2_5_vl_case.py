"""The tiny Qwen2.5-VL that CPU tests share: token ids, configs, and placeholder runs / patches of given grids."""

from __future__ import annotations

import torch
from tiny import TINY_QWEN2_5_VL_TEXT
from transformers import Qwen2_5_VLConfig

VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 252, 253
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


def text_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 240, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def vision_ids(token: int, grid: tuple[int, int, int]) -> list[int]:
    """A placeholder run as the processor writes it: one pad token per merged patch."""
    return [START] + [token] * (grid[0] * grid[1] * grid[2] // 4) + [END]


def patches(grids: list[tuple[int, int, int]], seed: int) -> torch.Tensor:
    num_patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(num_patches, 3 * 2 * PATCH**2, generator=torch.Generator().manual_seed(seed))

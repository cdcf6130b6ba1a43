"""The tiny Wan case of the diffusion tests: a tiny random UMT5 (width 16, a word-level tokenizer) and
``AutoencoderKLWan`` (z_dim 4) saved in the Wan checkpoint layout, six 9-frame mp4 clips with captions, a
``forge-data precompute`` cache of them, and the debug DiT (4 latent channels) that goes with them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml
from diffusers import AutoencoderKLWan

from forge_lightning.datamodules.diffusion import run_precompute
from forge_lightning.modules.diffusion import WanDiffusionModule
from forge_lightning.modules.diffusion.word_encoder import write_word_text_encoder
from forge_lightning.sim.video import write_video

WORDS = ["<pad>", "<unk>", "</s>", "a", "red", "blue", "clip", "of", "the", "sea", "sky"]
CAPTIONS = ["a red clip", "a blue clip", "the sea", "the sky", "a clip of the sea", "a red sky"]
MAX_LENGTH = 8
DIT = {"preset": "debug", "in_channels": 4, "out_channels": 4}
FLOW = {"shift": 3.0, "text_dropout": 0.3}


def write_encoders(root: Path) -> None:
    """A Wan-style checkpoint root: ``tokenizer/``, ``text_encoder/`` (UMT5, width 16) and ``vae/`` (z_dim 4)."""
    torch.manual_seed(0)
    write_word_text_encoder(root, WORDS, width=16, num_layers=2, num_heads=4, seed=0)
    AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        latents_mean=[0.1, -0.2, 0.0, 0.3],
        latents_std=[1.5, 0.5, 1.0, 2.0],
    ).save_pretrained(root / "vae")


def build_case(
    root: Path,
    *,
    frames: int = 9,
    size: tuple[int, int] = (16, 24),
    bucket: tuple[int, int, int] = (5, 16, 16),
) -> dict:
    """Under ``root``: six clips of ``frames`` frames of ``size`` (height, width) at 16 fps with captions, the encoders
    (``wan/``), the data config (one ``bucket``: frames at 8 fps, height, width), a precompute YAML and its cache
    (``features/``). The default bucket gives latents of 2 x 2 x 2 (2 patch tokens of the debug DiT); 17 frames of
    64 x 64 in the bucket ``(9, 64, 64)`` give 3 x 8 x 8 (48)."""
    rng = np.random.default_rng(0)
    records = []
    for k, caption in enumerate(CAPTIONS):
        clip = [rng.integers(0, 255, (*size, 3), dtype=np.uint8) for _ in range(frames)]
        write_video(root / f"clip{k}.mp4", clip, fps=16, min_size=1)
        records.append(json.dumps({"video": f"clip{k}.mp4", "caption": caption}))
    (root / "captions.jsonl").write_text("\n".join(records) + "\n")
    wan = root / "wan"  # its own folder: the cache's fingerprint hashes every file under it
    write_encoders(wan)
    data = {
        "entries": [str(root / "captions.jsonl")],
        "buckets": [list(bucket)],
        "fps": 8,
        "spatial_stride": 8,
    }
    modules = [
        {
            "name": "vae",
            "target": "forge_lightning.modules.diffusion.WanVAE.from_pretrained",
            "init_args": {"path": str(wan)},
            "method": "encode",
            "inputs": {"video_BCFHW": "video"},
            "outputs": {"latents": ""},
        },
        {
            "name": "text_encoder",
            "target": "forge_lightning.modules.diffusion.WanTextEncoder.from_pretrained",
            "init_args": {"path": str(wan), "dtype": "float32", "max_length": MAX_LENGTH},
            "method": "encode",
            "inputs": {"prompts": "caption"},
            "outputs": {"text_embeddings": ""},
        },
    ]
    precompute = {"data": data, "modules": modules, "batch_size": 2, "samples_per_shard": 2}
    (root / "precompute.yaml").write_text(yaml.safe_dump(precompute))
    run_precompute(root / "precompute.yaml", root / "features", log=lambda _: None)
    return {"root": root, "wan": wan, "data": data}


def wan_module(wan: Path, **kwargs) -> WanDiffusionModule:
    """The debug DiT with the tiny encoders of ``wan`` (fp32), AdamW at a constant 1e-3; ``kwargs`` override."""
    options = dict(
        config=DIT,
        flow_matching=FLOW,
        vae=str(wan),
        text_encoder=str(wan),
        text_encoder_dtype="float32",
        text_max_length=MAX_LENGTH,
        optimizer={"name": "adamw", "lr": 1e-3},
        scheduler={"name": "constant"},
    )
    return WanDiffusionModule(**{**options, **kwargs})


def perturbed(module: WanDiffusionModule) -> WanDiffusionModule:
    """``module`` with every DiT parameter moved off its initialisation (zero-initialised heads too), in place."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in module.dit.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return module

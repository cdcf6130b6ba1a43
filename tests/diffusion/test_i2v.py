"""Wan 2.1 image-to-video on tiny random models saved in the Wan I2V checkpoint layout (``tokenizer/``,
``text_encoder/`` UMT5, ``vae/`` AutoencoderKLWan, ``image_encoder/`` CLIPVisionModel, ``image_processor/``), CPU,
fp32:

* the condition (first-frame mask + condition latents) equals ``WanImageToVideoPipeline.prepare_latents``'s, the
  image embeddings its ``encode_image``'s;
* ``WanDiffusionModule.generate(image=...)`` equals the pipeline's output latents for the same transformer weights
  and noise (2 steps, CFG; 512 text tokens, which diffusers' I2V attention assumes);
* I2V training steps from a ``forge-data precompute`` cache (the debug recipe) equal the same steps with the
  encoders online; the fixed-sigma validation loss reads the condition and the image embeddings;
* the refusals name the missing option.
"""

from __future__ import annotations

import copy
import html
import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import yaml
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanImageToVideoPipeline,
    WanTransformer3DModel,
)
from diffusers.pipelines.wan import pipeline_wan_i2v
from PIL import Image
from transformers import (
    AutoTokenizer,
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
    UMT5EncoderModel,
)
from wan_case import perturbed, write_encoders

from forge_lightning.cli import ForgeCLI
from forge_lightning.datamodules.diffusion import VideoCaptionConfig, VideoDiffusionDataModule, run_precompute
from forge_lightning.modules.diffusion import WanDiffusionModule, WanImageEncoder, WanVAE
from forge_lightning.sim.video import write_video

CAPTIONS = ["a red clip", "a blue clip", "the sea", "the sky"]
# 4 latent channels: in_channels 4 (noise) + 4 (first-frame mask) + 4 (condition); CLIP width 16, model width 24
I2V_DIT = {"preset": "debug", "in_channels": 12, "out_channels": 4, "image_dim": 16, "added_kv_proj_dim": 24}
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "diffusion" / "debug" / "i2v_cache.yaml"


def _write_checkpoint(root) -> None:
    write_encoders(root)
    clip = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    CLIPVisionModel(clip).save_pretrained(root / "image_encoder")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        root / "image_processor"
    )


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """The checkpoint, 4 clips of 9 frames with captions, a precompute YAML of the I2V fields and its cache."""
    root = tmp_path_factory.mktemp("wan_i2v")
    wan = root / "wan"
    _write_checkpoint(wan)
    rng = np.random.default_rng(0)
    records = []
    for k, caption in enumerate(CAPTIONS):
        frames = [rng.integers(0, 255, (16, 24, 3), dtype=np.uint8) for _ in range(9)]
        write_video(root / f"clip{k}.mp4", frames, fps=16, min_size=1)
        records.append(json.dumps({"video": f"clip{k}.mp4", "caption": caption}))
    (root / "captions.jsonl").write_text("\n".join(records) + "\n")
    data = {
        "entries": [str(root / "captions.jsonl")],
        "buckets": [[5, 16, 16]],
        "fps": 8,
        "spatial_stride": 8,
    }
    vae = {
        "target": "forge_lightning.modules.diffusion.WanVAE.from_pretrained",
        "init_args": {"path": str(wan)},
    }
    video = {"video_BCFHW": "video"}
    modules = [
        {"name": "vae", **vae, "method": "encode", "inputs": video, "outputs": {"latents": ""}},
        {
            "name": "text_encoder",
            "target": "forge_lightning.modules.diffusion.WanTextEncoder.from_pretrained",
            "init_args": {"path": str(wan), "dtype": "float32", "max_length": 8},
            "method": "encode",
            "inputs": {"prompts": "caption"},
            "outputs": {"text_embeddings": ""},
        },
        {
            "name": "condition",
            **vae,
            "method": "video_condition",
            "inputs": video,
            "outputs": {"condition_latents": ""},
        },
        {
            "name": "image_encoder",
            "target": "forge_lightning.modules.diffusion.WanImageEncoder.from_pretrained",
            "init_args": {"path": str(wan)},
            "method": "encode_first_frame",
            "inputs": video,
            "outputs": {"image_embeddings": ""},
        },
    ]
    precompute = {"data": data, "modules": modules, "batch_size": 2, "samples_per_shard": 2}
    (root / "precompute.yaml").write_text(yaml.safe_dump(precompute))
    run_precompute(root / "precompute.yaml", root / "features", log=lambda _: None)
    return {"root": root, "wan": wan, "data": data}


def _pipeline(wan, transformer: WanTransformer3DModel, shift: float) -> WanImageToVideoPipeline:
    return WanImageToVideoPipeline(
        tokenizer=AutoTokenizer.from_pretrained(wan / "tokenizer"),
        text_encoder=UMT5EncoderModel.from_pretrained(wan / "text_encoder"),
        image_encoder=CLIPVisionModel.from_pretrained(wan / "image_encoder"),
        image_processor=CLIPImageProcessor.from_pretrained(wan / "image_processor"),
        transformer=transformer,
        vae=AutoencoderKLWan.from_pretrained(wan / "vae"),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )


def _images(count: int, height: int, width: int) -> tuple[list[Image.Image], torch.Tensor]:
    """Random RGB images and the same as ``[B, 3, H, W]`` in ``[-1, 1]`` (as the pipeline's preprocessing)."""
    rgb = np.random.default_rng(1).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    tensor = torch.from_numpy(rgb).permute(0, 3, 1, 2).float() / 255 * 2 - 1
    return [Image.fromarray(x) for x in rgb], tensor


def test_condition_and_image_embeddings_match_pipeline(case):
    wan = case["wan"]
    pipe = _pipeline(
        wan, WanTransformer3DModel(**{k: v for k, v in _i2v_config().items() if k[0] != "_"}), 3.0
    )
    vae, encoder = WanVAE.from_pretrained(wan), WanImageEncoder.from_pretrained(wan)
    pil, image = _images(2, 16, 24)
    ours = vae.image_condition(image, 9)
    assert ours.shape == (2, 4 + 4, 3, 2, 3)
    for row in range(2):
        noise = torch.zeros(1, 4, 3, 2, 3)
        _, expected = pipe.prepare_latents(
            image[row : row + 1], 1, 4, 16, 24, 9, torch.float32, "cpu", None, noise
        )
        torch.testing.assert_close(ours[row : row + 1], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            encoder.encode(image[row : row + 1]), pipe.encode_image(pil[row]), rtol=0, atol=0
        )
    mask = ours[:, :4]
    assert mask[:, :, 0].eq(1).all() and mask[:, :, 1:].eq(0).all()


def _i2v_config() -> dict:
    return WanDiffusionModule(config=I2V_DIT).config.to_diffusers()


@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_generate_matches_pipeline(case, guidance, monkeypatch):
    wan = case["wan"]
    # the pipeline's prompt cleaning calls ftfy unguarded; without ftfy, its other steps (our clean_prompt's too)
    monkeypatch.setattr(
        pipeline_wan_i2v, "basic_clean", lambda text: html.unescape(html.unescape(text)).strip()
    )
    torch.manual_seed(0)
    module = perturbed(
        WanDiffusionModule(
            config=I2V_DIT,
            vae=str(wan),
            text_encoder=str(wan),
            image_encoder=str(wan),
            text_encoder_dtype="float32",
        )
    )
    transformer = WanTransformer3DModel(
        **{k: v for k, v in module.config.to_diffusers().items() if k[0] != "_"}
    )
    transformer.load_state_dict(module.dit.state_dict())
    pipe = _pipeline(wan, transformer, shift=3.0)
    pil, image = _images(1, 32, 32)
    prompt, frames, steps, seed = "a red sky", 9, 2, 4
    ours = module.generate(
        [prompt], num_frames=frames, height=32, width=32, steps=steps, guidance=guidance, shift=3.0, seed=seed,
        decode=False, image=image,
    )  # fmt: skip
    noise = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    expected = pipe(
        image=pil[0], prompt=prompt, negative_prompt="", height=32, width=32, num_frames=frames,
        num_inference_steps=steps, guidance_scale=guidance, latents=noise, output_type="latent",
    ).frames  # fmt: skip
    assert ours.shape == expected.shape == (1, 4, 3, 4, 4)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
    assert not torch.allclose(ours, noise, atol=1e-2)


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _fit(module: WanDiffusionModule, datamodule, steps: int) -> list[float]:
    recorder = _Losses()
    pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    ).fit(module, datamodule=datamodule)  # fmt: skip
    return recorder.losses


def test_i2v_training_from_the_cache_equals_training_online(case):
    """The debug recipe (``configs/diffusion/debug/i2v_cache.yaml``, built by the CLI and pointed at the case's
    cache, with text dropout) against the same module fed videos and captions encoded online."""
    wan, root = case["wan"], case["root"]
    flow = {"shift": 3.0, "text_dropout": 0.3}
    cli = ForgeCLI(
        args=[
            "--config", str(RECIPE),
            "--data.init_args.cache", str(root / "features"),
            "--data.init_args.cache_config", str(root / "precompute.yaml"),
            "--data.init_args.seed", "1",
            "--model.init_args.flow_matching", json.dumps(flow),
            "--model.init_args.text_encoder", str(wan),  # the empty prompt of text dropout only
            "--model.init_args.text_encoder_dtype", "float32",
            "--model.init_args.text_max_length", "8",
        ],
        run=False,
    )  # fmt: skip
    cached, cache = cli.model, cli.datamodule
    recipe = yaml.safe_load(RECIPE.read_text())
    assert cached.config == WanDiffusionModule(config=recipe["model"]["init_args"]["config"]).config
    online = WanDiffusionModule(
        config=I2V_DIT, flow_matching=flow, vae=str(wan), text_encoder=str(wan), image_encoder=str(wan),
        text_encoder_dtype="float32", text_max_length=8, optimizer={"name": "adamw", "lr": 1e-3},
        scheduler={"name": "constant"},
    )  # fmt: skip
    online.dit.load_state_dict(cached.dit.state_dict())
    initial = copy.deepcopy(online.dit.state_dict())
    options = dict(batch_size=2, num_workers=0, pin_memory=False, seed=1)
    losses_online = _fit(online, VideoDiffusionDataModule(VideoCaptionConfig(**case["data"]), **options), 2)
    losses_cached = _fit(cached, cache, 2)
    assert len(losses_online) == 2 and losses_online[0] != losses_online[1]
    np.testing.assert_allclose(losses_cached, losses_online, rtol=0, atol=1e-6)
    for (name, a), b in zip(online.dit.state_dict().items(), cached.dit.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    # the image branch and the condition channels of the patch embedding were trained
    for name in ("patch_embedding.weight", "blocks.0.attn2.add_k_proj.weight"):
        assert not torch.equal(online.dit.state_dict()[name], initial[name]), name


def test_fixed_sigma_losses_read_the_condition_and_the_image():
    module = perturbed(WanDiffusionModule(config=I2V_DIT))
    g = torch.Generator().manual_seed(5)
    batch = {
        "latents": torch.randn(2, 4, 3, 2, 2, generator=g),
        "text_embeddings": torch.randn(2, 5, 16, generator=g),
        "condition_latents": torch.randn(2, 8, 3, 2, 2, generator=g),
        "image_embeddings": torch.randn(2, 17, 16, generator=g),
    }
    losses = module.fixed_sigma_losses(batch)
    assert losses.shape == (len(module.validation_sigmas), 2)
    torch.testing.assert_close(module.fixed_sigma_losses(batch), losses, rtol=0, atol=0)
    for key in ("condition_latents", "image_embeddings"):
        other = module.fixed_sigma_losses({**batch, key: torch.zeros_like(batch[key])})
        assert not torch.allclose(other, losses), key


def test_i2v_refusals(case):
    wan = case["wan"]
    batch = {
        "latents": torch.randn(1, 4, 3, 2, 2),
        "text_embeddings": torch.randn(1, 5, 16),
        "condition_latents": torch.randn(1, 8, 3, 2, 2),
    }
    module = WanDiffusionModule(config=I2V_DIT)
    with pytest.raises(ValueError, match=r"needs image_embeddings \(cached with WanImageEncoder"):
        module.loss_sum(batch)
    with pytest.raises(ValueError, match="needs condition_latents"):
        module.loss_sum({k: v for k, v in batch.items() if k != "condition_latents"})
    online = WanDiffusionModule(config=I2V_DIT, vae=str(wan))
    with pytest.raises(ValueError, match="configure model.init_args.image_encoder"):
        online.loss_sum(
            {"video": torch.rand(1, 3, 9, 16, 16) * 2 - 1, "text_embeddings": torch.randn(1, 5, 16)}
        )
    with pytest.raises(ValueError, match="generates from a first frame: pass image"):
        online.generate(torch.randn(1, 5, 16), num_frames=5, height=16, width=16, steps=1, guidance=1.0)
    with pytest.raises(ValueError, match=r"image must be \[B or 1, 3, 16, 16\]"):
        online.generate(
            torch.randn(1, 5, 16), num_frames=5, height=16, width=16, steps=1, guidance=1.0,
            image=torch.zeros(1, 3, 8, 8),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"image_encoder \(x\) is set but the DiT has no image branch"):
        WanDiffusionModule(config={"preset": "debug", "in_channels": 4, "out_channels": 4}, image_encoder="x")
    with pytest.raises(ValueError, match="clean_first_frame is Wan 2.2 TI2V"):
        WanDiffusionModule(config=I2V_DIT, clean_first_frame=True)
    with pytest.raises(ValueError, match=r"in_channels \(10\) differ .* not 2 \* out_channels \+ 4 \(12\)"):
        WanDiffusionModule(config={**I2V_DIT, "in_channels": 10})
    with pytest.raises(ValueError, match="image is for a Wan 2.1 I2V DiT"):
        WanDiffusionModule(config={"preset": "debug", "in_channels": 4, "out_channels": 4}).generate(
            torch.randn(1, 5, 16), num_frames=5, height=16, width=16, steps=1, guidance=1.0,
            image=torch.zeros(1, 3, 16, 16),
        )  # fmt: skip
    with pytest.raises(ValueError, match="not 'clip_vision_model'"):
        WanImageEncoder.from_pretrained(wan / "text_encoder")

"""``WanDiffusionModule`` on a tiny debug DiT (4 latent channels) with a tiny random UMT5 and ``AutoencoderKLWan``
saved to disk in the Wan checkpoint layout, over mp4 clips written with PyAV (CPU, fp32):

* training from a feature cache (``forge-data precompute`` with the project's WanVAE / WanTextEncoder) equals
  training with the encoders online: the same per-step losses and weights after 3 steps;
* the module's loss equals a hand computation with diffusers' ``WanTransformer3DModel`` on the same weights,
  noise and noise levels (the loss of the diffusers / DiffSynth training scripts);
* ``Trainer.fit`` lowers the fixed-sigma validation loss;
* ``python -m forge_lightning fit`` on 2 gloo processes under FSDP2Strategy gives the losses of one process;
* the parallel plan checkpoints every block and leaves the gradients unchanged.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import yaml
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from procs import assert_clean_exit
from torch.utils.data import DataLoader

from forge_lightning.datamodules.diffusion import VideoDiffusionDataModule, run_precompute
from forge_lightning.modules.diffusion import WanDiffusionModule, sample_generator
from forge_lightning.modules.diffusion.word_encoder import write_word_text_encoder
from forge_lightning.performance.transforms import apply_activation_checkpointing
from forge_lightning.sim.video import write_video

REPO = Path(__file__).resolve().parents[2]
WORDS = ["<pad>", "<unk>", "</s>", "a", "red", "blue", "clip", "of", "the", "sea", "sky"]
CAPTIONS = ["a red clip", "a blue clip", "the sea", "the sky", "a clip of the sea", "a red sky"]
MAX_LENGTH = 8
DIT = {"preset": "debug", "in_channels": 4, "out_channels": 4}
FLOW = {"shift": 3.0, "text_dropout": 0.3}


def _write_encoders(root: Path) -> None:
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


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """Clips, captions, encoders, the data config, a precompute YAML and its cache."""
    root = tmp_path_factory.mktemp("wan_module")
    rng = np.random.default_rng(0)
    records = []
    for k, caption in enumerate(CAPTIONS):
        frames = [rng.integers(0, 255, (16, 24, 3), dtype=np.uint8) for _ in range(9)]
        write_video(root / f"clip{k}.mp4", frames, fps=16, min_size=1)
        records.append(json.dumps({"video": f"clip{k}.mp4", "caption": caption}))
    (root / "captions.jsonl").write_text("\n".join(records) + "\n")
    wan = root / "wan"  # its own folder: the cache's fingerprint hashes every file under it
    _write_encoders(wan)
    data = {
        "entries": [str(root / "captions.jsonl")],
        "buckets": [[5, 16, 16]],
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


def _module(wan: Path, **kwargs) -> WanDiffusionModule:
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


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _trainer(steps: int, callbacks=()) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


def _fit(module: WanDiffusionModule, datamodule, steps: int) -> list[float]:
    torch.manual_seed(0)
    recorder = _Losses()
    _trainer(steps, [recorder]).fit(module, datamodule=datamodule)
    return recorder.losses


def test_training_from_the_cache_equals_training_online(case):
    from forge_lightning.datamodules.diffusion import VideoCaptionConfig

    root, options = case["root"], dict(batch_size=2, num_workers=0, pin_memory=False, seed=1)
    torch.manual_seed(1)
    online = _module(case["wan"])
    cached = copy.deepcopy(online)
    cached.encoder_paths = {
        "vae": None,
        "text_encoder": str(case["wan"]),
    }  # text encoder for the empty prompt only
    losses_online = _fit(online, VideoDiffusionDataModule(VideoCaptionConfig(**case["data"]), **options), 3)
    cache = VideoDiffusionDataModule(
        cache=str(root / "features"), cache_config=str(root / "precompute.yaml"), **options
    )
    losses_cached = _fit(cached, cache, 3)
    assert len(losses_online) == 3 and len(set(losses_online)) == 3
    np.testing.assert_allclose(losses_cached, losses_online, rtol=0, atol=1e-6)
    for (name, a), b in zip(online.dit.state_dict().items(), cached.dit.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


def _perturbed(module: WanDiffusionModule) -> WanDiffusionModule:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in module.dit.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return module


def test_loss_equals_diffusers_hand_computation():
    module = _perturbed(WanDiffusionModule(config=DIT, flow_matching={"shift": 3.0}, seed=7))
    reference = WanTransformer3DModel(
        **{k: v for k, v in module.config.to_diffusers().items() if k[0] != "_"}
    )
    reference.load_state_dict(module.dit.state_dict())
    torch.manual_seed(0)
    latents, text = torch.randn(3, 4, 3, 4, 6), torch.randn(3, 5, 16)
    loss_sum, count = module.loss_sum({"latents": latents, "text_embeddings": text})
    # As the diffusers / DiffSynth scripts: sigma from u ~ U(0, 1) shifted, x_t = (1 - sigma) x0 + sigma eps,
    # timestep sigma * 1000, target eps - x0, mean squared error; each sample's u, then eps, from its generator.
    losses = []
    for row in range(3):
        generator = sample_generator(7, "train", 0, [0, row])
        u = torch.rand(1, generator=generator)
        sigma = 3.0 * u / (1 + 2.0 * u)
        noise = torch.randn(latents[row : row + 1].shape, generator=generator)
        x0 = latents[row : row + 1]
        noisy = (1 - sigma) * x0 + sigma * noise
        pred = reference(noisy, sigma * 1000, text[row : row + 1], return_dict=False)[0]
        losses.append(torch.nn.functional.mse_loss(pred.float(), (noise - x0).float()))
    assert int(count) == 3
    torch.testing.assert_close(loss_sum / count, torch.stack(losses).mean(), rtol=1e-5, atol=1e-6)


class _Cached(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        # one clip's latents for every sample: learnable, so the loss can fall well below its starting value
        self.latents = torch.randn(1, 4, 3, 4, 4, generator=generator).expand(4, -1, -1, -1, -1)
        self.text = torch.randn(4, 5, 16, generator=generator)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        return {"latents": self.latents[index], "text_embeddings": self.text[index]}


def test_fit_lowers_the_fixed_sigma_validation_loss():
    torch.manual_seed(0)
    module = WanDiffusionModule(
        config=DIT, optimizer={"name": "adamw", "lr": 1e-2}, scheduler={"name": "constant"}
    )
    loader = DataLoader(_Cached(), batch_size=2)
    trainer = _trainer(20)
    before = trainer.validate(module, loader, verbose=False)[0]
    trainer.fit(module, loader)
    after = trainer.validate(module, loader, verbose=False)[0]
    assert after["val/loss"] < 0.9 * before["val/loss"], (before, after)
    for sigma in (0.1, 0.5, 0.9):
        assert f"val/loss_sigma_{sigma:g}" in after
    # the validation loss is deterministic: fixed noise and sigmas
    assert trainer.validate(module, loader, verbose=False)[0]["val/loss"] == after["val/loss"]


RECIPE = REPO / "configs" / "diffusion" / "debug" / "cache_fsdp2.yaml"


def _launch(case: dict, name: str, devices: int, strategy: dict | str) -> tuple[dict[int, float], str]:
    """The debug recipe on ``devices`` processes (global batch 2), its cache pointed at the case's: the losses by
    step and the log."""
    root = case["root"]
    config = yaml.safe_load(RECIPE.read_text())
    config["trainer"].update(
        devices=devices, strategy=strategy, enable_progress_bar=False, enable_model_summary=False
    )
    config["trainer"]["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(root), "name": name},
    }
    config["data"]["init_args"].update(
        cache=str(root / "features"), cache_config=str(root / "precompute.yaml"), batch_size=2 // devices
    )
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "forge_lightning", "fit", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert_clean_exit(proc)
    rows = csv.DictReader((root / name / "version_0" / "metrics.csv").open())
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    return losses, proc.stdout + proc.stderr


def test_fsdp2_on_two_processes_matches_one(case):
    one, _ = _launch(case, "one", 1, "auto")
    two, log = _launch(case, "fsdp2", 2, {"class_path": "forge_lightning.strategies.FSDP2Strategy"})
    assert "dp_shard=2" in log and "fully_shard: 2 blocks" in log  # the DiT's blocks sharded over 2 ranks
    assert sorted(one) == sorted(two) == [0, 1, 2] and len(set(one.values())) == 3
    deltas = {step: abs(one[step] - two[step]) for step in one}
    assert max(deltas.values()) <= 2e-6, deltas


def test_activation_checkpointing_per_block_keeps_gradients():
    torch.manual_seed(0)
    plain = _perturbed(WanDiffusionModule(config=DIT, flow_matching={"text_dropout": 0.0}))
    checkpointed = copy.deepcopy(plain)
    plan = checkpointed.parallel_plan()
    assert [c.name for c in plan] == ["dit"] and plan.component("dit").blocks == list(checkpointed.dit.blocks)
    apply_activation_checkpointing(plan, "full")
    assert all("forward" in vars(block) for block in checkpointed.dit.blocks)  # each wrapped
    batch = {"latents": torch.randn(2, 4, 3, 4, 4), "text_embeddings": torch.randn(2, 5, 16)}
    calls = []
    handles = [b.attn1.register_forward_hook(lambda *_: calls.append(1)) for b in checkpointed.dit.blocks]
    for module in (plain, checkpointed):
        loss, _ = module.loss_sum(batch)
        loss.backward()
    for handle in handles:
        handle.remove()
    assert len(calls) == 2 * len(checkpointed.dit.blocks)  # each block's attention ran again in backward
    for (name, a), b in zip(plain.dit.named_parameters(), checkpointed.dit.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=name)


def test_save_pretrained_loads_in_diffusers(tmp_path):
    module = _perturbed(WanDiffusionModule(config=DIT))
    module.save_pretrained(tmp_path / "transformer")
    reference = WanTransformer3DModel.from_pretrained(tmp_path / "transformer")
    latents, text, timestep = torch.randn(1, 4, 3, 4, 4), torch.randn(1, 5, 16), torch.tensor([300.0])
    expected = reference(latents, timestep, text, return_dict=False)[0]
    torch.testing.assert_close(module.dit(latents, timestep, text), expected, rtol=0, atol=1e-5)

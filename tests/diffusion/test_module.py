"""``WanDiffusionModule`` on a tiny debug DiT (4 latent channels) with a tiny random UMT5 and ``AutoencoderKLWan``
saved to disk in the Wan checkpoint layout, over mp4 clips written with PyAV (CPU, fp32):

* training from a feature cache (``forge-data precompute`` with the project's WanVAE / WanTextEncoder) equals
  training with the encoders online: the same per-step losses and weights after 3 steps;
* the module's loss equals a hand computation with diffusers' ``WanTransformer3DModel`` on the same weights,
  noise and noise levels (the loss of the diffusers / DiffSynth training scripts);
* ``Trainer.fit`` lowers the fixed-sigma validation loss;
* ``python -m forge_lightning fit`` on 2 gloo processes under FSDP2Strategy gives the losses of one process, also
  with ``context_parallel_size: 2`` (each rank half of every video's tokens);
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
from diffusers import WanTransformer3DModel
from procs import assert_clean_exit
from torch.utils.data import DataLoader
from wan_case import DIT, build_case, perturbed, wan_module

from forge_lightning.datamodules.diffusion import VideoDiffusionDataModule
from forge_lightning.modules.diffusion import WanDiffusionModule, sample_generator
from forge_lightning.performance.transforms import apply_activation_checkpointing

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    return build_case(tmp_path_factory.mktemp("wan_module"))


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
    online = wan_module(case["wan"])
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


def test_loss_equals_diffusers_hand_computation():
    module = perturbed(WanDiffusionModule(config=DIT, flow_matching={"shift": 3.0}, seed=7))
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


@pytest.mark.parametrize(
    "optimizer", [{"name": "adamw", "lr": 1e-2}, {"name": "muon", "lr": 1e-2, "muon": {"lr": 0.05}}]
)
def test_fit_lowers_the_fixed_sigma_validation_loss(optimizer):
    torch.manual_seed(0)
    module = WanDiffusionModule(config=DIT, optimizer=optimizer, scheduler={"name": "constant"})
    loader = DataLoader(_Cached(), batch_size=2)
    trainer = _trainer(20)
    before = trainer.validate(module, loader, verbose=False)[0]
    trainer.fit(module, loader)
    assert type(trainer.optimizers[0]).__name__ == {"adamw": "AdamW", "muon": "Muon"}[optimizer["name"]]
    after = trainer.validate(module, loader, verbose=False)[0]
    assert after["val/loss"] < 0.9 * before["val/loss"], (before, after)
    for sigma in (0.1, 0.5, 0.9):
        assert f"val/loss_sigma_{sigma:g}" in after
    # the validation loss is deterministic: fixed noise and sigmas
    assert trainer.validate(module, loader, verbose=False)[0]["val/loss"] == after["val/loss"]


RECIPES = REPO / "configs" / "diffusion" / "debug"


def _launch(
    case: dict,
    name: str,
    devices: int,
    strategy: dict | str | None = None,
    recipe: str = "cache_fsdp2.yaml",
    data_parallel: int | None = None,
) -> tuple[dict[int, float], str]:
    """A debug recipe on ``devices`` processes (``data_parallel`` of them data-parallel, default all; global batch
    2), its cache pointed at the case's: the losses by step and the log. ``strategy``: the recipe's if ``None``."""
    root = case["root"]
    config = yaml.safe_load((RECIPES / recipe).read_text())
    config["trainer"].update(devices=devices, enable_progress_bar=False, enable_model_summary=False)
    if strategy is not None:
        config["trainer"]["strategy"] = strategy
    config["trainer"]["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(root), "name": name},
    }
    config["data"]["init_args"].update(
        cache=str(root / "features"),
        cache_config=str(root / "precompute.yaml"),
        batch_size=2 // (data_parallel or devices),
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


@pytest.fixture(scope="module")
def one_process(case) -> dict[int, float]:
    """The losses of the debug recipe on one process."""
    return _launch(case, "one", 1, "auto")[0]


def _assert_same_losses(one: dict[int, float], two: dict[int, float]) -> None:
    assert sorted(one) == sorted(two) == [0, 1, 2] and len(set(one.values())) == 3
    deltas = {step: abs(one[step] - two[step]) for step in one}
    assert max(deltas.values()) <= 2e-6, deltas


def test_fsdp2_on_two_processes_matches_one(case, one_process):
    two, log = _launch(case, "fsdp2", 2, {"class_path": "forge_lightning.strategies.FSDP2Strategy"})
    assert "dp_shard=2" in log and "fully_shard: 2 blocks" in log  # the DiT's blocks sharded over 2 ranks
    _assert_same_losses(one_process, two)


@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_fsdp2_context_parallel_on_two_processes_matches_one(case, one_process, kind):
    """configs/diffusion/debug/cache_fsdp2_cp.yaml (Ulysses; ring by override): 1 data-parallel rank x 2
    context-parallel ranks."""
    recipe = yaml.safe_load((RECIPES / "cache_fsdp2_cp.yaml").read_text())["trainer"]["strategy"]
    strategy = {**recipe, "init_args": {**recipe["init_args"], "context_parallel_type": kind}}
    two, log = _launch(case, f"fsdp2_cp_{kind}", 2, strategy, "cache_fsdp2_cp.yaml", data_parallel=1)
    assert f"dp_shard=1 x cp=2 ({kind})" in log and f"context parallelism: {kind} over 2 ranks" in log
    assert "fully_shard: 2 blocks + root over 2 ranks" in log  # parameters sharded over dp_shard x cp
    _assert_same_losses(one_process, two)


def test_activation_checkpointing_per_block_keeps_gradients():
    torch.manual_seed(0)
    plain = perturbed(WanDiffusionModule(config=DIT, flow_matching={"text_dropout": 0.0}))
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
    module = perturbed(WanDiffusionModule(config=DIT))
    module.save_pretrained(tmp_path / "transformer")
    reference = WanTransformer3DModel.from_pretrained(tmp_path / "transformer")
    latents, text, timestep = torch.randn(1, 4, 3, 4, 4), torch.randn(1, 5, 16), torch.tensor([300.0])
    expected = reference(latents, timestep, text, return_dict=False)[0]
    torch.testing.assert_close(module.dit(latents, timestep, text), expected, rtol=0, atol=1e-5)

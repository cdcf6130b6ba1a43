"""The ``forge-fit`` row of ``diffusion_throughput.py``: the product path, ``forge fit`` of a Wan recipe.

The child writes a feature cache with the feature-cache writer ``forge-data precompute`` uses
(``forge_lightning.datamodules.feature_cache.precompute``), so its shards and ``cache.json`` are in the real format:
two frozen modules standing in for the VAE and the text encoder (:class:`SyntheticFeature`: seeded random latents
of the benchmark's shape in fp32, text embeddings stored in bf16 as the recipe's precompute stores them) over
``--clips`` synthetic samples, and the precompute YAML naming them (the data module checks the cache against its
modules; its ``data`` section is not read when training from a cache). It then runs ``python -m forge_lightning
fit`` with the shape's recipe (``configs/diffusion/<model>/sft_fsdp2.yaml``) and only these changes: one device,
the preset's random-init config instead of ``pretrained``, the cache above, ``batch_size`` = ``--batch``,
``max_steps``, the callbacks reduced to ``ThroughputMonitor`` (no checkpoint or export), and with ``ac=`` the
activation checkpointing. On a CPU (script checks) the blocks are not compiled and FSDP2 keeps fp32 parameters.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import harness  # this script's directory is on sys.path
import torch

REPO = Path(__file__).resolve().parents[1]
RECIPES = {
    "wan2.1-1.3b": REPO / "configs" / "diffusion" / "wan2.1-t2v-1.3b" / "sft_fsdp2.yaml",
    "wan2.2-5b": REPO / "configs" / "diffusion" / "wan2.2-ti2v-5b" / "sft_fsdp2.yaml",
    "debug": REPO / "configs" / "diffusion" / "wan2.1-t2v-1.3b" / "sft_fsdp2.yaml",
}


class SyntheticFeature:
    """A stand-in frozen encoder: a seeded random tensor of ``shape`` per sample index (the same for an index in
    every run).

    Args:
        shape: the feature's shape per sample.
        seed: mixed with the index into each sample's seed.
        scale: standard deviation of the values.
    """

    def __init__(self, shape: list[int], seed: int, scale: float = 1.0) -> None:
        self.shape, self.seed, self.scale = tuple(shape), seed, scale

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        rows = [
            torch.randn(self.shape, generator=torch.Generator().manual_seed(self.seed * 100003 + int(i)))
            for i in index
        ]
        return self.scale * torch.stack(rows)


class SyntheticClips(torch.utils.data.Dataset):
    """``count`` samples that carry only their index (what :class:`SyntheticFeature` reads)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index}

    def sample_id(self, index: int) -> str:
        return f"synthetic:{index}"

    def fingerprint(self) -> dict[str, Any]:
        return {"synthetic_clips": self.count}


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {"index": torch.tensor([s["index"] for s in samples])}


def write_cache(args: argparse.Namespace, latents: tuple[int, ...], text_dim: int, work: Path) -> Path:
    """The synthetic feature cache under ``work/features`` and its precompute YAML; returns the YAML's path."""
    import yaml

    from forge_lightning.datamodules.feature_cache import FrozenModule, precompute

    modules = [
        FrozenModule(
            name="vae",
            target="diffusion_fit_row.SyntheticFeature",
            init_args={"shape": list(latents), "seed": args.seed},
            inputs={"index": "index"},
            outputs={"latents": ""},
        ),
        FrozenModule(
            name="text_encoder",
            target="diffusion_fit_row.SyntheticFeature",
            init_args={"shape": [args.text_tokens, text_dim], "seed": args.seed + 1, "scale": 0.1},
            inputs={"index": "index"},
            outputs={"text_embeddings": ""},
            dtype="bfloat16",
        ),
    ]
    precompute(
        SyntheticClips(args.clips * args.batch),
        modules,
        work / "features",
        collate_fn=_collate,
        batch_size=args.batch,
        keep=(),
        log=lambda line: None,
    )
    config = {
        # Not read when training from a cache; a precompute YAML holds one.
        "data": {"entries": ["synthetic"], "buckets": [[args.frames, args.height, args.width]], "fps": 16},
        "modules": [m.config() for m in modules],
        "keep": [],
    }
    path = work / "precompute.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def write_recipe(
    args: argparse.Namespace, settings: argparse.Namespace, shape: str, work: Path, max_steps: int
) -> Path:
    """The shape's recipe with the row's changes (module docstring)."""
    import yaml
    from diffusion_throughput import SHAPES

    recipe = yaml.safe_load(RECIPES[shape].read_text())
    trainer = recipe["trainer"]
    cuda = args.device.startswith("cuda")
    harness.single_device_trainer(trainer, cuda=cuda, work=work, max_steps=max_steps)
    model = recipe["model"]["init_args"]
    del model["pretrained"]
    model["config"] = {"preset": SHAPES[shape]["preset"], **SHAPES[shape].get("overrides", {})}
    data = recipe["data"]["init_args"]
    data.update(
        cache=str(work / "features"), cache_config=str(work / "precompute.yaml"), batch_size=args.batch
    )
    data.update(num_workers=2 if cuda else 0, pin_memory=cuda)
    performance = recipe.setdefault("performance", {})
    if settings.ac is not None:
        performance["activation_checkpointing"] = settings.ac
    if not cuda:  # CPU checks: the compiler needs the GPU; bf16 FSDP2 compute is slow there
        performance["compile"] = False
        trainer["strategy"]["init_args"].update(param_dtype=None, reduce_dtype=None)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run(
    args: argparse.Namespace, settings: argparse.Namespace, shape: str, latents: tuple[int, ...]
) -> dict[str, Any]:
    """Write the cache and the recipe, run ``forge fit`` in a child process and read its throughput windows."""
    from diffusion_throughput import dit_config

    work = Path(args.work_dir).resolve() / f"fit_{shape}"
    work.mkdir(parents=True, exist_ok=True)
    max_steps, timed = harness.fit_steps(args.steps)
    write_cache(args, latents, dit_config(args).text_dim, work)
    recipe = write_recipe(args, settings, shape, work, max_steps)
    command, measured = harness.forge_fit(recipe, work)
    ac = f"AC {settings.ac}" if settings.ac else "the recipe's AC"
    return {
        "setting": f"forge fit {RECIPES[shape].relative_to(REPO)}: 1 device, {ac}, synthetic feature cache",
        "attention": "the recipe's performance settings",
        **measured,
        "mfu": harness.mfu(measured["tflops"]),
        "timed_steps": measured["windows"] * harness.FIT_WINDOW,
        "first_loss": measured["losses"][0],
        "last_loss": measured["losses"][-1],
        "command": " ".join(command[1:]),
    }

"""Pi0.5 training throughput on one GPU: our Pi05Policy vs lerobot's PI05Policy, side by side in one run.

Both sides train end to end from the same LeRobot v3.0 dataset on local disk (two 224x224 cameras decoded from
mp4 in DataLoader workers, 50-action chunks, prompts of at most 200 tokens) at Pi0.5's sizes (ours 3.35 B
parameters; lerobot's 4.14 B include two output heads Pi0.5 never uses; the table checks they match), each
path in its own child process on the same GPU, timed after warm-up. Paths:

- ``forge``: ``Pi05Policy`` (``pi05-base``, random init) trained by Lightning with ``precision: bf16-mixed``
  (fp32 master weights, gradients and AdamW state; bf16 autocast) and ``LeRobotDataModule`` (worker processes,
  pinned memory, Lightning's host-to-device copy); the ``performance`` defaults on CUDA (compiled blocks,
  cuDNN attention first, fused AdamW), no activation checkpointing. Prompts are padded to the batch's longest
  (rounded up to 32 tokens), our default; lerobot pads them to 200 (``tokenizer_max_length``). Padding is
  masked, so both give the same results; trimmed prompts also leave room for the activations at batch 32.
- ``forge-sac``: ``forge`` with selective activation checkpointing (matmul and attention outputs kept, norms
  and activations recomputed: no matmul runs twice), for GPUs with less memory.
- ``forge-maxpad``: ``forge-sac`` with prompts padded to 200 tokens as lerobot does (``prompt_padding:
  max_length``): the same work per sample as lerobot's paths.
- ``forge-eager``: ``forge-sac`` without ``torch.compile``.
- ``forge-bf16``: bf16 weights and AdamW state under bf16 autocast, like ``lerobot-bf16``.
- ``forge-sdpa`` / ``forge-fa4``: ``forge`` with ``performance.attention.kernel`` pinned to SDPA or to
  FlashAttention-4 (``forge`` is ``auto``: FA4 where it imports). FA4 serves the vision tower; the prefix-LM and
  action-expert attention has a block mask and stays on SDPA.
- ``lerobot-ckpt``: lerobot 0.6.1's usual setting, fp32 weights + bf16 autocast + gradient checkpointing.
- ``lerobot-autocast``: fp32 weights + bf16 autocast at half the batch (batch 32 does not fit on one H200).
- ``lerobot-bf16``: ``dtype: bfloat16`` (bf16 weights except the vision tower and the norms) + bf16 autocast.

The lerobot paths are built and stepped by lerobot's own code, as ``lerobot-train`` does:
``TrainPipelineConfig`` with the PI05 optimizer and scheduler presets, ``make_train_eval_datasets`` (its
``LeRobotDataset``, frames as uint8), ``EpisodeAwareSampler`` and its DataLoader settings (4 workers, spawn,
prefetch 4, persistent, pinned), ``accelerate.Accelerator`` (``mixed_precision: bf16`` drives the autocast),
``make_policy``, ``make_pre_post_processors`` (normalise, prompt with the binned state, tokenise) and
``update_policy`` for each step (loss, backward, clipping at 1.0, AdamW, scheduler). Two differences from a
``lerobot-train`` run: the tokenizer is the dataset's word-level one (PaliGemma's is not on the machine; both
sides use it and pad to 200 tokens), and models are built directly on the GPU (a ``torch.device`` context;
start-up only). Our paths use the same optimizer (AdamW, lr 2.5e-5, betas (0.9, 0.95), eps 1e-8, weight decay
0.01 on every parameter), clipping at 1.0 and as many DataLoader workers.

Measured over ``--steps`` steps after ``--warmup``, the GPU synchronised at both ends: samples/s, step time,
data wait (host time from the end of one step to the start of the next: the loader and the host-to-device
copy, as a share of the wall time; lerobot's loop syncs every step, ours does not, so our host may wait while
the GPU still works) and peak GPU memory (``max_memory_allocated`` over the timed steps).

``--loss-steps 200`` instead trains each path for 200 steps on identical inputs and compares the mean loss of
the last 20 steps. Identical: the initial weights (seeded; every parameter redrawn as in the parity fixture,
see ``write_init``; saved in lerobot's layout and loaded by both sides), the frames and their order (our data
module's shuffled order, computed here and given to lerobot's DataLoader as its sampler; each child records
the frame indices it trained on and the summary says whether they match), the flow-matching noise and times
(drawn per step from one seeded numpy stream on both sides) and the learning-rate schedule (ours, warm-up then
cosine to 0.1x, in place of lerobot's preset, whose warm-up formula differs slightly).

GPU machine (one H200, Python 3.12, torch 2.11, no network): install av 15.1.0 (it bundles FFmpeg), lerobot
0.6.1 with its pure-Python dependencies, and what lerobot's dataset code imports (pandas and pyarrow too if the
machine lacks them: ``--preflight`` lists what each interpreter misses)::

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        -d wheels av==15.1.0 lerobot==0.6.1 draccus==0.11.6 mergedeep pyyaml-include toml termcolor \\
        gymnasium farama-notifications einops datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 xxhash
    # on the GPU machine: pip install --no-deps wheels/*.whl, then one command each:
    python benchmarks/vla_throughput.py --preflight
    python benchmarks/make_vla_dataset.py --output data/vla_bench
    python benchmarks/vla_throughput.py --paths forge forge-bf16 --log-dir logs
    python benchmarks/vla_throughput.py --log-dir logs \\
        --paths lerobot-ckpt lerobot-autocast lerobot-bf16
    python benchmarks/vla_throughput.py --loss-steps 200 --paths forge --log-dir logs
    python benchmarks/vla_throughput.py --loss-steps 200 --paths lerobot-ckpt \\
        --log-dir logs

Rows of paths a command does not run are kept from the JSON of an earlier command with the same settings, so
the paths can be split over commands as above. Prints one table last; writes
``benchmarks/results/vla_throughput.json`` (``vla_throughput_loss.json`` with ``--loss-steps``).

CPU dry run at tiny size (``debug`` preset; the lerobot paths need a Python 3.12 interpreter with lerobot
0.6.1, datasets, pandas, pyarrow, av and accelerate, given by ``--lerobot-python``, a command line)::

    python benchmarks/make_vla_dataset.py --output data/vla_tiny --episodes 2 --frames 20 --size 32 \\
        --state-dim 8 --action-dim 6
    python benchmarks/vla_throughput.py --device cpu --preset debug --data data/vla_tiny --batch 2 \\
        --warmup 2 --steps 3 --workers 1 --lerobot-workers 1 --lerobot-python "PY312" \\
        --paths forge forge-sac forge-maxpad forge-eager forge-bf16 lerobot-ckpt lerobot-autocast lerobot-bf16
    python benchmarks/vla_throughput.py --device cpu --preset debug --data data/vla_tiny --batch 2 \\
        --warmup 2 --loss-steps 25 --workers 1 --lerobot-workers 1 --lerobot-python "PY312" \\
        --paths forge forge-bf16 lerobot-ckpt lerobot-bf16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness  # this script's directory is on sys.path (stdlib only: the lerobot child imports it too)

REPO = Path(__file__).resolve().parents[1]
CAMERAS = ("observation.images.base", "observation.images.wrist")
NORMALIZATION = {"observation.state": "quantiles", "action": "quantiles"}
# lerobot's PI05 optimizer preset (openpi's): AdamW over every parameter, gradients clipped at 1.0.
OPTIMIZER = {"lr": 2.5e-5, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
GRAD_CLIP = 1.0
FORGE_PATHS: dict[str, dict[str, Any]] = {
    # No activation checkpointing: with prompts trimmed to the batch's longest, batch 32 fits (~122 GB).
    "forge": {"precision": "bf16-mixed", "performance": {}},
    "forge-sac": {"precision": "bf16-mixed", "performance": {"activation_checkpointing": "selective"}},
    "forge-maxpad": {
        "precision": "bf16-mixed",
        "performance": {"activation_checkpointing": "selective"},
        "config": {"prompt_padding": "max_length"},
    },
    "forge-eager": {
        "precision": "bf16-mixed",
        "performance": {"compile": False, "activation_checkpointing": "selective"},
    },
    # bf16 weights and AdamW state under bf16 autocast, as lerobot-bf16. Not Lightning's "bf16-true": it makes
    # bf16 the default dtype inside the step, so Pi05.sample_time's Beta distribution samples in bf16 on the
    # CPU, which torch does not implement (a bf16 Dirichlet), whatever the training device.
    "forge-bf16": {"precision": "bf16-mixed", "weights": "bfloat16", "performance": {}},
    # `forge` with the attention kernel pinned: SDPA, or FlashAttention-4 (the SigLIP tower's attention; the
    # prefix-LM and action-expert attention has a block mask and stays on SDPA)
    "forge-sdpa": {"precision": "bf16-mixed", "performance": {"attention": {"kernel": "sdpa"}}},
    "forge-fa4": {"precision": "bf16-mixed", "performance": {"attention": {"kernel": "fa4"}}},
}
LEROBOT_PATHS: dict[str, dict[str, Any]] = {
    "lerobot-ckpt": {"dtype": "float32", "checkpointing": True, "batch_divisor": 1},
    "lerobot-autocast": {"dtype": "float32", "checkpointing": False, "batch_divisor": 2},
    "lerobot-bf16": {"dtype": "bfloat16", "checkpointing": False, "batch_divisor": 1},
}
DEFAULT_PATHS = ["forge", "forge-bf16", "lerobot-ckpt", "lerobot-autocast", "lerobot-bf16"]
PREFLIGHT_MODULES = (
    "torch", "lightning", "transformers", "tokenizers", "accelerate", "safetensors", "numpy", "av",
    "torchcodec", "pyarrow", "pandas", "datasets", "dill", "multiprocess", "xxhash", "fsspec", "cv2",
    "einops", "draccus", "gymnasium", "termcolor", "huggingface_hub", "requests", "psutil", "yaml",
    "torchvision", "lerobot",
)  # fmt: skip


# ----- shared by both sides (stdlib / numpy / torch only: the lerobot child may run another interpreter) ----
def _setting(path: str, device: str) -> str:
    """One line describing a path's precision and memory settings on ``device``."""
    if path in FORGE_PATHS:
        spec = FORGE_PATHS[path]
        perf = {"compile": "auto", "activation_checkpointing": "none", **spec["performance"]}
        compiled = (
            "compiled"
            if perf["compile"] is True or (perf["compile"] == "auto" and device == "cuda")
            else "eager"
        )
        masters = "bf16 weights + bf16 autocast" if spec.get("weights") else "fp32 masters + bf16 autocast"
        padding = spec.get("config", {}).get("prompt_padding", "longest")
        prompt = "full-length prompts" if padding == "max_length" else "prompts trimmed to the longest"
        return f"{masters}, {compiled}, AC {perf['activation_checkpointing']}, {prompt}"
    spec = LEROBOT_PATHS[path]
    weights = "fp32 weights" if spec["dtype"] == "float32" else "bf16 weights"
    return f"{weights} + bf16 autocast{', grad. ckpt' if spec['checkpointing'] else ''}, full-length prompts"


def _batch(args: argparse.Namespace, path: str) -> int:
    """The path's batch: ``--batches`` override, else ``--batch`` (halved for ``lerobot-autocast``)."""
    overrides = dict(item.split("=") for item in args.batches.split(",")) if args.batches else {}
    if path in overrides:
        return int(overrides[path])
    if args.loss_steps or path not in LEROBOT_PATHS:
        return args.batch  # the loss comparison needs the same batches everywhere
    return max(1, args.batch // LEROBOT_PATHS[path]["batch_divisor"])


def _schedule(total_steps: int) -> dict[str, Any]:
    """Warm-up + cosine to 0.1x: lerobot's PI05 preset (1000 of 30000 steps, floor 0.1x) scaled to the run."""
    return {"name": "cosine", "warmup_steps": 1000 * total_steps // 30000, "total_steps": total_steps,
            "min_lr_ratio": 0.1}  # fmt: skip


def _total_steps(args: argparse.Namespace) -> int:
    """Steps each path trains: warm-up + timed steps, or ``--loss-steps``."""
    return args.loss_steps or args.warmup + args.steps


def _warmup(args: argparse.Namespace) -> int:
    """Untimed steps (at least one: the clock starts when a step ends; in loss mode all steps are trained)."""
    return max(1, min(args.warmup, _total_steps(args) - 1))


def _work_file(args: argparse.Namespace, kind: str) -> Path:
    """Files the parent writes for the loss comparison (initial weights, frame order)."""
    if kind == "init":
        return Path(args.work_dir) / f"init_{args.preset}_{args.init}_seed{args.seed}.safetensors"
    return Path(args.work_dir) / f"order_b{args.batch}_n{args.loss_steps}_seed{args.seed}.json"


def _video_backend(choice: str) -> str:
    """``auto``: torchcodec where it imports (with its FFmpeg libraries), else PyAV."""
    if choice != "auto":
        return choice
    try:
        import torchcodec.decoders  # noqa: F401

        return "torchcodec"
    except Exception:  # torchcodec raises RuntimeError when FFmpeg's libraries are missing
        return "pyav"


class FixedDraws:
    """Flow-matching noise ``[B, chunk, action_dim]`` and times ``[B]`` drawn per step from one seeded stream.

    Both sides call ``noise`` then ``time`` once per training step (ours in ``Pi05Policy.loss``, lerobot's in
    ``PI05Policy.forward``); the times follow the config's ``Beta(alpha, beta) * scale + offset``.
    """

    def __init__(self, seed: int, chunk: int, action_dim: int, time_distribution: tuple[float, ...]) -> None:
        self.seed, self.chunk, self.action_dim = seed, chunk, action_dim
        self.alpha, self.beta, self.scale, self.offset = time_distribution
        self.step = 0
        self._time: Any = None

    def noise(self, batch_size: int, device: Any) -> Any:
        import numpy as np
        import torch

        rng = np.random.default_rng([self.seed, self.step])
        noise = rng.standard_normal((batch_size, self.chunk, self.action_dim)).astype(np.float32)
        time_B = rng.beta(self.alpha, self.beta, batch_size) * self.scale + self.offset
        self._time = torch.from_numpy(time_B.astype(np.float32))
        return torch.from_numpy(noise).to(device)

    def time(self, batch_size: int, device: Any) -> Any:
        if self._time is None or len(self._time) != batch_size:
            raise RuntimeError("FixedDraws.time called without a matching noise draw first")
        time_B, self._time = self._time, None
        self.step += 1
        return time_B.to(device)


def _draws(args: argparse.Namespace) -> FixedDraws:
    """The shared noise / time stream of the loss comparison, for the preset's sizes."""
    from forge_lightning.modules.embodied.config import Pi05Config

    c = Pi05Config.from_preset(args.preset)
    timing = (c.time_beta_alpha, c.time_beta_beta, c.time_scale, c.time_offset)
    return FixedDraws(args.seed, c.chunk_size, c.max_action_dim, timing)


def _digest(indices: list[Any]) -> str:
    """Short hash of the frame indices of every trained batch, in order."""
    flat = [int(i) for batch in indices for i in batch.reshape(-1).tolist()]
    return hashlib.sha1(json.dumps(flat).encode()).hexdigest()[:12]


def _measured(batch: int, timer: harness.StepTimer, wait: float, peak_bytes: float) -> dict[str, float]:
    """The row's speed fields from the timed steps of ``batch`` samples, ``wait`` seconds of them data wait."""
    return {
        "samples_per_s": timer.rate(batch),
        "step_s": timer.step_s,
        "data_wait_pct": 100.0 * wait / timer.elapsed_s,
        "peak_mem_gb": peak_bytes / 1e9,
    }


def _loss_fields(losses: list[float], indices: list[Any] | None) -> dict[str, Any]:
    """Step-0 loss, mean of the last 20, every loss, and the digest of the frames trained on."""
    tail = losses[-20:]
    fields = {"first_loss": losses[0], "last20_mean_loss": sum(tail) / len(tail), "losses": losses}
    if indices is not None:
        fields["order_digest"] = _digest(indices)
    return fields


# ----- our side ---------------------------------------------------------------------------------------------
def _step_timer(warmup: int, steps: int, cuda: bool, record_order: bool, profile_steps: int = 0) -> Any:
    """A Lightning callback timing steps ``warmup + 1 ... steps``, keeping every step's loss (and frame indices);
    with ``profile_steps``, ``torch.profiler`` records the first that many timed steps (``step_profile.py``)."""
    from lightning.pytorch import Callback
    from step_profile import StepProfiler

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.clock = harness.StepTimer(warmup, steps - warmup, cuda)
            self.last_end = None
            self.wait, self.losses, self.indices, self.prompt_widths = 0.0, [], [], []
            self.profiler = StepProfiler(warmup, profile_steps, cuda)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if self.last_end is not None and trainer.global_step >= warmup:
                self.wait += time.perf_counter() - self.last_end  # loader + host-to-device copy
                self.prompt_widths.append(batch["prompt.tokens"].shape[1])
            if record_order:
                self.indices.append(batch["index"])

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.losses.append(outputs["loss"].detach())
            self.clock.after_step(trainer.global_step)
            self.profiler.after_step(trainer.global_step)
            self.last_end = time.perf_counter()

    return StepTimer()


def _forge_policy(args: argparse.Namespace, path: str, steps: int) -> Any:
    """Our ``Pi05Policy`` for ``path`` (loss mode: the shared initial weights and noise / time draws)."""
    import torch

    from forge_lightning.modules.embodied import Pi05Policy
    from forge_lightning.modules.embodied.config import Pi05Config

    data = Path(args.data)
    pretrained = str(_work_file(args, "init")) if args.loss_steps else None
    overrides = FORGE_PATHS[path].get("config", {})
    config = Pi05Config.from_preset(args.preset, **overrides).to_dict() if overrides else args.preset
    # Built on the training device (start-up only: the same parameters, initialised there).
    with torch.device(args.device):
        policy = Pi05Policy(
            config,
            pretrained=pretrained,
            tokenizer=str(data / "tokenizer"),
            image_keys=list(CAMERAS),
            optimizer={**OPTIMIZER, "name": "adamw", "decay_norms_biases_embeddings": True},
            scheduler=_schedule(steps),
            performance=FORGE_PATHS[path]["performance"],
        )
    if FORGE_PATHS[path].get("weights"):
        policy.to(getattr(torch, FORGE_PATHS[path]["weights"]))
    if args.loss_steps:
        draws = _draws(args)
        policy.model.sample_noise = lambda batch_size, *, device=None: draws.noise(batch_size, device)
        policy.model.sample_time = lambda batch_size, *, device=None: draws.time(batch_size, device)
    return policy


def run_forge(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """Train one of our paths with Lightning and ``LeRobotDataModule``; measure it."""
    import torch
    from lightning.pytorch import Trainer

    from forge_lightning.datamodules.lerobot import LeRobotDataModule
    from forge_lightning.modules.embodied.config import Pi05Config

    cuda, batch, steps = args.device == "cuda", _batch(args, path), _total_steps(args)
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls, as lerobot-train sets
    fps = json.loads((Path(args.data) / "dataset" / "meta" / "info.json").read_text())["fps"]
    backend = _video_backend(args.video_backend)
    datamodule = LeRobotDataModule(
        str(Path(args.data) / "dataset"),
        delta_timestamps={"action": [k / fps for k in range(Pi05Config.from_preset(args.preset).chunk_size)]},
        normalization=NORMALIZATION,
        batch_size=batch,
        seed=args.seed,
        num_workers=args.workers,
        pin_memory=cuda,
        video_backend=backend,
    )
    start = time.perf_counter()
    policy = _forge_policy(args, path, steps)
    build_s = time.perf_counter() - start
    profile_steps = min(args.profile, steps - _warmup(args)) if not args.loss_steps else 0
    timer = _step_timer(_warmup(args), steps, cuda, bool(args.loss_steps), profile_steps)
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision=FORGE_PATHS[path]["precision"],
        max_steps=steps,
        gradient_clip_val=GRAD_CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(policy, datamodule=datamodule)
    result = _measured(batch, timer.clock, timer.wait, harness.peak_memory_bytes(cuda))
    result |= {"params": sum(p.numel() for p in policy.model.parameters()), "build_s": build_s}
    result |= {"batch": batch, "video_backend": backend, "workers": args.workers}
    result["timed_steps"] = timer.clock.steps
    result["prompt_tokens"] = sum(timer.prompt_widths) / max(1, len(timer.prompt_widths))
    if args.loss_steps:
        result |= _loss_fields([float(x) for x in timer.losses], timer.indices)
    if timer.profiler.summary is not None:
        result["profile"] = timer.profiler.summary
    return result


def write_init(args: argparse.Namespace) -> None:
    """Seeded initial weights for the loss comparison, in lerobot's layout (without its two unused heads).

    ``--init model``: our model's own initialisation, where every action-expert block starts as the identity
    (zero adaRMS gates), so at lr 2.5e-5 the prefix (vision and backbone, most of the compute) barely moves
    the loss for hundreds of steps. ``--init dense`` (default) then redraws every parameter as the parity
    fixture does (scripts/make_pi05_fixture.py): matrices ~ N(0, 1 / fan_in), vectors around their initial
    value, so the loss depends on every component from the first step.
    """
    import torch
    from safetensors.torch import save_file

    from forge_lightning.modules.embodied import Pi05, Pi05Config, to_lerobot_state_dict

    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = Pi05(Pi05Config.from_preset(args.preset))
    if args.init == "dense":
        sys.path.insert(0, str(REPO / "scripts"))
        from make_pi05_fixture import randomise_

        randomise_(model, torch.Generator().manual_seed(args.seed))
    state = to_lerobot_state_dict(model, with_heads=False)
    path = _work_file(args, "init")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(path))


def write_order(args: argparse.Namespace) -> Path:
    """Frame indices of our data module's first ``--loss-steps`` batches (its seeded per-epoch shuffle)."""
    import torch

    from forge_lightning.datamodules.loader import StepLoader

    info = json.loads((Path(args.data) / "dataset" / "meta" / "info.json").read_text())
    frames = torch.arange(info["total_frames"])
    # The data module trains through a StepLoader over the whole dataset (one dataset, no validation split):
    # the same loader over the frame indices yields the indices of the frames it trains on.
    loader = StepLoader(frames, batch_size=args.batch, seed=args.seed, label_key=None)
    order: list[int] = []
    while len(order) < args.loss_steps * args.batch:
        for batch in loader:
            loader.mark_consumed()
            order += batch.tolist()
            if len(order) >= args.loss_steps * args.batch:
                break
    path = _work_file(args, "order")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(order))
    return path


# ----- lerobot's side ---------------------------------------------------------------------------------------
def _tiny_lerobot(preset: str) -> None:
    """lerobot builds Pi0.5 at the public sizes only: for ``debug``, swap in the parity fixture's sizes."""
    if preset == "pi05-base":
        return
    if preset != "debug":
        raise ValueError(
            f"the lerobot paths run at 'pi05-base' or 'debug' (the fixture's sizes), not {preset!r}"
        )
    sys.path.insert(0, str(REPO / "scripts"))
    from make_pi05_fixture import patch_lerobot_sizes  # the fixture's size swap (see that script)

    patch_lerobot_sizes()


def _lerobot_config(args: argparse.Namespace, path: str) -> Any:
    """The ``TrainPipelineConfig`` a ``lerobot-train --policy.type=pi05`` run of this path would build."""
    from lerobot.configs.default import DatasetConfig
    from lerobot.configs.train import TrainPipelineConfig
    from lerobot.policies.pi05 import PI05Config

    from forge_lightning.modules.embodied.config import Pi05Config

    spec, ours = LEROBOT_PATHS[path], Pi05Config.from_preset(args.preset)
    size = ours.vision.image_size
    policy = PI05Config(
        device=args.device,
        dtype=spec["dtype"],
        gradient_checkpointing=spec["checkpointing"],
        push_to_hub=False,
        chunk_size=ours.chunk_size,
        n_action_steps=ours.chunk_size,
        max_state_dim=ours.max_state_dim,
        max_action_dim=ours.max_action_dim,
        tokenizer_max_length=ours.tokenizer_max_length,
        image_resolution=(size, size),
    )
    dataset = DatasetConfig(
        repo_id="local/vla_bench",
        root=str(Path(args.data) / "dataset"),
        video_backend=_video_backend(args.video_backend),
    )
    cfg = TrainPipelineConfig(
        dataset=dataset,
        policy=policy,
        output_dir=Path(args.work_dir) / "lerobot_unused_output" / f"{path}-{os.getpid()}",
        seed=args.seed,
        num_workers=args.lerobot_workers,
        batch_size=_batch(args, path),
        steps=_total_steps(args),
        save_checkpoint=False,
    )
    cfg.validate()  # sets the optimizer and scheduler presets, as lerobot-train does
    return cfg


def _lerobot_preprocessor(cfg: Any, stats: Any, tokenizer: Path) -> Any:
    """lerobot's PI05 pre-processor, with the dataset's tokenizer instead of PaliGemma's hub download."""
    from lerobot.policies import make_pre_post_processors
    from lerobot.policies.pi05 import processor_pi05

    hub_step = processor_pi05.TokenizerProcessorStep

    def local_step(**kwargs: Any) -> Any:
        return hub_step(**{**kwargs, "tokenizer_name": str(tokenizer)})

    processor_pi05.TokenizerProcessorStep = local_step
    try:
        preprocessor, _ = make_pre_post_processors(
            policy_cfg=cfg.policy, pretrained_path=None, dataset_stats=stats
        )
    finally:
        processor_pi05.TokenizerProcessorStep = hub_step
    return preprocessor


def _lerobot_loader(cfg: Any, dataset: Any, order: list[int] | None, cuda: bool) -> Any:
    """lerobot-train's DataLoader (shuffled EpisodeAwareSampler), or one over a fixed sequence of frames."""
    import torch
    from lerobot.datasets import EpisodeAwareSampler
    from lerobot.scripts.lerobot_train import _dataloader_worker_kwargs
    from lerobot.utils.collate import lerobot_collate_fn

    sampler = order
    if sampler is None:
        sampler = EpisodeAwareSampler(
            dataset.meta.episodes["dataset_from_index"],
            dataset.meta.episodes["dataset_to_index"],
            episode_indices_to_use=dataset.episodes,
            drop_n_last_frames=getattr(cfg.policy, "drop_n_last_frames", 0),
            shuffle=True,
            seed=cfg.seed,
            absolute_to_relative_idx=dataset.absolute_to_relative_idx,
        )
    return torch.utils.data.DataLoader(
        dataset,
        num_workers=cfg.num_workers,
        batch_size=cfg.batch_size,
        shuffle=False,
        sampler=sampler,
        pin_memory=cuda,
        drop_last=False,
        collate_fn=lerobot_collate_fn if dataset.meta.has_language_columns else None,
        **_dataloader_worker_kwargs(cfg),
    )


def _lerobot_loss_setup(args: argparse.Namespace, policy: Any, optimizer: Any) -> Any:
    """Loss comparison: the shared initial weights, noise / time draws and schedule; returns the scheduler."""
    from safetensors.torch import load_file

    from forge_lightning.optim.schedulers import SchedulerConfig, build_scheduler

    state = load_file(str(_work_file(args, "init")))
    # The file uses the checkpoint layout; recent transformers releases drop SigLIP's `vision_model` level.
    expected = policy.state_dict().keys()
    flat = {k: k.replace(".vision_tower.vision_model.", ".vision_tower.") for k in state}
    state = {(flat[k] if k not in expected and flat[k] in expected else k): v for k, v in state.items()}
    missing, unexpected = policy.load_state_dict(state, strict=False)
    heads = [k for k in missing if k.endswith("lm_head.weight")]
    if unexpected or len(heads) != len(missing):
        raise ValueError(
            f"initial weights do not fit lerobot's model: missing {missing}, unexpected {unexpected}"
        )
    draws = _draws(args)
    policy.model.sample_noise = lambda shape, device: draws.noise(shape[0], device)
    policy.model.sample_time = lambda batch_size, device: draws.time(batch_size, device)
    steps = _total_steps(args)
    return build_scheduler(optimizer, SchedulerConfig(**_schedule(steps)), steps)


def _lerobot_params(policy: Any) -> dict[str, int]:
    """Parameters of lerobot's policy, and of its two output heads that Pi0.5 never uses."""
    seen, total, heads = set(), 0, 0
    for name, param in policy.named_parameters(remove_duplicate=False):
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        total += param.numel()
        heads += param.numel() if name.endswith("lm_head.weight") else 0
    return {"params": total, "lerobot_head_params": heads}


def _lerobot_setup(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """Everything lerobot-train builds before its loop, for this path (see the module docstring)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    from lerobot.datasets.factory import make_train_eval_datasets
    from lerobot.optim.factory import make_optimizer_and_scheduler
    from lerobot.policies import make_policy
    from lerobot.utils.random_utils import set_seed

    _tiny_lerobot(args.preset)
    cfg, cuda = _lerobot_config(args, path), args.device == "cuda"
    accelerator = Accelerator(
        step_scheduler_with_optimizer=False,
        mixed_precision="bf16",  # lerobot-train: from policy.dtype; here fp32 weights get autocast too
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
        cpu=not cuda,
    )
    set_seed(cfg.seed, accelerator=accelerator)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    dataset, _ = make_train_eval_datasets(cfg)
    start = time.perf_counter()
    with torch.device(args.device):
        policy = make_policy(cfg=cfg.policy, ds_meta=dataset.meta, rename_map=cfg.rename_map)
    build_s = time.perf_counter() - start
    preprocessor = _lerobot_preprocessor(cfg, dataset.meta.stats, Path(args.data) / "tokenizer")
    optimizer, scheduler = make_optimizer_and_scheduler(cfg, policy)
    order = None
    if args.loss_steps:
        scheduler = _lerobot_loss_setup(args, policy, optimizer)
        order = json.loads(_work_file(args, "order").read_text())
    loader = _lerobot_loader(cfg, dataset, order, cuda)
    params = _lerobot_params(policy)
    policy, optimizer, loader, scheduler = accelerator.prepare(policy, optimizer, loader, scheduler)
    return {"cfg": cfg, "accelerator": accelerator, "dataset": dataset, "policy": policy, "params": params,
            "preprocessor": preprocessor, "optimizer": optimizer, "scheduler": scheduler, "loader": loader,
            "build_s": build_s}  # fmt: skip


def _lerobot_tracker(run: dict[str, Any], cuda: bool) -> Any:
    """The ``MetricsTracker`` that ``update_policy`` writes its step metrics into."""
    from lerobot.utils.logging_utils import AverageMeter, MetricsTracker

    names = ["loss", "grad_norm", "lr", "update_s", "dataloading_s", *(["gpu_mem_gb"] if cuda else [])]
    cfg, dataset = run["cfg"], run["dataset"]
    meters = {name: AverageMeter(name) for name in names}
    return MetricsTracker(
        cfg.batch_size, dataset.num_frames, dataset.num_episodes, meters, accelerator=run["accelerator"]
    )


def run_lerobot(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """lerobot-train's loop for one path (data, pre-processor, ``update_policy``), timed after warm-up."""
    import torch
    from lerobot.scripts.lerobot_train import update_policy
    from lerobot.utils.utils import cycle

    cuda, steps = args.device == "cuda", _total_steps(args)
    run = _lerobot_setup(args, path)
    cfg, tracker, batches = run["cfg"], _lerobot_tracker(run, cuda), cycle(run["loader"])
    warmup = _warmup(args)
    timer = harness.StepTimer(warmup, steps - warmup, cuda)
    losses, indices, wait, peak = [], [], 0.0, 0.0
    for step in range(steps):
        timer.after_step(step)  # the clock starts when the warm-up's last step ends
        fetch = time.perf_counter()
        batch = next(batches)  # the prepared loader also copies to the GPU
        if step >= warmup:
            wait += time.perf_counter() - fetch
        if args.loss_steps:
            indices.append(batch["index"])
        for key in run["dataset"].meta.camera_keys:  # as lerobot-train: uint8 frames to [0, 1] floats
            if key in batch and batch[key].dtype == torch.uint8:
                batch[key] = batch[key].to(dtype=torch.float32) / 255.0
        batch = run["preprocessor"](batch)
        tracker.dataloading_s = time.perf_counter() - fetch
        tracker, output = update_policy(
            tracker, run["policy"], batch, run["optimizer"], cfg.optimizer.grad_clip_norm,
            accelerator=run["accelerator"], lr_scheduler=run["scheduler"],
        )  # fmt: skip
        losses.append(float(output["loss"]))
        if step >= warmup:  # update_policy resets the peak at each step's start
            peak = max(peak, harness.peak_memory_bytes(cuda))
    timer.after_step(steps)
    result = _measured(cfg.batch_size, timer, wait, peak)
    result |= run["params"] | {"build_s": run["build_s"], "batch": cfg.batch_size}
    result |= {
        "video_backend": cfg.dataset.video_backend,
        "workers": cfg.num_workers,
        "timed_steps": steps - warmup,
        "prompt_tokens": cfg.policy.tokenizer_max_length,  # lerobot pads every prompt to it
    }
    if args.loss_steps:
        result |= _loss_fields(losses, indices)
    return result


# ----- the parent: children, preflight, table ---------------------------------------------------------------
def preflight() -> dict[str, Any]:
    """Python, torch and GPU, and which of the modules the benchmark needs import in this interpreter."""
    import importlib

    found, missing = {}, []
    for name in PREFLIGHT_MODULES:
        try:
            module = importlib.import_module(name)
            found[name] = str(getattr(module, "__version__", "?"))
        except Exception as error:  # ImportError, or a binary that fails to load
            missing.append(f"{name} ({type(error).__name__})")
    info: dict[str, Any] = {"python": sys.version.split()[0], "found": found, "missing": missing}
    if "torch" in found:
        import torch

        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return info


def _command(args: argparse.Namespace, child: str) -> list[str]:
    """The command line of a child: this script with ``--child``, in the lerobot interpreter for its paths."""
    lerobot_side = child in LEROBOT_PATHS or child == "preflight-lerobot"
    python = shlex.split(args.lerobot_python) if lerobot_side and args.lerobot_python else [sys.executable]
    return [*python, str(Path(__file__).resolve()), "--child", child.removesuffix("-lerobot"), *sys.argv[1:]]


def _child(args: argparse.Namespace, child: str) -> dict[str, Any]:
    """Runs ``child`` in its own process; its output goes to ``--log-dir``; returns its RESULT."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    run = harness.run_child(_command(args, child), env)
    log = Path(args.log_dir) / f"vla_{child}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(run.stdout + run.stderr)
    result = run.result()
    if result is not None:
        return result | {"wall_s": run.seconds}
    return {"error": run.failure(), "log": str(log)}


def _value(row: dict[str, Any] | None, key: str) -> float | None:
    """``row[key]``, or ``None`` for a row that is missing or failed (no ratio against it)."""
    return None if row is None or "error" in row else row[key]


def table(
    rows: dict[str, dict[str, Any]], loss_reference: str | None, flops_per_sample: Callable[[float], float]
) -> str:
    """The markdown table: one row per path, samples/s ratios against every lerobot row.

    TFLOP/s and MFU (of 989 TFLOP/s, H100 / H200 dense bf16) count the model FLOPs of the tokens each path runs
    (``flops_per_sample(prompt tokens)``, ``Pi05Config.training_flops_per_sample``): a prompt padded to the batch's
    longest costs fewer FLOPs than one padded to 200; recomputation by checkpointing is not counted.
    """
    refs = [p for p in LEROBOT_PATHS if p in rows]
    columns = ["path", "setting", "batch", "prompt", "samples/s", "TFLOP/s", "MFU", "step", "data wait"]
    columns += ["peak mem", *(f"vs {p}" for p in refs)]
    if loss_reference:
        columns += ["step-0 loss", "last-20 loss", f"vs {loss_reference}"]
    lines = []
    for path, row in rows.items():
        if "error" in row:
            lines.append([path, row.get("setting", ""), harness.failed(row["error"], width=120)])
            continue
        prompt = row.get("prompt_tokens")  # absent from rows measured before trimming: the full length
        tflops = harness.tflops(row["samples_per_s"] * flops_per_sample(prompt))
        line = [path, row["setting"], row["batch"], f"{prompt:.0f}" if prompt else "-"]
        line += [f"{row['samples_per_s']:.2f}", f"{tflops:.0f}", f"{100 * harness.mfu(tflops):.1f}%"]
        line += [f"{row['step_s'] * 1e3:.0f} ms"]
        line += [f"{row['data_wait_pct']:.1f}%", f"{row['peak_mem_gb']:.1f} GB"]
        line += [harness.ratio(row["samples_per_s"], _value(rows[p], "samples_per_s")) for p in refs]
        if loss_reference:
            loss_ref = _value(rows.get(loss_reference), "last20_mean_loss")
            line += [f"{row['first_loss']:.4f}", f"{row['last20_mean_loss']:.4f}"]
            line.append(harness.change(row["last20_mean_loss"], loss_ref))
        lines.append(line)
    return harness.markdown_table(columns, lines)


def _count(n: int) -> str:
    """A parameter count, in billions when large."""
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n:,}"


def _summary(rows: dict[str, dict[str, Any]], loss: bool) -> list[str]:
    """Goal lines: speed-ups of ``forge``, parameter counts, loss agreement and data order."""
    ok = {p: r for p, r in rows.items() if "error" not in r}
    lines = []
    ours = next((ok[p] for p in FORGE_PATHS if p in ok), None)
    theirs = next((ok[p] for p in LEROBOT_PATHS if p in ok), None)
    if ours and theirs:
        lerobot = theirs["params"] - theirs["lerobot_head_params"]
        same = "equal" if lerobot == ours["params"] else "DIFFERENT"
        lines.append(
            f"parameters: ours {_count(ours['params'])}; lerobot {_count(theirs['params'])}, less its two "
            f"unused heads ({_count(theirs['lerobot_head_params'])}) = {_count(lerobot)}: {same}"
        )
    if "forge" in ok and not loss:
        if "lerobot-ckpt" in ok:
            speedup = ok["forge"]["samples_per_s"] / ok["lerobot-ckpt"]["samples_per_s"]
            lines.append(f"forge vs lerobot-ckpt: {speedup:.2f}x (goal 2.5x)")
        fastest = [ok[p]["samples_per_s"] for p in ("lerobot-autocast", "lerobot-bf16") if p in ok]
        if fastest:
            lines.append(
                f"forge vs lerobot's fastest: {ok['forge']['samples_per_s'] / max(fastest):.2f}x (goal 1.5x)"
            )
    digests = {r.get("order_digest") for r in ok.values() if r.get("order_digest")}
    if loss and digests:
        lines.append(f"data order: {'identical' if len(digests) == 1 else 'DIFFERENT'} across paths")
    return lines


def _meta_key(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """What must match for rows of different commands to share a table."""
    return {"preset": args.preset, "device": args.device, "batch": args.batch, "loss_steps": args.loss_steps,
            "steps": None if args.loss_steps else args.steps, "warmup": args.warmup, "seed": args.seed,
            "frames": info["total_frames"], "episodes": info["total_episodes"],
            "init": args.init if args.loss_steps else None}  # fmt: skip


def _write(args: argparse.Namespace, rows: dict[str, dict[str, Any]], key: dict[str, Any]) -> Path:
    """Writes the JSON (rows of earlier commands with the same settings kept) and returns its path."""
    suffix = "_loss" if args.loss_steps else ""
    if (args.preset, args.device) != ("pi05-base", "cuda"):
        suffix += f"_{args.preset}_{args.device}"
    out = Path(args.out or REPO / "benchmarks" / "results" / f"vla_throughput{suffix}.json")
    earlier: dict[str, Any] = {}
    if out.exists():
        previous = json.loads(out.read_text())
        if previous.get("settings") == key:
            earlier = previous.get("rows", {})
    merged = {p: earlier[p] for p in [*FORGE_PATHS, *LEROBOT_PATHS] if p in earlier and p not in rows}
    merged |= rows
    ordered = {p: merged[p] for p in [*FORGE_PATHS, *LEROBOT_PATHS] if p in merged}
    meta = {"gpu": harness.machine(args.device == "cuda"), **harness.run_meta(__file__)}
    harness.write_json(out, {"settings": key, "meta": meta, "rows": ordered})
    rows.clear()
    rows |= ordered
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default="data/vla_bench", help="make_vla_dataset.py output (dataset/, tokenizer/)"
    )
    parser.add_argument(
        "--preset", default="pi05-base", help="Pi0.5 preset (lerobot paths: pi05-base or debug)"
    )
    parser.add_argument("--paths", nargs="+", default=DEFAULT_PATHS, choices=[*FORGE_PATHS, *LEROBOT_PATHS])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", default=None, help="per-path batch overrides, e.g. lerobot-autocast=12")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--loss-steps", type=int, default=0, help="compare losses over this many steps instead"
    )
    parser.add_argument("--loss-reference", default="lerobot-ckpt", help="row the loss column compares with")
    parser.add_argument(
        "--init", default="dense", choices=("dense", "model"), help="loss mode: see write_init"
    )
    parser.add_argument(
        "--workers", type=int, default=4, help="our DataLoader workers (lerobot-train's default: 4)"
    )
    parser.add_argument("--lerobot-workers", type=int, default=4)
    parser.add_argument("--video-backend", default="auto", choices=("auto", "pyav", "torchcodec"))
    parser.add_argument("--lerobot-python", default=None, help="interpreter command for the lerobot paths")
    parser.add_argument("--seed", type=int, default=1000, help="lerobot-train's default seed")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--work-dir", default="data/vla_work", help="initial weights and frame order (loss mode)"
    )
    parser.add_argument("--log-dir", default="data/vla_work/logs", help="each child's full output")
    parser.add_argument("--out", default=None, help="JSON output (default benchmarks/results/...)")
    parser.add_argument(
        "--preflight", action="store_true", help="list what each interpreter lacks, then stop"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="our paths: profile this many timed steps (GPU kernel time by kind, GPU idle time); the speed "
        "columns of a profiled run include the profiler's overhead",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def _run_child(args: argparse.Namespace) -> None:
    """In a child process: run ``--child`` and print its result as one ``RESULT`` JSON line."""
    sys.path.insert(0, str(REPO))
    runners: dict[str, Callable[[], Any]] = {
        "preflight": preflight,
        "init": lambda: write_init(args) or {},
        **{p: (lambda p=p: run_forge(args, p)) for p in FORGE_PATHS},
        **{p: (lambda p=p: run_lerobot(args, p)) for p in LEROBOT_PATHS},
    }
    harness.emit_result(runners[args.child]())


def _preflight(args: argparse.Namespace) -> None:
    """Prints what each interpreter has and lacks."""
    for side in ("preflight", "preflight-lerobot") if args.lerobot_python else ("preflight",):
        info = _child(args, side)
        print(
            f"{side}: python {info.get('python')}, gpu {info.get('gpu')}, missing {info.get('missing', info)}"
        )
        print("  found: " + ", ".join(f"{k} {v}" for k, v in info.get("found", {}).items()))


def main() -> None:
    args = _parser().parse_args()
    if args.child:
        _run_child(args)
        return
    if args.preflight:
        _preflight(args)
        return
    info = json.loads((Path(args.data) / "dataset" / "meta" / "info.json").read_text())
    if args.loss_steps:
        write_order(args)
        if not _work_file(args, "init").exists():
            init = _child(args, "init")
            if "error" in init:
                raise SystemExit(f"writing the initial weights failed: {init['error']}")
    rows = {}
    for path in args.paths:
        rows[path] = _child(args, path) | {"setting": _setting(path, args.device)}
        print(json.dumps({k: v for k, v in rows[path].items() if k != "losses"}), flush=True)
    out = _write(args, rows, _meta_key(args, info))
    what = f"{args.loss_steps} steps, same inputs" if args.loss_steps else f"{args.steps} timed steps"
    print(f"\nPi0.5 {args.preset}, batch {args.batch}, {what}, {info['total_episodes']} episodes x "
          f"{info['total_frames'] // info['total_episodes']} frames, {args.device}; {out}")  # fmt: skip
    sys.path.insert(0, str(REPO))
    from forge_lightning.modules.embodied.config import Pi05Config

    config = Pi05Config.from_preset(args.preset)
    full = config.training_flops_per_sample(len(CAMERAS))
    print(f"model FLOPs per sample (forward + backward) at a {config.tokenizer_max_length}-token prompt: "
          f"{full / 1e12:.2f} TFLOP")  # fmt: skip
    for path, row in rows.items():
        if "profile" in row:
            from step_profile import describe

            print(f"profile {path}: " + "\n".join(describe(row["profile"])))
    for line in _summary(rows, bool(args.loss_steps)):
        print(line)
    flops = lambda prompt: config.training_flops_per_sample(len(CAMERAS), prompt or None)  # noqa: E731
    print(table(rows, args.loss_reference if args.loss_steps else None, flops))


if __name__ == "__main__":
    main()

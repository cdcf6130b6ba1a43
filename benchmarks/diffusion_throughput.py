"""Video-diffusion training throughput on one GPU: our WanDiffusionModule vs diffusers, side by side in one run.

The DiT is a Wan shape with random weights (nothing is downloaded), trained with the flow-matching loss on latents
of a real video size:

- ``wan2.1-1.3b`` (preset ``wan2.1-t2v-1.3b``): 480x832, 81 frames through the Wan 2.1 VAE (stride 4x8x8) ->
  latents ``[16, 21, 60, 104]``, patch 1x2x2 -> 21 x 30 x 52 = 32,760 tokens per video.
- ``wan2.2-5b`` (preset ``wan2.2-ti2v-5b``): the same 480x832x81 video through the Wan 2.2 VAE (stride 4x16x16,
  48 channels) -> ``[48, 21, 30, 52]`` -> 21 x 15 x 26 = 8,190 tokens (its native 704x1280x121 gives 27,280:
  ``--height 704 --width 1280 --frames 121``).
- ``debug`` (``--tiny``): the 2-block debug preset on a 5x32x32 video, for CPU checks.

Every video has 512 text tokens of width 4096 (UMT5-XXL; ``--text-tokens``). ``--frames / --height / --width``
change the video size (frames ``1 + 4k``, sides multiples of the VAE stride times the patch). Each child builds the
same inputs from ``--seed``: a pool of ``--clips`` latent clips and text embeddings, and per step the noise level,
noise and noised latents of our ``FlowMatching`` (shift ``--shift``), so every row trains on identical tensors.
Every row starts from the same weights: our ``WanDiT`` built on the meta device, materialised on the GPU and
initialised (``init_weights``) under ``--seed``; diffusers' rows load its state dict (the names are diffusers'),
so the rows' ``init_checksum`` match. Rows (``--rows``):

- ``diffusers:diffsynth``: diffusers' ``WanTransformer3DModel`` (same config), fp32 weights, bf16 autocast, SDPA,
  ``enable_gradient_checkpointing()``, ``torch.optim.AdamW`` (default implementation), mean-squared velocity error:
  how DiffSynth-Studio trains Wan.
- ``diffusers:bf16``: bf16 weights and AdamW on them, no checkpointing.
- ``ours:ac=selective,compile,attn=sdpa``: ``WanDiffusionModule`` with its ``performance`` section applied by
  ``apply_performance`` on its parallel plan, as the strategies do (kernels, SDPA backend order, activation
  checkpointing, per-block ``torch.compile``); fp32 master weights under bf16 autocast (what Lightning's
  ``bf16-mixed`` plugin does), fused AdamW, the module's ``FlowMatching.loss``. Options: ``ac=none|selective|full``
  (``performance.activation_checkpointing``) or ``ac=N`` (full checkpointing of the first N blocks only, the same
  transform on part of the plan), ``compile`` / ``eager`` (``performance.compile``; default: compiled on CUDA),
  ``attn=V``: ``sdpa`` (the default: SDPA, cuDNN first on CUDA), ``cudnn`` / ``flash`` / ``efficient`` / ``math``
  (``performance.attention.sdpa: [V]``), any other value becomes ``performance.attention.kernel: V`` (e.g.
  ``fa4``); a value this build's ``performance`` section does not accept fails that row with the config's error
  and the run goes on. Where ``performance.attention`` has that ``kernel`` option, the SDPA values set it to
  ``sdpa`` too, so that the row runs SDPA whatever ``auto`` would pick.
- ``forge-fit`` / ``forge-fit:ac=none``: the product path, ``python -m forge_lightning fit`` of the shape's recipe
  (``configs/diffusion/<model>/sft_fsdp2.yaml``) on one device from a synthetic feature cache
  (``benchmarks/diffusion_fit_row.py`` says what it changes); throughput from ``ThroughputMonitor``. Its noise
  draws are the module's own (not the other rows'), so its loss is not compared.

FLOPs per step are ``WanDiffusionModule.batch_stats``: ``6 * (N_video * S + N_text * L)`` for the matmuls (``N_video``
the weights of the patch embedding, the blocks (self- and cross-attention projections, FFN, but the cross-attention
keys / values) and the output projection, passed by each of the ``S`` video tokens; ``N_text`` the text embedder's
and the cross-attention key / value weights, passed by each of the ``L`` text tokens) plus attention
``3 * layers * (4 * S * S * D + 4 * S * L * D)`` (QK^T and AV, forward once and backward twice), per video; MFU
against 989 TFLOP/s. Peak memory is ``max_memory_allocated`` over the timed steps. Speed ratios are samples/s
against ``diffusers:diffsynth`` and ``diffusers:bf16`` of the same run.

    python benchmarks/diffusion_throughput.py --shape wan2.1-1.3b --steps 5 --warmup 2 --row-timeout 300 \\
        --rows diffusers:diffsynth diffusers:bf16 ours:ac=selective ours:ac=full ours:ac=none

``--loss-steps N`` trains the rows N steps on identical inputs from identical weights and compares the mean loss of
the last 20 steps with ``diffusers:diffsynth``'s (column "loss vs ref"), e.g. at a smaller video:

    python benchmarks/diffusion_throughput.py --shape wan2.1-1.3b --frames 17 --height 240 --width 416 \\
        --loss-steps 200 --lr 1e-4 --rows diffusers:diffsynth diffusers:bf16 ours:ac=selective

``--profile DIR`` records 2 steps of the first row after its timed steps with ``torch.profiler``: a gzipped Chrome
trace ``DIR/<row>.json.gz`` (``chrome://tracing``, Perfetto) and the top kernels printed (``step_profile.py``).

Each row runs in a child process of its own (clean peak memory and compile caches); a row that fails (out of
memory, a refused option) or runs past ``--row-timeout`` seconds is recorded as failed and the run goes on. Prints
one table last; writes ``benchmarks/results/diffusion_throughput_<shape>[_loss].json`` (``--out``) after every row;
``--append`` adds the rows to those already in ``--out`` (same shape, video and mode), so that rows run by several
commands (each within a time limit) share one table and its ratios. ``--tiny --device cpu`` checks the script on a
CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness  # this script's directory is on sys.path (last, once harness is imported)
import step_profile

REPO = Path(__file__).resolve().parents[1]
DIFFUSERS_ROW, OUR_ROW, FIT_ROW = "diffusers", "ours", "forge-fit"
ROWS = (DIFFUSERS_ROW, OUR_ROW, FIT_ROW)
DIFFUSERS_VARIANTS = ("diffsynth", "bf16")
REFERENCES = ("diffusers:diffsynth", "diffusers:bf16")
AC_CHOICES = ("none", "selective", "full")
SDPA_CHOICES = ("cudnn", "flash", "efficient", "math")
# The attention config's dense-kernel option an `attn=` value other than SDPA's goes to (e.g. `fa4`).
KERNEL_FIELD = "kernel"
SHAPES: dict[str, dict[str, Any]] = {
    # https://huggingface.co/Wan-AI/Wan2.1-T2V-1.3B-Diffusers: VAE stride 4x8x8, 16 latent channels
    "wan2.1-1.3b": {"preset": "wan2.1-t2v-1.3b", "stride": (4, 8, 8), "video": (81, 480, 832), "text": 512},
    # https://huggingface.co/Wan-AI/Wan2.2-TI2V-5B-Diffusers: VAE stride 4x16x16, 48 latent channels
    "wan2.2-5b": {"preset": "wan2.2-ti2v-5b", "stride": (4, 16, 16), "video": (81, 480, 832), "text": 512},
    "debug": {
        "preset": "debug",
        "overrides": {"in_channels": 4, "out_channels": 4},
        "stride": (4, 8, 8),
        "video": (5, 32, 32),
        "text": 8,
    },
}
"""The DiT preset, the VAE's (frame, height, width) stride, the default video (frames, height, width) and the text
tokens of each shape."""
# Python packages each row imports (forge_lightning's own dependencies for every row; the forge-fit row runs the CLI).
NEEDS = {
    DIFFUSERS_ROW: ("torch", "lightning", "safetensors", "xxhash", "yaml", "diffusers"),
    OUR_ROW: ("torch", "lightning", "safetensors", "xxhash", "yaml"),
    FIT_ROW: ("torch", "lightning", "safetensors", "xxhash", "yaml", "jsonargparse"),
}


# ----- shapes and inputs (identical in every child) ----------------------------------------------------------
def shape_name(args: argparse.Namespace) -> str:
    return "debug" if args.tiny else args.shape


def dit_config(args: argparse.Namespace) -> Any:
    """The shape's :class:`WanDiTConfig`."""
    from forge_lightning.modules.diffusion import preset

    shape = SHAPES[shape_name(args)]
    return preset(shape["preset"], **shape.get("overrides", {}))


def latent_shape(args: argparse.Namespace, config: Any) -> tuple[int, int, int, int]:
    """``(C, F, H, W)`` of the video's latents.

    Raises:
        SystemExit: a video size the VAE stride and the patch do not divide.
    """
    st, sh, sw = SHAPES[shape_name(args)]["stride"]
    pt, ph, pw = config.patch_size
    if (args.frames - 1) % st or args.height % (sh * ph) or args.width % (sw * pw):
        raise SystemExit(
            f"--frames {args.frames} --height {args.height} --width {args.width}: need 1 + {st}k frames, a height "
            f"divisible by {sh * ph} and a width divisible by {sw * pw} (VAE stride x patch)"
        )
    frames = 1 + (args.frames - 1) // st
    if frames % pt:
        raise SystemExit(f"--frames {args.frames}: {frames} latent frames do not divide by the patch ({pt})")
    return config.in_channels, frames, args.height // sh, args.width // sw


def tokens_per_video(config: Any, latents: tuple[int, int, int, int]) -> int:
    _, F, H, W = latents
    pt, ph, pw = config.patch_size
    return (F // pt) * (H // ph) * (W // pw)


def make_steps(args: argparse.Namespace, config: Any, count: int) -> list[Any]:
    """``count`` steps of ``FlowMatchingSample`` s and their text embeddings, on the CPU: ``--batch`` clips of the
    seeded pool per step, each step's noise levels and noise from a generator of its own."""
    import torch

    from forge_lightning.modules.diffusion import FlowMatching, FlowMatchingConfig
    from forge_lightning.modules.diffusion.module import sample_generator

    latents = latent_shape(args, config)
    generator = torch.Generator().manual_seed(args.seed)
    clips = torch.randn((args.clips, *latents), generator=generator)
    texts = 0.1 * torch.randn((args.clips, args.text_tokens, config.text_dim), generator=generator)
    flow = FlowMatching(FlowMatchingConfig(shift=args.shift))
    steps = []
    for step in range(count):
        rows = [(step * args.batch + row) % args.clips for row in range(args.batch)]
        sample = flow.prepare(clips[rows], generator=sample_generator(args.seed, "bench", step))
        steps.append((sample, texts[rows]))
    return steps


def _to(step: Any, device: str, dtype: Any) -> Any:
    sample, text = step
    moved = {
        f.name: None if getattr(sample, f.name) is None else getattr(sample, f.name).to(device)
        for f in dataclasses.fields(sample)
    }
    moved["x_t"] = moved["x_t"].to(dtype)
    return type(sample)(**moved), text.to(device, dtype)


def init_dit(config: Any, device: str, seed: int, dit: Any = None) -> Any:
    """Our DiT's initial weights, the same in every row: built on the meta device (or ``dit``, already on it),
    materialised on ``device`` and initialised under ``seed``."""
    import torch

    from forge_lightning.modules.diffusion import WanDiT

    if dit is None:
        with torch.device("meta"):
            dit = WanDiT(config)
    dit.to_empty(device=device)
    torch.manual_seed(seed)
    dit.init_weights()
    return dit


def _checksum(model: Any) -> float:
    """Sum of every parameter (equal across rows that start from the same weights)."""
    import torch

    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


# ----- the rows -----------------------------------------------------------------------------------------------
def build_diffusers(args: argparse.Namespace, variant: str, config: Any) -> tuple[Any, Callable, dict, Any]:
    """diffusers' ``WanTransformer3DModel`` with our initial weights; its loss, settings and input dtype."""
    import torch
    import torch.nn.functional as F
    from diffusers import WanTransformer3DModel

    bf16 = variant == "bf16"
    ours = init_dit(config, args.device, args.seed)
    with torch.device(args.device):
        model = WanTransformer3DModel(
            **{k: v for k, v in config.to_diffusers().items() if not k.startswith("_")}
        )
    model.load_state_dict(ours.state_dict())
    del ours
    if bf16:
        model.to(torch.bfloat16)
    else:
        model.enable_gradient_checkpointing()
    model.train()
    autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=not bf16)

    def loss_fn(sample: Any, text: Any) -> Any:
        with autocast:
            pred = model(sample.x_t, sample.timestep, text, return_dict=False)[0]
        return F.mse_loss(pred.float(), sample.target.float())

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    setting = (
        "bf16 weights, SDPA, no checkpointing, AdamW"
        if bf16
        else "fp32 weights + bf16 autocast, SDPA, gradient checkpointing, AdamW"
    )
    info = {"setting": setting, "attention": "diffusers' SDPA processor, torch's backend order"}
    return model, loss_fn, {**info, "optimizer": optimizer}, torch.bfloat16 if bf16 else torch.float32


def our_performance(settings: argparse.Namespace) -> dict[str, Any]:
    """The ``performance`` section of an ``ours`` row (see the module docstring for the options)."""
    from forge_lightning.performance.config import AttentionConfig

    performance: dict[str, Any] = {}
    if settings.ac in AC_CHOICES:
        performance["activation_checkpointing"] = settings.ac
    if settings.compile is not None:
        performance["compile"] = settings.compile
    has_kernel = KERNEL_FIELD in {f.name for f in dataclasses.fields(AttentionConfig)}
    if settings.attn in SDPA_CHOICES:
        performance["attention"] = {"sdpa": [settings.attn]}
    elif settings.attn != "sdpa":
        performance["attention"] = {KERNEL_FIELD: settings.attn}
    if has_kernel and settings.attn in ("sdpa", *SDPA_CHOICES):  # SDPA, whatever `auto` would pick
        performance.setdefault("attention", {})[KERNEL_FIELD] = "sdpa"
    return performance


def performance_config(settings: argparse.Namespace) -> Any:
    """The ``PerformanceConfig`` of an ``ours`` row.

    Raises:
        ValueError: this build's ``performance`` section refuses the row's options (e.g. an unknown ``attn=``).
    """
    from forge_lightning.performance import PerformanceConfig

    section = our_performance(settings)
    try:
        return PerformanceConfig(**section)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"attn={settings.attn}: performance {section} is refused by this build: {error}"
        ) from None


def refusal(args: argparse.Namespace, row: str) -> dict[str, Any] | None:
    """The failed result of an ``ours`` row whose ``performance`` section is refused, found before starting it."""
    name, settings = parse_row(row, args)
    if name != OUR_ROW:
        return None
    try:
        performance_config(settings)
    except ValueError as error:
        return {"row": row, "error": f"ValueError: {error}".splitlines()[0]}
    return None


def build_ours(
    args: argparse.Namespace, settings: argparse.Namespace, config: Any
) -> tuple[Any, Callable, dict, Any]:
    """``WanDiffusionModule`` with fp32 masters and its ``performance`` applied; its loss, settings, input dtype."""
    import torch

    from forge_lightning.contracts import Component, ParallelPlan
    from forge_lightning.modules.diffusion import WanDiffusionModule
    from forge_lightning.performance import apply_performance, resolve
    from forge_lightning.performance.transforms import apply_activation_checkpointing

    performance = performance_config(settings)
    with torch.device("meta"):
        module = WanDiffusionModule(
            config=config, flow_matching={"shift": args.shift}, performance=performance
        )
    init_dit(config, args.device, args.seed, dit=module.dit)
    module.train()
    if settings.ac not in AC_CHOICES:  # ac=N: the first N blocks, fully
        blocks = module.dit.repeated_blocks()[: int(settings.ac)]
        apply_activation_checkpointing(
            ParallelPlan(components=[Component(name="dit", module=module.dit, blocks=blocks)]), "full"
        )
    apply_performance(module.parallel_plan(), module.performance, args.device)
    resolved = resolve(module.performance, args.device)
    device_type = torch.device(args.device).type

    def loss_fn(sample: Any, text: Any) -> Any:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            pred = module.dit(sample.x_t, sample.timestep, text)
        return module.flow.loss(pred, sample).mean()

    implementation = (
        {resolved.optimizer: True} if resolved.optimizer in ("fused", "foreach") else {"foreach": False}
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, **implementation)
    ac = settings.ac if settings.ac in AC_CHOICES else f"first {settings.ac} blocks full"
    compiled = "compiled blocks" if resolved.compile else "eager"
    setting = f"fp32 masters + bf16 autocast, {compiled}, AC {ac}, AdamW {resolved.optimizer}"
    sdpa = ", ".join(resolved.sdpa) if resolved.sdpa else "torch's default"
    attention = f"attn={settings.attn}; SDPA order {sdpa}"
    return (
        module,
        loss_fn,
        {"setting": setting, "attention": attention, "optimizer": optimizer},
        torch.float32,
    )


def flops_per_step(args: argparse.Namespace, config: Any) -> dict[str, float]:
    """``WanDiffusionModule.batch_stats`` of one step's batch (a meta-device module: it reads shapes only)."""
    import torch

    from forge_lightning.modules.diffusion import WanDiffusionModule

    with torch.device("meta"):
        module = WanDiffusionModule(config=config)
        batch = {
            "latents": torch.empty((args.batch, *latent_shape(args, config))),
            "text_embeddings": torch.empty((args.batch, args.text_tokens, config.text_dim)),
        }
    return module.batch_stats(batch)


def parse_row(row: str, args: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """The row's name and its settings (``ours:ac=selective,eager,attn=sdpa``, ``diffusers:bf16``).

    Raises:
        SystemExit: an unknown row or option.
    """
    name, _, options = row.partition(":")
    if name not in ROWS:
        raise SystemExit(f"--rows {row!r}: unknown row {name!r}; rows are {', '.join(ROWS)}")
    settings = argparse.Namespace(variant=None, ac=args.activation_checkpointing, compile=None, attn="sdpa")
    if name == FIT_ROW:
        settings.ac = None  # the recipe's
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        if name == DIFFUSERS_ROW and option in DIFFUSERS_VARIANTS and settings.variant is None:
            settings.variant = option
        elif (
            name != DIFFUSERS_ROW
            and key == "ac"
            and (value in AC_CHOICES or (name == OUR_ROW and value.isdigit()))
        ):
            settings.ac = value
        elif name == OUR_ROW and option in ("eager", "compile"):
            settings.compile = option == "compile"
        elif name == OUR_ROW and key == "attn" and re.fullmatch(r"[a-z0-9_]+", value):
            settings.attn = value
        else:
            takes = {
                DIFFUSERS_ROW: " or ".join(DIFFUSERS_VARIANTS),
                OUR_ROW: f"ac={'|'.join(AC_CHOICES)}|N, eager|compile, attn=sdpa|{'|'.join(SDPA_CHOICES)}|<kernel>",
                FIT_ROW: f"ac={'|'.join(AC_CHOICES)}",
            }[name]
            raise SystemExit(f"--rows {row!r}: unknown option {option!r}; {name} takes {takes}")
    if name == DIFFUSERS_ROW and settings.variant is None:
        raise SystemExit(
            f"--rows {row!r}: name the variant, {' or '.join(f'{name}:{v}' for v in DIFFUSERS_VARIANTS)}"
        )
    return name, settings


def run_row(args: argparse.Namespace, row: str) -> dict[str, Any]:
    """Train one row (``--warmup`` + ``--steps`` steps, or ``--loss-steps``) and measure it."""
    import torch

    name, settings = parse_row(row, args)
    config = dit_config(args)
    latents = latent_shape(args, config)
    if name == FIT_ROW:
        import diffusion_fit_row

        fit = diffusion_fit_row.run(args, settings, shape_name(args), latents)
        return {"row": row, **fit, "gpu": harness.machine(args.device.startswith("cuda"))}
    cuda = args.device.startswith("cuda")
    count = args.loss_steps or args.warmup + args.steps
    profile = 2 if args.profile and row == args.rows[0] else 0
    steps = make_steps(args, config, count + profile)
    if name == DIFFUSERS_ROW:
        model, loss_fn, info, dtype = build_diffusers(args, settings.variant, config)
    else:
        model, loss_fn, info, dtype = build_ours(args, settings, config)
    optimizer = info.pop("optimizer")
    init_checksum = _checksum(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = [_to(step, args.device, dtype) for step in steps]
    losses = []

    def step(batch: Any) -> None:
        loss = loss_fn(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    timer = harness.run_steps(step, batches[:count], min(args.warmup, count - 1), cuda)
    peak = harness.peak_memory_gb(cuda)
    result = {"profile": _profile(args, row, step, batches[count:], count, cuda)} if profile else {}
    stats = flops_per_step(args, config)
    tflops = harness.tflops(stats["flops"] / timer.step_s)
    loss_values = [float(x) for x in losses[:count]]  # the profiled steps after them left out
    return {
        "row": row,
        **info,
        "step_s": timer.step_s,
        "median_step_s": timer.median_step_s,
        "samples_per_s": timer.rate(args.batch),
        "tokens_per_s": timer.rate(stats["tokens"]),
        "tflops": tflops,
        "mfu": harness.mfu(tflops),
        "peak_mem_gb": peak,
        "timed_steps": timer.steps,
        "latents": [args.batch, *latents],
        "tokens_per_video": tokens_per_video(config, latents),
        "flops_per_step": stats["flops"],
        "first_loss": loss_values[0],
        "last_loss": loss_values[-1],
        "losses": loss_values,
        "init_checksum": init_checksum,
        "gpu": harness.machine(cuda),
        "params": sum(p.numel() for p in model.parameters()),
        **result,
    }


def file_name(row: str) -> str:
    """A row's name as a file name of letters, digits, ``.``, ``_`` and ``-`` (``ours:ac=full`` -> ``ours_ac_full``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", row)


def _profile(
    args: argparse.Namespace, row: str, step: Callable, batches: list, done: int, cuda: bool
) -> dict:
    """Two more steps under ``torch.profiler``: the Chrome trace in ``--profile`` and the kernel summary."""
    folder = Path(args.profile)
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / (file_name(row) + ".json.gz")
    profiler = step_profile.StepProfiler(done, len(batches), cuda, trace=str(trace))
    profiler.after_step(done)
    for extra, batch in enumerate(batches, done + 1):
        step(batch)
        profiler.after_step(extra)
    return {**profiler.summary, "trace": str(trace)}


# ----- the parent: children, table, JSON --------------------------------------------------------------------
def _child(args: argparse.Namespace, row: str) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", row, *sys.argv[1:]]
    run = harness.run_child(
        command, env, timeout=args.row_timeout, timeout_message="row killed after {:.0f} s"
    )
    log = Path(args.work_dir) / "logs" / (file_name(row) + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(run.stdout + run.stderr)
    result = run.result()
    if result is None:
        return {"row": row, "error": run.failure(), "log": str(log), "seconds": run.seconds}
    return {**result, "seconds": run.seconds}


def _earlier_rows(out: Path, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """``--append``: the rows of an earlier run's JSON at ``out``, which must be of the same shape and video.

    Raises:
        SystemExit: ``out`` is of another shape, video size or mode.
    """
    if not out.is_file():
        return []
    earlier = json.loads(out.read_text())
    keys = ("shape", "video", "latents", "loss_steps")
    differ = [k for k in keys if earlier["meta"].get(k) != meta.get(k)]
    if differ:
        found = ", ".join(f"{k} {earlier['meta'].get(k)!r} (this run: {meta.get(k)!r})" for k in differ)
        raise SystemExit(f"--append: {out} holds another run ({found}): give another --out")
    meta["earlier_commands"] = [*earlier["meta"].get("earlier_commands", []), earlier["meta"]["command"]]
    return earlier["results"]


def tail_loss(row: dict[str, Any], steps: int = 20) -> float:
    """Mean loss of the last ``steps`` steps (less noisy than the last step alone)."""
    tail = row["losses"][-steps:]
    return sum(tail) / len(tail)


def table(results: list[dict[str, Any]], loss: bool) -> str:
    """One line per row. Speed: samples/s against each diffusers reference. Loss: the last-20 mean loss against
    the reference's, ``diffusers:diffsynth`` (or the first diffusers row; its line says ``ref``)."""
    refs = {name: harness.reference_row(results, lambda r, n=name: r["row"] == n) for name in REFERENCES}
    if loss:
        ref = refs["diffusers:diffsynth"] or harness.reference_row(
            results, lambda r: r["row"].startswith(DIFFUSERS_ROW)
        )
        columns = ["row", "setting", "first loss", "last-20 loss", "loss vs ref (%)"]
    else:
        columns = [
            "row",
            "setting",
            "s/step",
            "samples/s",
            "TFLOP/s",
            "MFU",
            "peak GB",
            *(f"vs {n}" for n in refs),
        ]
    lines = []
    for r in results:
        if "error" in r:
            lines.append([r["row"], harness.failed(r["error"])])
        elif loss:
            change = "ref" if r is ref else harness.change(tail_loss(r), tail_loss(ref)) if ref else "-"
            lines.append([r["row"], r["setting"], f"{r['first_loss']:.4f}", f"{tail_loss(r):.4f}", change])
        else:
            line = [
                r["row"],
                r["setting"],
                f"{r['step_s']:.3f}",
                f"{r['samples_per_s']:.3f}",
                f"{r['tflops']:.1f}",
            ]
            line += [f"{100 * r['mfu']:.1f}%", f"{r['peak_mem_gb']:.1f}"]
            line += [
                harness.ratio(r["samples_per_s"], (ref or {}).get("samples_per_s")) for ref in refs.values()
            ]
            lines.append(line)
    return harness.markdown_table(columns, lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="wan2.1-1.3b", choices=list(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="the debug shape (CPU checks)")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=["diffusers:diffsynth", "diffusers:bf16", "ours:ac=selective", "ours:ac=full"],
        help=f"rows: {', '.join(REFERENCES)}, ours:ac={'|'.join(AC_CHOICES)}|N,eager|compile,attn=..., "
        f"forge-fit[:ac=...] (module docstring)",
    )
    parser.add_argument("--frames", type=int, default=None, help="video frames (default: the shape's, 81)")
    parser.add_argument("--height", type=int, default=None, help="video height (default: the shape's, 480)")
    parser.add_argument("--width", type=int, default=None, help="video width (default: the shape's, 832)")
    parser.add_argument("--text-tokens", type=int, default=None, help="text tokens per video (default 512)")
    parser.add_argument("--batch", type=int, default=1, help="videos per step")
    parser.add_argument("--clips", type=int, default=8, help="distinct latent clips the steps cycle through")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
    parser.add_argument(
        "--loss-steps", type=int, default=0, help="compare losses over this many steps instead"
    )
    parser.add_argument("--activation-checkpointing", default="selective", help="ours rows' default ac=")
    parser.add_argument("--shift", type=float, default=5.0, help="flow-matching shift of the noise levels")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--row-timeout", type=float, default=300.0, help="seconds before a row is killed")
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the rows to those of --out (a run of the same shape and video)",
    )
    parser.add_argument("--profile", default=None, metavar="DIR", help="profile 2 steps of the first row")
    parser.add_argument("--work-dir", default="data/diffusion_work", help="feature cache, recipe and logs")
    parser.add_argument("--out", default=None, help="JSON output (default benchmarks/results/...)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    shape = SHAPES[shape_name(args)]
    for name, default in zip(("frames", "height", "width"), shape["video"], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.text_tokens = args.text_tokens or shape["text"]
    for name in ("steps", "batch", "clips", "text_tokens", "frames", "height", "width"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1")
    if args.activation_checkpointing not in AC_CHOICES:
        raise SystemExit(f"--activation-checkpointing ({args.activation_checkpointing}): one of {AC_CHOICES}")
    for row in args.rows:
        name, _ = parse_row(row, args)
        if name == FIT_ROW and args.loss_steps:
            raise SystemExit(f"--loss-steps: the {FIT_ROW} row draws its own noise; leave it out")
    return args


def missing_packages(rows: list[str], args: argparse.Namespace) -> list[str]:
    """The packages the rows import that this Python lacks (checked before any row starts)."""
    import importlib.util

    needed = {module for row in rows for module in NEEDS[parse_row(row, args)[0]]}
    return sorted(m for m in needed if importlib.util.find_spec(m) is None)


def main() -> None:
    args = parse_args()
    if args.child:
        with harness.errors_reported():
            harness.emit_result(run_row(args, args.child))
        return
    missing = missing_packages(args.rows, args)
    if missing:
        raise SystemExit(
            f"the rows need Python packages this interpreter lacks: {', '.join(missing)} (install them)"
        )
    sys.path.insert(0, str(REPO))
    config = dit_config(args)
    latents = latent_shape(args, config)
    shape = shape_name(args)
    out = Path(
        args.out
        or REPO
        / "benchmarks"
        / "results"
        / f"diffusion_throughput_{shape}{'_loss' if args.loss_steps else ''}.json"
    )
    size = f"{args.frames}x{args.height}x{args.width}"
    describe = (
        f"{shape} (preset {SHAPES[shape]['preset']}), video {size} -> latents {list(latents)}, "
        f"{tokens_per_video(config, latents)} tokens per video, {args.text_tokens} text tokens, batch {args.batch}"
    )
    print(describe, flush=True)
    # The device's name comes from the rows: CUDA initialised here would hold GPU memory the rows need.
    meta = {
        "gpu": None,
        **harness.run_meta(__file__),
        "shape": shape,
        "video": size,
        "latents": list(latents),
    }
    meta.update(tokens_per_video=tokens_per_video(config, latents), loss_steps=args.loss_steps)
    results = _earlier_rows(out, meta) if args.append else []
    for row in args.rows:
        results.append(refusal(args, row) or _child(args, row))
        meta["gpu"] = meta["gpu"] or results[-1].get("gpu")
        shown = {k: v for k, v in results[-1].items() if k not in ("losses", "profile")}
        print(json.dumps(shown), flush=True)
        if "profile" in results[-1]:
            print("\n".join(step_profile.describe(results[-1]["profile"])), flush=True)
        harness.write_json(
            out, {"meta": meta, "results": results}
        )  # after every row: a cut-off run keeps them
    what = (
        f"{args.loss_steps} steps, same inputs and initial weights"
        if args.loss_steps
        else f"{args.steps} timed steps"
    )
    print(f"\n{describe}, {what}, {meta['gpu']}, torch {meta['torch']}; {out}")
    print(table(results, loss=bool(args.loss_steps)))


if __name__ == "__main__":
    main()

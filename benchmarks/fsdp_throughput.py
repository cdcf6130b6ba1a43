"""Multi-GPU training throughput: our FSDP2Strategy / DDPStrategy runs vs transformers under plain FSDP2 / DDP.

Each path is one ``torchrun`` launch on the same GPUs and the same random tokens, timed after warm-up:

- ``forge-fsdp2`` / ``forge-fsdp2-fp8`` / ``forge-ddp``: ``CausalLM`` trained by Lightning's ``Trainer`` with
  ``FSDP2Strategy`` (bf16 parameters over fp32 masters, fp32 reduce) or ``DDPStrategy``, with the module's
  ``performance`` defaults (compiled blocks, cuDNN attention, Triton fused loss; ``-fp8``: torchao float8 with
  FP8 all-gather) — the path a user runs with ``forge fit``. Compressed-communication variants:
  ``forge-fsdp2-rs-bf16`` / ``-rs-fp8`` (``gradient_reduce``), ``forge-fsdp2-delta`` (``param_all_gather:
  delta_fp8``), ``forge-ddp-bf16`` / ``-fp8`` (``comm_hook``); ``forge-ddp-torch-defaults``: DDP with torch's
  bucket defaults. Layout variants: ``forge-fsdp2-keep`` / ``forge-fsdp2-fp8-keep`` (``reshard_after_forward:
  false``: no backward re-gather, the unsharded weights stay between forward and backward), ``forge-fsdp2-sac`` /
  ``forge-fsdp2-fp8-sac`` (selective activation checkpointing, for larger micro-batches).
- ``hf-fsdp2`` / ``hf-fsdp2-ac``: what a user writes today: the transformers model with ``fully_shard`` per
  decoder layer and on the root (same mixed precision), SDPA attention, optionally gradient checkpointing,
  fused AdamW, a plain loop. ``hf-ddp``: the transformers model under ``DistributedDataParallel`` with bf16
  autocast over fp32 weights.

A path may carry its own micro-batch as ``name@N``.

    python benchmarks/fsdp_throughput.py --gpus 2 --shape llama3.1-8b --seq 8192 --batch 1 \
        --paths forge-fsdp2 forge-fsdp2-fp8 hf-fsdp2 hf-fsdp2-ac@2
    python benchmarks/fsdp_throughput.py --gpus 1 2 --shape llama3.2-1b --seq 4096 --batch 4 \
        --paths forge-fsdp2 forge-ddp                      # scaling 1 -> 2 GPUs
    python benchmarks/fsdp_throughput.py --gpus 2 --shape quickstart --seq 128 --batch 2 --loss-steps 200 \
        --paths forge-fsdp2 forge-fsdp2-rs-fp8 forge-ddp forge-ddp-fp8   # losses on real text vs exact twins

Prints one table last (tokens/s per GPU, TFLOP/s, MFU against 989, peak memory, bytes each rank sends per step,
scaling vs 1 GPU, or with ``--loss-steps`` the last-20 mean loss against the exact twin) and writes
benchmarks/results/fsdp_throughput_<shape>_<seq>[_loss].json after every launch. ``--device cpu`` runs on gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import harness  # this script's directory is on sys.path
import step_profile

# forge path -> (strategy, strategy options, performance section)
FORGE_PATHS: dict[str, tuple[str, dict, dict]] = {
    "forge-fsdp2": ("fsdp2", {}, {}),
    "forge-fsdp2-fp8": ("fsdp2", {}, {"fp8": {"recipe": "tensorwise", "fsdp_all_gather": True}}),
    "forge-fsdp2-keep": ("fsdp2", {"reshard_after_forward": False}, {}),
    "forge-fsdp2-fp8-keep": (
        "fsdp2",
        {"reshard_after_forward": False},
        {"fp8": {"recipe": "tensorwise", "fsdp_all_gather": True}},
    ),
    "forge-fsdp2-sac": ("fsdp2", {}, {"activation_checkpointing": "selective"}),
    "forge-fsdp2-fp8-sac": (
        "fsdp2",
        {},
        {"fp8": {"recipe": "tensorwise", "fsdp_all_gather": True}, "activation_checkpointing": "selective"},
    ),
    "forge-fsdp2-rs-bf16": ("fsdp2", {"gradient_reduce": "bf16"}, {}),
    "forge-fsdp2-rs-fp8": ("fsdp2", {"gradient_reduce": "fp8"}, {}),
    "forge-fsdp2-delta": ("fsdp2", {"param_all_gather": "delta_fp8"}, {}),
    "forge-ddp": ("ddp", {}, {}),
    "forge-ddp-bf16": ("ddp", {"comm_hook": "bf16"}, {}),
    "forge-ddp-fp8": ("ddp", {"comm_hook": "fp8"}, {}),
    "forge-ddp-torch-defaults": ("ddp", {"gradient_as_bucket_view": False, "bucket_cap_mb": 25}, {}),
}
HF_PATHS = ("hf-fsdp2", "hf-fsdp2-ac", "hf-ddp")
# compressed path -> the exact path its loss is compared with
EXACT_TWIN = {
    "forge-fsdp2-rs-bf16": "forge-fsdp2",
    "forge-fsdp2-rs-fp8": "forge-fsdp2",
    "forge-fsdp2-delta": "forge-fsdp2",
    "forge-ddp-bf16": "forge-ddp",
    "forge-ddp-fp8": "forge-ddp",
}


def split_path(spec: str) -> tuple[str, int | None]:
    """``name`` or ``name@micro_batch`` -> (name, micro-batch or ``None`` for ``--batch``)."""
    name, _, batch = spec.partition("@")
    if name not in FORGE_PATHS and name not in HF_PATHS:
        raise SystemExit(f"unknown path {name!r}; choose from {sorted(FORGE_PATHS) + list(HF_PATHS)}")
    return name, int(batch) if batch else None


# ----- child: one path on every rank -----------------------------------------------------------------------
def _steps(args) -> int:
    """Steps a launch trains: the warm-up, the timed steps and then the ``--profile`` steps (or ``--loss-steps``)."""
    return args.loss_steps or args.warmup + args.steps + args.profile


def _timer(args, cuda: bool) -> harness.StepTimer:
    """Times the ``--steps`` steps after the warm-up (with ``--loss-steps``: every step after it)."""
    timed = args.loss_steps - args.warmup if args.loss_steps else args.steps
    return harness.StepTimer(args.warmup, timed, cuda)


def _tokens(args, vocab: int, rank: int, world: int):
    """This rank's batches: random tokens, or with ``--loss-steps`` its share of the quick-start corpus windows."""
    import torch

    if not args.loss_steps:
        generator = torch.Generator().manual_seed(1000 + rank)
        return torch.randint(0, vocab, (_steps(args), args.batch, args.seq + 1), generator=generator)
    from llm_throughput import _text_batches

    batches = _text_batches(args.data_dir, _steps(args) * world, args.batch, args.seq, "cpu")[rank::world]
    if max(int(b.max()) for b in batches) >= vocab:
        raise SystemExit(f"the corpus tokenizer's ids exceed {args.shape}'s vocab_size ({vocab})")
    return torch.stack(batches)


def _comm_bytes(strategy, params: int, world: int, steps: int) -> dict:
    """Bytes one rank sends per step for parameters and gradients: counted where a compressed collective ran,
    from the collective's formula where the exact one did (FSDP2: :func:`_fsdp_gather_bytes` and an fp32
    reduce-scatter; DDP: an fp32 ring all-reduce)."""
    from forge_lightning.strategies import FSDP2Strategy

    share = (world - 1) / world
    if isinstance(strategy, FSDP2Strategy):
        comm = strategy._comm
        if comm and comm.all_gather:
            gather = comm.all_gather.stats.bytes_sent / steps
        else:
            gather = share * _fsdp_gather_bytes(strategy.lightning_module, strategy.reshard_after_forward)
        grads = comm.reduce_scatter.bytes_sent / steps if comm and comm.reduce_scatter else share * 4 * params
        return {"param_bytes_per_step": gather, "grad_bytes_per_step": grads}
    state = strategy.comm_state
    grads = state.bytes_sent / steps if state is not None else 2 * share * 4 * params
    return {"param_bytes_per_step": 0.0, "grad_bytes_per_step": grads}


def _fsdp_gather_bytes(root, reshard_after_forward) -> float:
    """Bytes of one step's exact FSDP2 all-gathers, whole-tensor: each ``fully_shard`` unit's parameters once in
    forward and, if it reshards after forward (blocks with ``reshard_after_forward``; never the root), again in
    backward; bf16 (2 bytes) or, for weights torchao casts for its float8 all-gather, 1 byte (plus one fp32 scale
    per tensor, negligible). A rank sends ``(world - 1) / world`` of this."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    total = 0.0
    for unit in units:
        inner = {
            id(p)
            for sub in unit.modules()
            if sub is not unit and isinstance(sub, FSDPModule)
            for p in sub.parameters()
        }
        gathers = 2 if unit is not root and reshard_after_forward else 1
        for param in unit.parameters():
            if id(param) in inner:
                continue
            local = getattr(param, "_local_tensor", param)
            width = 1 if type(local).__name__.startswith("WeightWithDynamicFloat8") else 2
            total += gathers * width * param.numel()
    return total


def _run_forge(args, path: str, tokens) -> tuple[harness.StepTimer, list[float], dict]:
    import lightning.pytorch as pl
    import torch

    from forge_lightning.modules.llm import CausalLM
    from forge_lightning.strategies import DDPStrategy, FSDP2Strategy

    cuda = args.device == "cuda"
    kind, options, performance = FORGE_PATHS[path]
    if args.eager:
        performance = {**performance, "compile": False}
    pl.seed_everything(0, verbose=False)
    hparams = {"config": args.shape, "performance": performance, "optimizer": {"lr": args.lr}}
    if args.loss_steps:
        hparams["scheduler"] = {"name": "constant", "warmup_steps": 20}
    if kind == "ddp":  # DDP replicates a materialized model; FSDP2 materializes its shards itself
        module = CausalLM(**hparams)
        strategy, precision = DDPStrategy(**options), "bf16-mixed"
    else:
        with torch.device("meta"):
            module = CausalLM(**hparams)
        strategy = FSDP2Strategy(param_dtype="bf16", reduce_dtype="fp32", **options)
        precision = "32-true"
    timer = _timer(args, cuda)
    profile = args.profile if int(os.environ.get("RANK", "0")) == 0 else 0
    profiler = step_profile.StepProfiler(args.warmup + args.steps, profile, cuda)
    losses = []

    class Timing(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].detach())
            timer.after_step(batch_idx + 1)
            profiler.after_step(batch_idx + 1)

    batches = [
        {"input_ids": t[:, :-1], "labels": t[:, 1:], "step_tokens": torch.tensor(t[:, 1:].numel())}
        for t in tokens
    ]
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        precision=precision,
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timing()],
        use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    params = sum(p.numel() for p in module.parameters())
    comm = _comm_bytes(strategy, params, trainer.world_size, len(batches))
    if profiler.summary:
        comm["profile"] = profiler.summary
    return timer, [float(x) for x in losses], comm


def _run_hf(args, path: str, tokens) -> tuple[harness.StepTimer, list[float], dict]:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from forge_lightning.modules.llm import LLMConfig

    device = torch.device(args.device, int(os.environ["LOCAL_RANK"]) if args.device == "cuda" else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    hf_config = transformers.AutoConfig.for_model(**LLMConfig.from_preset(args.shape).to_hf())
    hf_config._attn_implementation = "sdpa"
    if path == "hf-ddp":
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
        if path == "hf-fsdp2-ac":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        model.to_empty(device=device)
        # Initialise the local shards directly: DTensor random ops re-synchronise RNG state per call, which
        # takes minutes at 8B. The values do not matter for throughput (the timer starts after warm-up).
        with torch.no_grad():
            for name, param in model.named_parameters():
                local = param.to_local()
                if "norm" in name:
                    local.fill_(1.0)
                else:
                    local.normal_(0.0, 0.02)
        # RoPE frequencies are a buffer FSDP does not manage: rebuild them on the device.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.device == "cuda")
    timer = _timer(args, device.type == "cuda")
    losses = []
    for step, t in enumerate(tokens):
        t = t.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=path == "hf-ddp"):
            loss = model(input_ids=t[:, :-1], labels=t[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        timer.after_step(step + 1)
    return timer, [float(x) for x in losses], {}


def child(args) -> None:
    from forge_lightning.modules.llm import LLMConfig, llm_flops_per_token

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = LLMConfig.from_preset(args.shape)
    run = _run_forge if args.child in FORGE_PATHS else _run_hf
    with harness.errors_reported():
        tokens = _tokens(args, config.vocab_size, rank, world)
        timer, losses, comm = run(args, args.child, tokens)
    tokens_per_gpu = timer.rate(args.batch * args.seq)
    tflops = harness.tflops(tokens_per_gpu * llm_flops_per_token(config, args.seq))
    result = {
        "path": args.child,
        "gpus": world,
        "batch": args.batch,
        "tokens_per_s_per_gpu": tokens_per_gpu,
        "tflops": tflops,
        "mfu": harness.mfu(tflops),
        "peak_mem_gb": harness.peak_memory_gb(args.device == "cuda"),
        "step_s": timer.step_s,
        **comm,
    }
    if args.loss_steps:
        result.update(last20_mean_loss=sum(losses[-20:]) / len(losses[-20:]), losses=losses)
    if rank == 0:
        harness.emit_result(result)


# ----- parent: one torchrun per (path, GPU count) --------------------------------------------------------
# The error of a launch stopped at --launch-timeout (megatron_throughput.py's launches too).
LAUNCH_TIMEOUT = "launch killed after {:.0f} s (--launch-timeout)"


def _launch(args, spec: str, gpus: int) -> dict:
    path, batch = split_path(spec)
    child_args = [*sys.argv[1:], "--child", path, "--batch", str(batch or args.batch)]
    cmd = harness.torchrun(gpus, __file__, child_args)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    run = harness.run_child(cmd, env, args.launch_timeout, LAUNCH_TIMEOUT)
    if args.log_dir:
        log = Path(args.log_dir) / f"fsdp_{spec.replace('@', '_mb')}_{gpus}gpu.log"
        log.write_text(run.stdout + run.stderr)
    print(f"{spec} on {gpus} GPU(s): {run.seconds:.0f} s", flush=True)
    return run.result() or {"path": path, "gpus": gpus, "batch": batch or args.batch, "error": run.failure()}


def _table(results: list[dict], loss: bool) -> str:
    one_gpu = {(r["path"], r["batch"]): r for r in results if r.get("gpus") == 1 and "error" not in r}
    best_hf = harness.best(results, "tokens_per_s_per_gpu", lambda r: r["path"] in HF_PATHS)
    by_path = {(r["path"], r["gpus"]): r for r in results if "error" not in r}
    columns = ["path", "GPUs", "micro-batch", "tokens/s/GPU", "TFLOP/s", "MFU", "peak mem", "step"]
    columns += ["param comm/step", "grad comm/step"]
    columns += ["last-20 loss", "vs exact"] if loss else ["scaling vs 1 GPU", "vs best hf"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["path"], r["gpus"], r.get("batch", "-"), harness.failed(r["error"])])
            continue
        row = [r["path"], r["gpus"], r["batch"], f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['tflops']:.0f}"]
        row += [f"{100 * r['mfu']:.1f}%", f"{r['peak_mem_gb']:.1f} GB", f"{r['step_s'] * 1e3:.0f} ms"]
        row += [
            f"{r[key] / 1e9:.2f} GB" if key in r else "-"
            for key in ("param_bytes_per_step", "grad_bytes_per_step")
        ]
        if loss:
            twin = by_path.get((EXACT_TWIN.get(r["path"], r["path"]), r["gpus"]), {})
            row += [
                f"{r['last20_mean_loss']:.4f}",
                harness.change(r["last20_mean_loss"], twin.get("last20_mean_loss")),
            ]
        else:
            base = one_gpu.get((r["path"], r["batch"]))
            scaling = (
                f"{100 * r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.1f}%" if base else "-"
            )
            row += [scaling, harness.ratio(r["tokens_per_s_per_gpu"], best_hf)]
        rows.append(row)
    return harness.markdown_table(columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3.1-8b")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument(
        "--batch", type=int, default=1, help="micro-batch per GPU (a path's `@N` overrides it)"
    )
    parser.add_argument("--gpus", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--paths",
        nargs="+",
        default=["forge-fsdp2", "hf-fsdp2"],
        help=f"paths, each optionally `@micro_batch`: {', '.join(list(FORGE_PATHS) + list(HF_PATHS))}",
    )
    parser.add_argument(
        "--loss-steps", type=int, default=0, help="train N steps on the quick-start corpus and compare losses"
    )
    parser.add_argument("--data-dir", default="data/quickstart", help="quick-start data (built if missing)")
    parser.add_argument("--eager", action="store_true", help="forge paths without compiled blocks")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="forge paths: profile this many steps on rank 0 after the timed ones (GPU kernel time by kind, GPU "
        "idle time, the most expensive kernels); not counted in the speed columns",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument("--log-dir", default=None, help="write each launch's full output here")
    parser.add_argument("--launch-timeout", type=float, default=900, help="seconds before a launch is killed")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    for spec in args.paths:
        split_path(spec)
    if args.loss_steps:  # build the corpus once, before the ranks read it
        from forge_lightning.tools.data import build_quickstart

        build_quickstart(args.data_dir)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    suffix = "_loss" if args.loss_steps else ""
    out = Path(
        args.out
        or Path(__file__).parent / "results" / f"fsdp_throughput_{args.shape}_{args.seq}{suffix}.json"
    )
    gpu = harness.machine(args.device == "cuda")
    meta = {"gpu": gpu, **harness.run_meta(__file__)}
    results = []
    for gpus in sorted(args.gpus):
        for spec in args.paths:
            results.append(_launch(args, spec, gpus))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
            # after every launch: kept if the run is cut short
            harness.write_json(out, {"meta": meta, "results": results})
    what = (
        f"{args.loss_steps} steps on the quick-start corpus"
        if args.loss_steps
        else f"{args.steps} timed steps"
    )
    print(f"\n{args.shape}, seq {args.seq}, {what}, {gpu}, torch {meta['torch']}")
    for r in results:
        if r.get("profile"):
            print(
                f"profile {r['path']}@{r['batch']} on {r['gpus']} GPU(s): "
                + "\n".join(step_profile.describe(r["profile"]))
            )
    print(_table(results, loss=bool(args.loss_steps)))


if __name__ == "__main__":
    main()

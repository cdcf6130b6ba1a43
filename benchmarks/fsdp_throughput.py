"""Multi-GPU training throughput: our FSDP2Strategy / DDPStrategy runs vs transformers under plain FSDP2 / DDP.

Each path is one ``torchrun`` launch on the same GPUs and the same random tokens, timed after warm-up:

- ``forge-fsdp2`` / ``forge-fsdp2-fp8`` / ``forge-ddp``: ``CausalLM`` trained by Lightning's ``Trainer`` with
  ``FSDP2Strategy`` (bf16 parameters over fp32 masters, fp32 reduce) or ``DDPStrategy``, with the module's
  ``performance`` defaults (compiled blocks, cuDNN attention, Triton fused loss; ``-fp8``: torchao float8 with
  FP8 all-gather) — the path a user runs with ``forge fit``.
- ``hf-fsdp2`` / ``hf-fsdp2-ac``: what a user writes today: the transformers model with ``fully_shard`` per
  decoder layer and on the root (same mixed precision), SDPA attention, optionally gradient checkpointing,
  fused AdamW, a plain loop. ``hf-ddp``: the transformers model under ``DistributedDataParallel`` with bf16
  autocast over fp32 weights.

    python benchmarks/fsdp_throughput.py --gpus 2 --shape llama3.1-8b --seq 8192 --batch 1 \
        --paths forge-fsdp2 forge-fsdp2-fp8 hf-fsdp2 hf-fsdp2-ac
    python benchmarks/fsdp_throughput.py --gpus 1 2 --shape llama3.2-1b --seq 4096 --batch 4 \
        --paths forge-fsdp2 forge-ddp hf-fsdp2 hf-ddp      # scaling 1 -> 2 GPUs

Prints one table last (tokens/s per GPU, TFLOP/s, MFU against 989, peak memory, scaling vs 1 GPU) and writes
benchmarks/results/fsdp_throughput_<shape>_<seq>.json. ``--device cpu --shape debug`` checks it on gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PEAK_TFLOPS = 989.0
FORGE_PATHS = ("forge-fsdp2", "forge-fsdp2-fp8", "forge-ddp")
HF_PATHS = ("hf-fsdp2", "hf-fsdp2-ac", "hf-ddp")


# ----- child: one path on every rank -----------------------------------------------------------------------
def _random_tokens(args, vocab: int, rank: int):
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (args.warmup + args.steps, args.batch, args.seq + 1), generator=generator)


class _StepTimer:
    """Wall time of the steps after warm-up, measured with a device sync at both ends."""

    def __init__(self, warmup: int, device) -> None:
        self.warmup, self.device, self.start, self.end, self.steps = warmup, device, None, None, 0

    def after_step(self, step: int) -> None:
        import torch

        if step + 1 == self.warmup:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()
        elif step + 1 > self.warmup:
            self.steps += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.end = time.perf_counter()


def _run_forge(args, path: str, tokens) -> tuple[float, int]:
    import lightning.pytorch as pl
    import torch

    from forge_lightning.modules.llm import CausalLM
    from forge_lightning.strategies import DDPStrategy, FSDP2Strategy

    cuda = args.device == "cuda"
    performance = {"fp8": {"recipe": "tensorwise", "fsdp_all_gather": True}} if path.endswith("fp8") else {}
    if path == "forge-ddp":  # DDP replicates a materialized model; FSDP2 materializes its shards itself
        module = CausalLM(config=args.shape, performance=performance, optimizer={"lr": 1e-4})
        strategy, precision = DDPStrategy(), "bf16-mixed"
    else:
        with torch.device("meta"):
            module = CausalLM(config=args.shape, performance=performance, optimizer={"lr": 1e-4})
        strategy = FSDP2Strategy(param_dtype="bf16", reduce_dtype="fp32")
        precision = "32-true"
    timer = _StepTimer(args.warmup, torch.device(args.device))

    class Timing(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            timer.after_step(batch_idx)

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
    return timer.end - timer.start, timer.steps


def _run_hf(args, path: str, tokens) -> tuple[float, int]:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from forge_lightning.modules.llm import LLMConfig

    device = torch.device(args.device, int(os.environ["LOCAL_RANK"]) if args.device == "cuda" else 0)
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
        with torch.no_grad():
            model.apply(model._init_weights)
        # RoPE frequencies are a buffer FSDP does not manage: rebuild them on the device.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    timer = _StepTimer(args.warmup, device)
    for step, t in enumerate(tokens):
        t = t.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=path == "hf-ddp"):
            loss = model(input_ids=t[:, :-1], labels=t[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.after_step(step)
    return timer.end - timer.start, timer.steps


def child(args) -> None:
    import torch

    from forge_lightning.modules.llm import LLMConfig, llm_flops_per_token

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = LLMConfig.from_preset(args.shape)
    tokens = _random_tokens(args, config.vocab_size, rank)
    run = _run_forge if args.child in FORGE_PATHS else _run_hf
    elapsed, steps = run(args, args.child, tokens)
    cuda = args.device == "cuda"
    tokens_per_gpu = args.batch * args.seq * steps / elapsed
    tflops = tokens_per_gpu * llm_flops_per_token(config, args.seq) / 1e12
    result = {
        "path": args.child,
        "gpus": world,
        "batch": args.batch,
        "tokens_per_s_per_gpu": tokens_per_gpu,
        "tflops": tflops,
        "mfu": tflops / PEAK_TFLOPS,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
        "step_s": elapsed / steps,
    }
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


# ----- parent: one torchrun per (path, GPU count) --------------------------------------------------------
def _launch(args, path: str, gpus: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    cmd += [__file__, "--child", path, *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    tail = (proc.stdout + proc.stderr).strip()
    print(tail[-3000:], file=sys.stderr)
    return {"path": path, "gpus": gpus, "error": tail.splitlines()[-1] if tail else f"exit {proc.returncode}"}


def _table(results: list[dict]) -> str:
    one_gpu = {r["path"]: r for r in results if r.get("gpus") == 1 and "error" not in r}
    best_hf = max(
        (r["tokens_per_s_per_gpu"] for r in results if r["path"] in HF_PATHS and "error" not in r),
        default=None,
    )
    lines = [
        "| path | GPUs | micro-batch | tokens/s/GPU | TFLOP/s | MFU | peak mem | step | scaling vs 1 GPU | vs best hf |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['path']} | {r['gpus']} | failed: {r['error'][:100]} |")
            continue
        base = one_gpu.get(r["path"])
        scaling = f"{100 * r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.1f}%" if base else "-"
        vs = f"{r['tokens_per_s_per_gpu'] / best_hf:.2f}x" if best_hf else "-"
        lines.append(
            f"| {r['path']} | {r['gpus']} | {r['batch']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops']:.0f} | "
            f"{100 * r['mfu']:.1f}% | {r['peak_mem_gb']:.1f} GB | {r['step_s'] * 1e3:.0f} ms | {scaling} | {vs} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3.1-8b")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1, help="micro-batch per GPU")
    parser.add_argument("--gpus", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--paths", nargs="+", default=["forge-fsdp2", "hf-fsdp2"], choices=FORGE_PATHS + HF_PATHS
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results = [_launch(args, path, gpus) for gpus in sorted(args.gpus) for path in args.paths]
    for r in results:
        print(json.dumps(r), flush=True)
    out = Path(
        args.out or Path(__file__).parent / "results" / f"fsdp_throughput_{args.shape}_{args.seq}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"gpu": gpu, "torch": torch.__version__, "argv": sys.argv[1:]}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"\n{args.shape}, seq {args.seq}, micro-batch {args.batch}, {gpu}, torch {meta['torch']}")
    print(_table(results))


if __name__ == "__main__":
    main()

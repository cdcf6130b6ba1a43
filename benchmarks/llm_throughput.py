"""LLM training throughput on one GPU: our CausalLM model vs transformers, side by side in one run.

Each path runs in its own child process (clean peak-memory and compile caches) on the same GPU, on the same
random token data, after warm-up. Pure bf16 weights and optimizer state (the model cast to bf16, AdamW on it)
unless ``--precision autocast`` (bf16 autocast over fp32 master weights). FLOPs per token =
6·N(non-embedding, incl. the lm_head matmul) + 12·layers·(heads·head_dim)·seq; MFU against 989 TFLOP/s.

    python benchmarks/llm_throughput.py --shape llama3.2-1b --seq 4096 --batch 8 \
        --paths forge forge-compile hf-eager hf-compile hf-liger

Prints one table last and writes benchmarks/results/llm_throughput_<shape>_<seq>.json.
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
PATHS = ("forge", "forge-compile", "hf-eager", "hf-compile", "hf-liger")


def _build_forge(shape: str, compile_blocks: bool):
    import torch

    from forge_lightning.kernels import fused_linear_cross_entropy
    from forge_lightning.modules.llm import DecoderLM, LLMConfig

    config = LLMConfig.from_preset(shape)
    with torch.device("meta"):
        model = DecoderLM(config)
    model.to_empty(device="cuda")
    model.init_weights()
    model.to(torch.bfloat16)
    if compile_blocks:
        for layer in model.model.layers:
            layer.compile()

    def loss_fn(input_ids, labels):
        hidden = model.hidden_states(input_ids)
        flat = hidden.reshape(-1, hidden.shape[-1])
        return fused_linear_cross_entropy(flat, model.lm_head.weight, labels.reshape(-1))

    return config, model, loss_fn


def _build_hf(shape: str, variant: str):
    import torch
    import transformers

    from forge_lightning.modules.llm import LLMConfig

    config = LLMConfig.from_preset(shape)
    if variant == "liger":
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{config.architecture}")()  # patches the HF classes
    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    hf_config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    if variant == "compile":
        model = torch.compile(model)

    def loss_fn(input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    return config, model, loss_fn


def run_path(path: str, shape: str, seq: int, batch: int, steps: int, warmup: int, precision: str) -> dict:
    """Train ``steps`` timed steps of one path and return its measurements."""
    import torch

    from forge_lightning.modules.llm import llm_flops_per_token

    torch.manual_seed(0)
    if path.startswith("forge"):
        config, model, loss_fn = _build_forge(shape, compile_blocks=path == "forge-compile")
    else:
        config, model, loss_fn = _build_hf(shape, path.removeprefix("hf-"))
    if precision == "autocast":
        model.float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = torch.randint(0, config.vocab_size, (warmup + steps, batch, seq + 1), device="cuda")
    losses = []

    def step(i: int) -> None:
        tokens = data[i]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast"):
            loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_s = batch * seq * steps / elapsed
    tflops = tokens_per_s * llm_flops_per_token(config, seq) / 1e12
    return {
        "path": path,
        "shape": shape,
        "seq": seq,
        "batch": batch,
        "precision": precision,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / PEAK_TFLOPS,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
        "step_s": elapsed / steps,
        "final_loss": float(losses[-1]),
    }


def _child(args: argparse.Namespace, path: str) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--shape", args.shape, "--seq", str(args.seq)]
    cmd += ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--precision", args.precision]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    tail = (proc.stdout + proc.stderr)[-1500:]
    return {
        "path": path,
        "error": tail.strip().splitlines()[-1] if tail.strip() else f"exit {proc.returncode}",
    }


def _table(results: list[dict], reference: str) -> str:
    ref = next((r for r in results if r["path"] == reference and "error" not in r), None)
    lines = [
        "| path | tokens/s | TFLOP/s | MFU | peak mem | step | vs " + reference + " |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['path']} | failed: {r['error'][:80]} | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        lines.append(
            f"| {r['path']} | {r['tokens_per_s'] / 1e3:.1f}k | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% "
            f"| {r['peak_mem_gb']:.1f} GB | {r['step_s'] * 1e3:.0f} ms | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", choices=("bf16", "autocast"), default="bf16")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--reference", default="hf-liger", help="path the ratio column divides by")
    parser.add_argument("--out", default=None, help="JSON output (default benchmarks/results/...)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_path(
            args.child, args.shape, args.seq, args.batch, args.steps, args.warmup, args.precision
        )
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    for path in args.paths:
        results.append(_child(args, path))
        print(json.dumps(results[-1]), flush=True)
    out = Path(args.out or Path(__file__).parent / "results" / f"llm_throughput_{args.shape}_{args.seq}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "argv": sys.argv[1:]}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(
        f"\n{args.shape}, seq {args.seq}, batch {args.batch}, {args.precision}, {meta['gpu']}, torch {meta['torch']}"
    )
    print(_table(results, args.reference))


if __name__ == "__main__":
    main()

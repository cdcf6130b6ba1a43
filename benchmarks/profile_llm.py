"""Where the GPU time of one training step goes, for our LLM path (``torch.profiler``).

Builds the model as ``benchmarks/llm_throughput.py`` does (``CausalLM`` + its ``performance`` settings), warms
up, profiles ``--steps`` steps and attributes every CUDA kernel to one bucket: attention, GEMMs (block
projections), norm / RoPE / activation (the compiled blocks' fused elementwise kernels), loss (the fused linear +
cross-entropy, its GEMMs included, profiled alone on the same shapes), optimizer, other. It then compares the step
with the bf16 matmul ceiling.

    python benchmarks/profile_llm.py --shape llama3.2-1b --seq 4096 --batch 8 --path forge

Prints one table last and writes benchmarks/results/profile_<shape>_<seq>_<path>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import harness
import step_profile
from llm_throughput import FORGE_PATHS, _build_forge, _random_batches

MATMUL_CEILING_TFLOPS = 798.0  # bf16 torch.matmul measured on this H200


def _kernel_ms(fn, repeats: int) -> tuple[dict[str, float], list[dict]]:
    """GPU kernel time per call of ``fn`` by bucket (each kernel counted once, from its device-side event), and
    the most expensive kernels (:func:`step_profile.summarize` of ``repeats`` calls)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    summary = step_profile.summarize(prof, repeats, time.perf_counter() - start, cuda=True)
    return summary["ms"], summary["top_kernels"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--path", default="forge", choices=list(FORGE_PATHS))
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from forge_lightning.kernels import fused_linear_cross_entropy
    from forge_lightning.modules.llm import llm_flops_per_token

    config, model, loss_fn = _build_forge(args.path, args.shape, "cuda", torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = _random_batches(config.vocab_size, args.warmup + args.steps, args.batch, args.seq, "cuda")

    def step(tokens) -> None:
        loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for tokens in batches[: args.warmup]:
        step(tokens)
    torch.cuda.synchronize()
    timed = iter(batches[args.warmup :])
    step_ms, top_kernels = _kernel_ms(lambda: step(next(timed)), args.steps)
    # The fused loss's GEMMs look like any other GEMM: profile the loss alone on the step's shapes (hidden states
    # in, gradients out) and move its kernels from the name buckets to "loss".
    hidden = torch.randn(args.batch * args.seq, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    hidden.requires_grad_(True)
    head = model.model.lm_head.weight
    labels = batches[0][:, 1:].reshape(-1)

    fp8 = model.performance.fp8  # the step's own loss settings (FP8 head GEMMs with `fp8.lm_head`)
    fp8_loss = dict(fp8=fp8 is not None and fp8.lm_head, fast_accum=fp8 is not None and fp8.fast_accum)

    def loss_only() -> None:
        fused_linear_cross_entropy(
            hidden, head, labels, reduction="sum", backend="triton", **fp8_loss
        ).backward()

    loss_only()
    loss_ms, _ = _kernel_ms(loss_only, args.steps)
    for name, ms in loss_ms.items():
        step_ms[name] = step_ms.get(name, 0.0) - ms
    step_ms["loss"] = sum(loss_ms.values())
    gpu_ms = sum(step_ms.values())
    flops = llm_flops_per_token(config, args.seq) * args.batch * args.seq
    ideal_ms = flops / (MATMUL_CEILING_TFLOPS * 1e12) * 1e3
    result = {
        "meta": {"gpu": harness.machine(cuda=True), **harness.run_meta(__file__)},
        "args": vars(args),
        "per_step_ms": step_ms,
        "gpu_ms": gpu_ms,
        "ideal_ms_at_matmul_ceiling": ideal_ms,
        "top_kernels": top_kernels,
    }
    out = Path(
        args.out or Path(__file__).parent / "results" / f"profile_{args.shape}_{args.seq}_{args.path}.json"
    )
    harness.write_json(out, result)
    print(f"\n{args.shape}, seq {args.seq}, batch {args.batch}, path {args.path}: the most expensive kernels")
    for k in top_kernels[:15]:
        print(f"  {k['ms']:7.2f} ms  {k['bucket']:<17} {k['kernel'][:110]}")
    print(f"GPU kernel time per step ({args.path})")
    buckets = {name: step_ms.get(name, 0.0) for name in step_profile.BUCKETS}
    rows = [[name, f"{ms:.1f}", f"{100 * ms / gpu_ms:.1f}%"] for name, ms in buckets.items()]
    rows += [["total (kernels)", f"{gpu_ms:.1f}", "100%"]]
    rows += [[f"all FLOPs at the {MATMUL_CEILING_TFLOPS:.0f} TFLOP/s matmul ceiling", f"{ideal_ms:.1f}", ""]]
    print(harness.markdown_table(["bucket", "ms / step", "share"], rows))


if __name__ == "__main__":
    main()

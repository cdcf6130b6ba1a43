"""Attention forward + backward on one GPU: cuDNN bf16 (what SDPA runs) against cuDNN FP8 and FlashAttention-4.

Paths (``--paths``): ``cudnn-bf16`` (SDPA restricted to cuDNN, the baseline of every row), ``cudnn-fp8``
(``forge_lightning.kernels.fp8_attention`` with its per-tensor e4m3 casts of q / k / v / dO included in the time;
causal shapes only) and ``fa4`` (``forge_lightning.kernels.flash4``, the custom ops ``attention()`` runs under
``performance.attention.kernel: fa4``; ``pip install flash-attn-4``). Shapes are the attention of the LLM
benchmark's models at seq 4096 and the self-attention of Wan2.1-1.3B at 480p x 81 frames (32,760 tokens,
non-causal); q / k / v are transposed views of ``[B, S, heads, D]``, as the attention layers produce them. FLOPs:
3.5 · 4 · B · H · S² · D (forward 1, backward 2.5), halved for causal shapes. Errors are relative L2 differences
from the bf16 path.

    python benchmarks/attention_fp8.py --shapes qwen3-4b llama3.1-8b
    python benchmarks/attention_fp8.py --paths cudnn-bf16 fa4 --shapes llama3.2-1b wan2.1-1.3b \
        --out benchmarks/results/attention_fa4.json

(the Llama-3.2-1B shape's heads of 64 are refused on Hopper by cuDNN's FP8 backward, which takes head_dim 128 only)

Prints one table; writes benchmarks/results/attention_fp8.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import harness  # this script's directory is on sys.path
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from forge_lightning.kernels.flash4 import flash4_attention
from forge_lightning.kernels.fp8_attention import FP8AttentionScales, fp8_attention

# name -> (batch, heads, kv_heads, seq, head_dim, causal)
SHAPES = {
    "llama3.2-1b": (8, 32, 8, 4096, 64, True),
    "qwen3-4b": (4, 32, 8, 4096, 128, True),
    "llama3.1-8b": (1, 32, 8, 8192, 128, True),
    "wan2.1-1.3b": (1, 12, 12, 32760, 128, False),  # 21 latent frames x 30 x 52 patches
}
PATHS = ("cudnn-bf16", "cudnn-fp8", "fa4")


def _inputs(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int):
    def rand(h: int) -> torch.Tensor:
        x = torch.randn(batch, seq, h, head_dim, device="cuda", dtype=torch.bfloat16)
        return x.transpose(1, 2).requires_grad_()

    return (
        rand(heads),
        rand(kv_heads),
        rand(kv_heads),
        torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16),
    )


def run_shape(name: str, paths: list[str], warmup: int, reps: int) -> list[dict]:
    batch, heads, kv_heads, seq, head_dim, causal = SHAPES[name]
    q, k, v, grad_out = _inputs(batch, heads, kv_heads, seq, head_dim)
    scales = FP8AttentionScales()
    kernels = {
        "cudnn-bf16": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=heads != kv_heads
        ),
        "cudnn-fp8": lambda: fp8_attention(q, k, v, scales, backend="cudnn"),
        # [B, H, S, D] views -> FA4's [B, S, H, D] and back, as attention() calls it
        "fa4": lambda: flash4_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal
        ).transpose(1, 2),
    }
    if not causal and "cudnn-fp8" in paths:
        print(f"{name}: cudnn-fp8 skipped (FP8 attention is causal only)", file=sys.stderr)
    chosen = [p for p in ("cudnn-bf16", *paths) if causal or p != "cudnn-fp8"]
    flops = 3.5 * 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    rows, outputs = [], {}
    for path in dict.fromkeys(chosen):
        forward = kernels[path]

        def step(forward=forward):
            out = forward()
            return (out, *torch.autograd.grad(out, (q, k, v), grad_out))

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            outputs[path] = [t.detach().float() for t in step()]
            # mean time per call of `reps` calls after `warmup`; the peak-memory counter restarts with the clock
            seconds = harness.run_steps(lambda _, f=step: f(), range(warmup + reps), warmup, cuda=True).step_s
        tflops = harness.tflops(flops / seconds)
        rows.append(
            {
                "shape": name,
                "batch_heads_kv_seq_dim": [batch, heads, kv_heads, seq, head_dim],
                "causal": causal,
                "path": path,
                "fwd_bwd_ms": seconds * 1e3,
                "tflops": tflops,
                "mfu": harness.mfu(tflops),
                "peak_mem_gb": harness.peak_memory_gb(cuda=True),
            }
        )
    base = rows[0]["fwd_bwd_ms"]
    for row in rows:
        row["speedup"] = base / row["fwd_bwd_ms"]
        row["rel_err"] = {
            t: ((a - b).norm() / b.norm()).item()
            for t, a, b in zip(("o", "dq", "dk", "dv"), outputs[row["path"]], outputs["cudnn-bf16"])
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES)[:3], choices=list(SHAPES))
    parser.add_argument("--paths", nargs="+", default=["cudnn-bf16", "cudnn-fp8"], choices=PATHS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_fp8.json")
    args = parser.parse_args()
    rows = []
    for name in args.shapes:
        try:
            rows += run_shape(name, args.paths, args.warmup, args.reps)
        except RuntimeError as err:  # cuDNN refuses some shapes (e.g. head_dim 64 in the FP8 backward on Hopper); FA4 not installed
            print(f"{name}: {type(err).__name__}: {err}", file=sys.stderr)
    meta = {
        **harness.run_meta(__file__),
        "device": harness.machine(cuda=True),
        "cudnn": torch.backends.cudnn.version(),
    }
    harness.write_json(args.out, {**meta, "results": rows})
    columns = ["shape", "path", "fwd+bwd ms", "TFLOP/s", "MFU", "peak mem", "speedup"]
    table = []
    for r in rows:
        errs = " / ".join(f"{r['rel_err'][t]:.3f}" for t in ("o", "dq", "dk", "dv"))
        cells = [r["shape"], r["path"], f"{r['fwd_bwd_ms']:.2f}", f"{r['tflops']:.0f}"]
        cells += [f"{100 * r['mfu']:.1f}%", f"{r['peak_mem_gb']:.1f} GB", f"{r['speedup']:.2f}x", errs]
        table.append(cells)
    print(harness.markdown_table([*columns, "rel err o / dq / dk / dv"], table))


if __name__ == "__main__":
    main()

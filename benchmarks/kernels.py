"""Times forge_lightning.kernels' Triton kernels against their plain-torch references and torch.compile.

Each row runs forward + backward (FP8 rows: the one-way transform) at a Llama-3.2-1B-like training shape
(8 x 4096 tokens, hidden 2048, intermediate 8192, 32 heads of 64, vocab 128256) in bf16, and reports the
median time per call (GPU kernel time from the profiler, and wall time), the speedup of Triton over each
baseline, the peak extra GPU memory of each, and the largest output difference between Triton and the
reference (relative to the reference's max).

For the cross-entropy there are two rows: the chunked torch reference of the same algorithm, and the unfused
formulation a user would otherwise write (``F.cross_entropy`` on full fp32 logits), eager and compiled.

Run on one GPU (writes benchmarks/results/kernels.json):

    python benchmarks/kernels.py

Check the script's logic on a CPU (tiny shapes, every column runs the torch reference, nothing compiled):

    python benchmarks/kernels.py --dry-run
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, also when a test imports this file
import harness

from forge_lightning import kernels
from forge_lightning.kernels.cross_entropy import linear_cross_entropy_unfused
from forge_lightning.kernels.fp8 import dequantize_fp8_reference, quantize_fp8_reference
from forge_lightning.kernels.rms_norm import rms_norm_reference
from forge_lightning.kernels.rope import apply_rope_reference
from forge_lightning.kernels.swiglu import swiglu_reference

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "kernels.json"
# name -> (tokens, hidden, intermediate, heads, head_dim, vocab, fp8 elements)
SIZES = {"full": (8 * 4096, 2048, 8192, 32, 64, 128256, 1 << 26), "tiny": (2 * 16, 32, 64, 4, 16, 257, 4096)}


@dataclass
class Case:
    """One table row: a Triton callable and its baselines, each taking no arguments."""

    kernel: str
    shape: str
    dtype: torch.dtype
    impls: dict[str, Callable[[], torch.Tensor | tuple[torch.Tensor, ...]] | None] = field(
        default_factory=dict
    )


def fwd_bwd(fn: Callable[..., torch.Tensor | tuple], inputs: list[torch.Tensor], *args, **kwargs) -> Callable:
    """A closure running ``fn(*inputs, *args, **kwargs)`` and its backward w.r.t. the float inputs."""
    leaves = [t for t in inputs if t.is_floating_point() and t.requires_grad]

    def step():
        out = fn(*inputs, *args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
        return out

    return step


def llm_cases(
    size: str, device: str, triton_backend: str, compile_enabled: bool, ce_chunks: list[int]
) -> list[Case]:
    tokens, hidden, inter, heads, head_dim, vocab, _ = SIZES[size]
    dt = torch.bfloat16
    batch = 8 if size == "full" else 2

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, device=device) * scale).to(dt).requires_grad_()

    def case(kernel, shape, inputs, fast, reference, **kwargs):
        """fast(*inputs, backend=..., **kwargs) against reference(*inputs, **kwargs), eager and compiled."""
        compiled = torch.compile(reference) if compile_enabled else None
        return Case(
            kernel,
            shape,
            dt,
            {
                "triton": fwd_bwd(fast, inputs, backend=triton_backend, **kwargs),
                "torch": fwd_bwd(reference, inputs, **kwargs),
                "compiled": compiled and fwd_bwd(compiled, inputs, **kwargs),
            },
        )

    x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    q = rand(batch, tokens // batch, heads, head_dim)
    cos, sin = kernels.rope_cos_sin(torch.arange(q.shape[1], device=device), head_dim, 500000.0)
    h, head = rand(tokens, hidden), rand(vocab, hidden, scale=hidden**-0.5)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    ce_shape = f"{tokens}x{hidden}, V={vocab}"
    cases = [
        case("rms_norm", f"{tokens}x{hidden}", [x, weight], kernels.rms_norm, rms_norm_reference),
        case(
            "rms_norm+residual",
            f"{tokens}x{hidden}",
            [x, weight, residual],
            lambda a, w, r, **kw: kernels.rms_norm(a, w, residual=r, **kw),
            lambda a, w, r: rms_norm_reference(a, w, residual=r),
        ),
        case(
            "swiglu",
            f"{tokens}x{inter}",
            [rand(tokens, inter), rand(tokens, inter)],
            kernels.swiglu,
            swiglu_reference,
        ),
        case(
            "apply_rope", "x".join(map(str, q.shape)), [q, cos, sin], kernels.apply_rope, apply_rope_reference
        ),
        # The unfused formulation a user would otherwise write, eager and compiled.
        case(
            "fused_linear_ce vs unfused",
            ce_shape,
            [h, head, labels],
            kernels.fused_linear_cross_entropy,
            linear_cross_entropy_unfused,
            reduction="sum",
        ),
    ]
    # The chunked torch reference of the same algorithm: a Python loop of cuBLAS calls, nothing to compile.
    cases.append(
        Case(
            "fused_linear_ce vs chunked torch",
            ce_shape,
            dt,
            {
                "triton": cases[-1].impls["triton"],
                "torch": fwd_bwd(
                    kernels.fused_linear_cross_entropy, [h, head, labels], reduction="sum", backend="torch"
                ),
                "compiled": None,
            },
        )
    )
    for chunk in ce_chunks:  # chunk-size sweep: Triton only
        step = fwd_bwd(
            kernels.fused_linear_cross_entropy,
            [h, head, labels],
            reduction="sum",
            chunk_size=chunk,
            backend=triton_backend,
        )
        cases.append(Case(f"fused_linear_ce chunk={chunk}", ce_shape, dt, {"triton": step}))
    return cases


def fp8_cases(size: str, device: str, triton_backend: str, compile_enabled: bool) -> list[Case]:
    numel = SIZES[size][-1]
    grads = torch.randn(numel, device=device, dtype=torch.bfloat16)
    payload, scales = quantize_fp8_reference(grads, 256)
    cases = []
    for label, block, rowwise in [
        ("block 256", 256, False),
        ("per-tensor", None, False),
        ("rowwise", None, True),
    ]:
        x = grads.view(-1, 4096) if rowwise else grads
        quantize = torch.compile(quantize_fp8_reference) if compile_enabled else None
        cases.append(
            Case(
                f"quantize_fp8 ({label})",
                f"{numel}",
                torch.bfloat16,
                {
                    "triton": lambda x=x, b=block, r=rowwise: kernels.quantize_fp8(
                        x, b, rowwise=r, backend=triton_backend
                    ),
                    "torch": lambda x=x, b=block, r=rowwise: quantize_fp8_reference(x, b, rowwise=r),
                    "compiled": quantize and (lambda x=x, b=block, r=rowwise, f=quantize: f(x, b, rowwise=r)),
                },
            )
        )
    dequantize = torch.compile(dequantize_fp8_reference) if compile_enabled else None
    cases.append(
        Case(
            "dequantize_fp8 (block 256)",
            f"{numel}",
            torch.float8_e4m3fn,
            {
                "triton": lambda: kernels.dequantize_fp8(
                    payload, scales, 256, dtype=torch.bfloat16, backend=triton_backend
                ),
                "torch": lambda: dequantize_fp8_reference(payload, scales, 256, dtype=torch.bfloat16),
                "compiled": dequantize and (lambda: dequantize(payload, scales, 256, dtype=torch.bfloat16)),
            },
        )
    )
    return cases


def measure(fn: Callable, device: str, warmup: int, reps: int) -> tuple[dict, object]:
    """Times ``fn``: median wall ms per call, GPU kernel ms per call and peak extra MiB (CUDA only).

    Wall time (:class:`harness.StepTimer`: CUDA events between calls) includes any gap where the GPU waits for
    Python and kernel launches; GPU time (the profiler's kernel durations) is what the call costs when, as in a
    training step, other work hides that overhead. Also returns the last warm-up call's output.
    """
    out = None
    for _ in range(warmup):
        out = fn()
    cuda = device == "cuda"
    peak = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (harness.peak_memory_bytes(cuda) - base) / 2**20
    wall = harness.run_steps(lambda _: fn(), range(reps), 0, cuda).median_step_s * 1e3
    return {"ms": wall, "gpu_ms": gpu_kernel_ms(fn, min(reps, 10)) if cuda else None, "peak_mib": peak}, out


def gpu_kernel_ms(fn: Callable, reps: int) -> float:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [
        e for e in prof.events() if e.device_type == DeviceType.CUDA and "Activity Buffer" not in e.name
    ]
    return sum(e.time_range.elapsed_us() for e in kernels) / reps / 1e3


def max_rel_diff(a: object, b: object) -> float:
    a0, b0 = (a[0] if isinstance(a, tuple) else a), (b[0] if isinstance(b, tuple) else b)
    a0, b0 = a0.detach().float(), b0.detach().float()
    return ((a0 - b0).abs().max() / b0.abs().max().clamp_min(1e-30)).item()


IMPLS = ("triton", "torch", "compiled")


def run_case(case: Case, device: str, warmup: int, reps: int) -> dict:
    row: dict = {"kernel": case.kernel, "shape": case.shape, "dtype": str(case.dtype).removeprefix("torch.")}
    outputs = {}
    for name in IMPLS:
        fn = case.impls.get(name)
        stats, outputs[name] = measure(fn, device, warmup, reps) if fn is not None else ({}, None)
        for key in ("ms", "gpu_ms", "peak_mib"):
            row[f"{name}_{key}"] = stats.get(key)
    for name in ("torch", "compiled"):
        for key in ("ms", "gpu_ms"):
            base, ours = row[f"{name}_{key}"], row[f"triton_{key}"]
            row[f"speedup_{key.removesuffix('ms')}vs_{name}"] = base / ours if base and ours else None
    row["max_rel_diff"] = (
        max_rel_diff(outputs["triton"], outputs["torch"]) if outputs["torch"] is not None else None
    )
    return row


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    """One line per row; speedups use GPU kernel time where measured, wall time otherwise."""
    columns = ["kernel", "shape", "dtype", "GPU ms triton/torch/compiled", "x torch", "x comp."]
    columns += ["wall ms triton/torch/compiled", "peak MiB t/t/c", "max diff"]
    lines = []
    for r in rows:
        gpu = "/".join(fmt(r[f"{n}_gpu_ms"], ".3f") for n in IMPLS)
        wall = "/".join(fmt(r[f"{n}_ms"], ".3f") for n in IMPLS)
        peaks = "/".join(fmt(r[f"{n}_peak_mib"], ".0f") for n in IMPLS)
        key = "gpu_" if r["triton_gpu_ms"] is not None else ""
        ours = r[f"triton_{key}ms"]
        speedups = [harness.ratio(r[f"{n}_{key}ms"], ours) for n in ("torch", "compiled")]
        diff = fmt(r["max_rel_diff"], ".2e")
        lines.append([r["kernel"], r["shape"], r["dtype"], gpu, *speedups, wall, peaks, diff])
    print(harness.markdown_table(columns, lines))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on CPU, torch backend, no compile"
    )
    parser.add_argument(
        "--output", type=Path, help=f"JSON path (default {DEFAULT_OUTPUT}; none in a dry run)"
    )
    parser.add_argument("--only", default="", help="comma-separated substrings of kernel names to run")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--ce-chunks", default="", help="comma-separated CE chunk sizes to sweep (Triton only)"
    )
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --dry-run to check the script on CPU)")
    device, size = ("cpu", "tiny") if args.dry_run else ("cuda", "full")
    backend, compile_enabled = ("torch", False) if args.dry_run else ("triton", True)
    ce_chunks = [int(c) for c in args.ce_chunks.split(",") if c]
    cases = llm_cases(size, device, backend, compile_enabled, ce_chunks) + fp8_cases(
        size, device, backend, compile_enabled
    )
    wanted = [s for s in args.only.split(",") if s]
    cases = [c for c in cases if not wanted or any(w in c.kernel for w in wanted)]
    rows = []
    for case in cases:
        rows.append(run_case(case, device, warmup=3, reps=args.reps if not args.dry_run else 3))
        print(f"done: {case.kernel}", file=sys.stderr, flush=True)
    output = args.output or (None if args.dry_run else DEFAULT_OUTPUT)
    if output is not None:
        meta = {
            **harness.run_meta(__file__, argv),
            "device": harness.machine(device == "cuda"),
            "triton": _triton_version(),
        }
        harness.write_json(output, {**meta, "results": rows})
    print_table(rows)
    return rows


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()

"""Where the GPU time of training steps goes: kernel time by kind, GPU idle time, and what the GPU waited for.

Shared by the throughput benchmarks' ``--profile N`` options and ``profile_llm.py``. :class:`StepProfiler` records
``N`` consecutive steps with ``torch.profiler``; :func:`summarize` attributes every CUDA kernel to a bucket
(:data:`BUCKETS`, from the kernel's name), measures the time the GPU ran no kernel (the step's wall time less the
union of kernel intervals) lists the most expensive kernels, and names, for the longest GPU gaps, the innermost host operation running when each
began (what the GPU waited for).
"""

from __future__ import annotations

import time
from typing import Any

TOP_KERNELS = 20  # the most expensive kernels listed per profile
BUCKETS = (
    "attention",
    "gemm",
    "fp8 cast",
    "norm/rope/act",
    "eager elementwise",
    "loss",
    "optimizer",
    "other",
)


def kernel_bucket(kernel: str) -> str:
    """The step-time bucket a CUDA kernel belongs to, from its name (see :data:`BUCKETS`)."""
    lowered = kernel.lower()
    if "adam" in lowered or "multi_tensor" in lowered:
        return "optimizer"
    if any(key in lowered for key in ("flash", "fmha", "sdpa", "attention", "cudnn")):
        return "attention"
    if (
        kernel.startswith("triton_")
        and not kernel.startswith("triton_tem")
        and ("scaled_mm" in lowered or "abs_max" in lowered)
    ):
        return "fp8 cast"  # compiled amax / scale / cast (and transpose) prologues of float8 GEMMs
    if any(key in lowered for key in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "scaled_mm")):
        return "gemm"
    if kernel.startswith(("triton_", "_rms", "_rope", "_swiglu")):
        return "norm/rope/act"
    if kernel.startswith("_ce_") or any(
        key in lowered for key in ("cross_entropy", "log_softmax", "nll_loss")
    ):
        return "loss"
    if any(key in lowered for key in ("elementwise", "reduce_kernel", "reduce_1block", "cat_")):
        return "eager elementwise"
    return "other"


def summarize(profiler: Any, steps: int, wall_s: float, cuda: bool) -> dict[str, Any]:
    """Per step: the wall time, kernel time by bucket, GPU busy and idle time, and the longest GPU gaps.

    On a CPU (script checks only) the buckets hold the operators' self CPU time instead and there are no gaps.
    """
    from torch.autograd import DeviceType

    totals: dict[str, float] = {}
    per_kernel: dict[str, float] = {}
    intervals, host = [], []
    for event in profiler.events():
        on_device = event.device_type == DeviceType.CUDA
        if on_device and cuda and not event.is_user_annotation:  # annotations span kernels, they are not ones
            span = event.time_range
            intervals.append((span.start, span.end))
            kind = kernel_bucket(event.name)
            totals[kind] = totals.get(kind, 0.0) + span.elapsed_us()
            per_kernel[event.name] = per_kernel.get(event.name, 0.0) + span.elapsed_us()
        elif not on_device and not cuda and event.self_cpu_time_total > 0:
            kind = kernel_bucket(event.name)
            totals[kind] = totals.get(kind, 0.0) + event.self_cpu_time_total
            per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.self_cpu_time_total
        elif not on_device:
            host.append(event)
    kernels = {kind: us / 1e3 / steps for kind, us in totals.items()}
    step_ms = 1e3 * wall_s / steps
    busy_ms, gaps = _union_ms(intervals, steps)
    longest = []
    for gap_us, at in sorted(gaps, reverse=True)[:8]:
        inside = [e for e in host if e.time_range.start <= at < e.time_range.end]
        innermost = min(inside, key=lambda e: e.time_range.elapsed_us()).name if inside else "-"
        longest.append({"ms": gap_us / 1e3, "host_op": innermost})
    if not intervals:
        busy_ms = sum(kernels.values())
    return {
        "steps": steps,
        "step_ms": step_ms,
        "busy_ms": busy_ms,
        "idle_ms": max(0.0, step_ms - busy_ms),
        "ms": kernels,
        "gaps_over_1ms_per_step": sum(1 for gap, _ in gaps if gap > 1e3) / steps,
        "longest_gaps": longest,
        "top_kernels": [
            {"kernel": name[:160], "bucket": kernel_bucket(name), "ms": us / 1e3 / steps}
            for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
        ],
    }


def _union_ms(intervals: list[tuple[float, float]], steps: int) -> tuple[float, list[tuple[float, float]]]:
    """Busy milliseconds per step of the union of ``(start, end)`` microsecond intervals, and the gaps between
    them as ``(length, start)`` pairs."""
    if not intervals:
        return 0.0, []
    intervals = sorted(intervals)
    busy, gaps = 0.0, []
    start, end = intervals[0]
    for lo, hi in intervals[1:]:
        if lo > end:
            busy += end - start
            gaps.append((lo - end, end))
            start, end = lo, hi
        else:
            end = max(end, hi)
    busy += end - start
    return busy / 1e3 / steps, gaps


def describe(summary: dict[str, Any]) -> list[str]:
    """Printable lines of a :func:`summarize` result."""
    kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(summary["ms"].items(), key=lambda kv: -kv[1]))
    lines = [
        f"{summary['steps']} steps, ms per step: wall {summary['step_ms']:.1f}, GPU busy {summary['busy_ms']:.1f}, "
        f"idle {summary['idle_ms']:.1f}; kernels: {kinds}"
    ]
    lines += [
        f"  GPU gap {g['ms']:.1f} ms while the host ran {g['host_op']}" for g in summary["longest_gaps"]
    ]
    lines += [
        f"  {k['ms']:7.2f} ms  {k['bucket']:<17} {k['kernel'][:110]}"
        for k in summary.get("top_kernels", [])[:12]
    ]
    return lines


class StepProfiler:
    """Records steps ``first + 1 ... first + steps`` with ``torch.profiler``: call :meth:`after_step` with the
    number of steps done after each step; :attr:`summary` is set once the last one is recorded.

    Args:
        first: steps done when recording starts (the warm-up).
        steps: steps to record (0: never record).
        cuda: whether the steps run on a CUDA device (kernels recorded and the device synchronised at the end).
        trace: also write the recorded steps as a Chrome trace (``chrome://tracing``, Perfetto) to this file.
    """

    def __init__(self, first: int, steps: int, cuda: bool, trace: str | None = None) -> None:
        self.first, self.steps, self.cuda, self.trace = first, steps, cuda, trace
        self.summary: dict[str, Any] | None = None
        self._profiler: Any = None
        self._start = 0.0

    def after_step(self, done: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity

        if self.steps and done == self.first and self._profiler is None and self.summary is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
            self._start = time.perf_counter()
        elif self._profiler is not None and done == self.first + self.steps:
            if self.cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - self._start
            self._profiler.__exit__(None, None, None)
            if self.trace is not None:
                self._profiler.export_chrome_trace(self.trace)
            self.summary = summarize(self._profiler, self.steps, wall, self.cuda)
            self._profiler = None

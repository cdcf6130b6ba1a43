"""SFT throughput on one GPU: padded batches vs packed rows (FlexAttention, FlashAttention varlen), side by side.

SFT-like samples (a masked prompt, then trained tokens) have log-normal lengths clipped to ``[min_len, seq]``.
Every path trains our ``CausalLM`` (its ``loss_sum``: the fused linear + cross-entropy over the trained tokens)
in pure bf16 with fused AdamW, each in its own child process, on batches of the same ``batch x seq`` token budget:

* ``padded``: samples in data order, as many per batch as fit ``batch x seq`` tokens once padded to the longest
  of the batch (``--pad-to seq``: ``batch`` samples padded to ``seq``); causal SDPA, padding computed and ignored.
* ``packed-flex`` / ``packed-varlen`` / ``packed-sdpa``: ``batch`` rows of ``seq`` tokens from online best-fit
  packing (``forge_lightning.datamodules.packing``), attention kept within each document by compiled
  FlexAttention with a document block mask, FlashAttention varlen, or SDPA with a dense block-diagonal mask.
* ``-compile``: ``torch.compile`` per decoder layer.

Only real (non-padding) tokens count: tokens/s, and TFLOP/s with 6·N per token plus the attention of the actual
documents (``attention_flops_per_token`` over the sample lengths, not ``seq²`` per row); MFU against 989 TFLOP/s.

    python benchmarks/packing_throughput.py --shape llama3.2-1b --seq 4096 --batch 8 --steps 6 --warmup 3

Prints one table last and writes benchmarks/results/packing_throughput.json (``--out``). ``--dry-run`` runs a
tiny model on CPU (packed rows with ``packed-sdpa``) to check the script.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import harness  # this script's directory is on sys.path

PATHS = (
    "padded",
    "packed-flex",
    "packed-varlen",
    "packed-sdpa",
    "padded-compile",
    "packed-flex-compile",
    "packed-varlen-compile",
)
DEFAULT_PATHS = ("padded", "packed-flex", "packed-varlen", "padded-compile", "packed-flex-compile")


def sample_lengths(
    count: int, median: float, sigma: float, min_len: int, max_len: int, seed: int
) -> list[int]:
    """``count`` log-normal lengths (median ``median``, log-space deviation ``sigma``) clipped to the range."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.lognormal(math.log(median), sigma, size=count)
    return np.clip(np.rint(raw), min_len, max_len).astype(int).tolist()


def make_samples(lengths: list[int], vocab: int, seed: int) -> list[dict]:
    """SFT-like samples: random tokens, the first third of each (the prompt) untrained."""
    import torch

    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        tokens = torch.randint(0, vocab, (n + 1,), generator=g)
        labels = tokens[1:].clone()
        labels[: n // 3] = -100
        samples.append({"input_ids": tokens[:-1], "labels": labels})
    return samples


def padded_batches(
    samples: list[dict], seq: int, batch: int, pad_to: str, count: int
) -> list[tuple[dict, list]]:
    """``count`` batches of consecutive samples whose padded size stays within ``batch x seq`` tokens."""
    import torch

    from forge_lightning.datamodules.packing import pad_collate

    out, start = [], 0
    while len(out) < count:
        end, longest = start, 0
        while end < len(samples):
            width = seq if pad_to == "seq" else max(longest, len(samples[end]["input_ids"]))
            if (end - start + 1) * width > batch * seq:
                break
            longest, end = width, end + 1
        if end == start:
            raise ValueError("ran out of samples: raise --pool")
        chunk = samples[start:end]
        collated = pad_collate(chunk)
        if pad_to == "seq" and collated["input_ids"].shape[1] < seq:
            extra = seq - collated["input_ids"].shape[1]
            collated["input_ids"] = torch.nn.functional.pad(collated["input_ids"], (0, extra))
            collated["labels"] = torch.nn.functional.pad(collated["labels"], (0, extra), value=-100)
        out.append((collated, [len(s["input_ids"]) for s in chunk]))
        start = end
    return out


def packed_batches(samples: list[dict], seq: int, batch: int, count: int) -> list[tuple[dict, list]]:
    """``count`` batches of ``batch`` rows packed online best-fit (the bins in the order they close)."""
    from forge_lightning.datamodules.packing import PackedDataset, best_fit_pack, pad_collate

    lengths = [len(s["input_ids"]) for s in samples]
    bins = best_fit_pack(lengths, seq)
    if len(bins) < count * batch:
        raise ValueError(f"{len(bins)} packed rows, {count * batch} needed: raise --pool")
    rows = PackedDataset(samples, bins, seq)
    out = []
    for b in range(count):
        chunk = list(range(b * batch, (b + 1) * batch))
        docs = [lengths[i] for row in chunk for i in bins[row]]
        out.append((pad_collate([rows[r] for r in chunk]), docs))
    return out


def run_path(path: str, args: argparse.Namespace) -> dict:
    """Train ``args.steps`` timed steps of one path after ``args.warmup`` steps; return its measurements."""
    import torch

    from forge_lightning.modules.llm import CausalLM
    from forge_lightning.modules.llm.config import attention_flops_per_token, llm_flops_per_token

    device = "cpu" if args.dry_run else "cuda"
    packed = path.startswith("packed")
    backend = path.removesuffix("-compile").split("-")[1] if packed else "auto"
    torch.manual_seed(0)
    with torch.device("meta"):
        module = CausalLM(config=args.shape, performance={"attention": {"packed": backend}})
    module.model.to_empty(device=device)
    module.model.init_weights()
    module.to(torch.bfloat16)
    if path.endswith("-compile"):
        for layer in module.model.model.layers:
            layer.compile()
    config = module.config
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5, fused=device == "cuda")

    count = args.warmup + args.steps
    pool = (count * args.batch + 128) * args.seq  # tokens: the timed rows and more than the open bins
    lengths = sample_lengths(
        max(1, int(pool / args.median)) * 2, args.median, args.sigma, args.min_len, args.seq, args.seed
    )
    samples = make_samples(lengths, config.vocab_size, args.seed)
    if packed:
        batches = packed_batches(samples, args.seq, args.batch, count)
    else:
        batches = padded_batches(samples, args.seq, args.batch, args.pad_to, count)
    batches = [({k: v.to(device) for k, v in b.items()}, docs) for b, docs in batches]

    losses = []

    def step(batch: dict) -> None:
        loss_sum, tokens = module.loss_sum(batch)
        loss = loss_sum / tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    timer = harness.run_steps(lambda b: step(b[0]), batches, args.warmup, device == "cuda")

    timed = batches[args.warmup :]
    real = sum(sum(docs) for _, docs in timed)
    total = sum(b["input_ids"].numel() for b, _ in timed)
    dense_per_token = llm_flops_per_token(config, args.seq) - attention_flops_per_token(config, [args.seq])
    flops = sum((dense_per_token + attention_flops_per_token(config, docs)) * sum(docs) for _, docs in timed)
    tflops = harness.tflops(flops / timer.elapsed_s)
    return {
        "path": path,
        "attention": ("sdpa (causal)" if not packed else backend)
        + (", compiled blocks" if "compile" in path else ""),
        "shape": args.shape,
        "seq": args.seq,
        "batch": args.batch,
        "pad_to": None if packed else args.pad_to,
        "steps": args.steps,
        "samples_per_step": sum(len(docs) for _, docs in timed) / len(timed),
        "real_tokens_per_step": real / len(timed),
        "padding_fraction": 1 - real / total,
        "real_tokens_per_s": real / timer.elapsed_s,
        "tflops": tflops,
        "mfu": harness.mfu(tflops),
        "peak_mem_gb": harness.peak_memory_gb(device == "cuda"),
        "step_s": timer.step_s,
        "final_loss": float(losses[-1]),
    }


def _child(args: argparse.Namespace, path: str, timeout: float | None) -> dict:
    cmd = [sys.executable, __file__, "--child", path]
    for key in ("shape", "seq", "batch", "steps", "warmup", "pad_to", "median", "sigma", "min_len", "seed"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--dry-run"] if args.dry_run else []
    run = harness.run_child(cmd, timeout=timeout, timeout_message="stopped after {:.0f} s (time budget)")
    return run.result() or {"path": path, "error": run.failure()}


def _reference(results: list[dict], path: str) -> dict:
    """The padded row a path is compared with (``{}`` if it failed or did not run)."""
    want = "padded-compile" if path.endswith("-compile") else "padded"
    return harness.reference_row(results, lambda r: r["path"] == want) or {}


def _table(results: list[dict]) -> str:
    columns = ["path", "attention", "padding", "real tokens/s", "TFLOP/s", "MFU", "peak mem", "step"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["path"], harness.failed(r["error"])])
            continue
        ref = _reference(results, r["path"]).get("real_tokens_per_s")
        row = [r["path"], r["attention"], f"{100 * r['padding_fraction']:.1f}%"]
        row += [f"{r['real_tokens_per_s'] / 1e3:.1f}k", f"{r['tflops']:.0f}", f"{100 * r['mfu']:.1f}%"]
        row += [f"{r['peak_mem_gb']:.1f} GB", f"{r['step_s'] * 1e3:.0f} ms"]
        rows.append([*row, harness.ratio(r["real_tokens_per_s"], ref)])
    return harness.markdown_table([*columns, "vs padded"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3.2-1b", help="preset of forge_lightning.modules.llm.config")
    parser.add_argument("--seq", type=int, default=4096, help="packed row length and longest sample")
    parser.add_argument(
        "--batch", type=int, default=8, help="rows per batch: the budget is batch x seq tokens"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pad-to", choices=("longest", "seq"), default="longest")
    parser.add_argument("--median", type=float, default=512.0, help="median sample length (log-normal)")
    parser.add_argument(
        "--sigma", type=float, default=1.0, help="log-space standard deviation of the lengths"
    )
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", nargs="+", default=None, choices=PATHS)
    parser.add_argument(
        "--budget-s", type=float, default=0.0, help="wall-clock limit for all paths (0: none)"
    )
    parser.add_argument("--out", default=None, help="JSON output (default benchmarks/results/...)")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, to check the script")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run and args.child is None:
        args.shape, args.seq, args.batch, args.steps, args.warmup = "debug", 128, 2, 2, 1
        args.median, args.min_len = 40.0, 16
    if args.child:
        harness.emit_result(run_path(args.child, args))
        return
    paths = args.paths or (["padded", "packed-sdpa"] if args.dry_run else list(DEFAULT_PATHS))
    lengths = sample_lengths(20000, args.median, args.sigma, args.min_len, args.seq, args.seed)
    ordered = sorted(lengths)
    dist = {
        "distribution": f"log-normal, median {args.median:g}, sigma {args.sigma:g}, clipped to [{args.min_len}, {args.seq}]",
        "mean": sum(lengths) / len(lengths),
        "median": ordered[len(ordered) // 2],
        "p90": ordered[int(0.9 * len(ordered))],
        "p99": ordered[int(0.99 * len(ordered))],
        "max": ordered[-1],
    }
    start = time.monotonic()
    results = []
    for path in paths:
        left = args.budget_s - (time.monotonic() - start) if args.budget_s else None
        if left is not None and left < 20:
            results.append({"path": path, "error": "not run (time budget)"})
        else:
            results.append(_child(args, path, left))
        print(json.dumps(results[-1]), flush=True)
    meta = {
        "device": "cpu (dry run)" if args.dry_run else harness.machine(cuda=True),
        **harness.run_meta(__file__),
        "lengths": dist,
    }
    out = Path(args.out or Path(__file__).parent / "results" / "packing_throughput.json")
    harness.write_json(out, {"meta": meta, "results": results})
    print(
        f"\n{args.shape}, seq {args.seq}, budget {args.batch}x{args.seq} tokens per batch, pure bf16 + fused AdamW, "
        f"{args.steps} timed steps after {args.warmup}, {meta['device']}, torch {meta['torch']}"
    )
    print(
        f"sample lengths: {dist['distribution']}; mean {dist['mean']:.0f}, median {dist['median']}, "
        f"p90 {dist['p90']}, p99 {dist['p99']}"
    )
    print(_table(results))


if __name__ == "__main__":
    main()

"""LLM training throughput on one GPU: our CausalLM vs transformers, side by side in one run.

Each path runs in its own child process (clean peak memory and compile caches) on the same GPU, on the same
random token data, after warm-up. Our paths build ``CausalLM`` and apply its ``performance`` settings with
``forge_lightning.performance.apply_performance`` (what every strategy does), then train with the module's own
loss. Pure bf16 weights and optimizer state (the model cast to bf16, AdamW on it) unless ``--precision autocast``
(bf16 autocast over fp32 master weights). FLOPs per token = 6·N(non-embedding, incl. the lm_head matmul) +
12·layers·(heads·head_dim)·seq; MFU against 989 TFLOP/s.

    python benchmarks/llm_throughput.py --shape llama3.2-1b --seq 4096 --batch 8 \
        --paths forge forge-eager forge-fp8 hf-eager hf-compile hf-liger

FlashAttention-4 against cuDNN SDPA (the same model otherwise; packed rows are not used here):

    python benchmarks/llm_throughput.py --shape llama3.2-1b --seq 4096 --batch 8 --paths forge-sdpa forge-fa4

``--loss-steps N`` instead trains the chosen paths for N steps on real text (the quick-start corpus and its BPE
tokenizer, built on the machine; same seed and data order for every path) and compares the mean loss of the last
20 steps, e.g. FP8 against bf16:

    python benchmarks/llm_throughput.py --shape qwen3-4b --seq 4096 --batch 4 --paths forge forge-fp8 \
        --loss-steps 200

Muon (``optimizer: {name: muon}``: Muon on the hidden matrices, AdamW on the rest) against fused AdamW: the
``forge-muon`` path is ``forge`` with our Muon; the table's ``opt step`` column is the optimizer step alone
(CUDA events around it), the step-time ratio the whole training step's. With ``--loss-steps`` each optimizer runs
at its own learning rate (``--lr`` for AdamW and Muon's AdamW part, ``--muon-lr`` for Muon):

    python benchmarks/llm_throughput.py --shape llama3.2-1b --seq 4096 --batch 8 --paths forge forge-muon
    python benchmarks/llm_throughput.py --shape llama3.2-1b --seq 4096 --batch 8 --accumulate 8 \
        --paths forge forge-muon   # one optimizer step per 8 micro-batches (the "batch" column: 8 x 8)
    python benchmarks/llm_throughput.py --shape llama3.2-1b --seq 4096 --batch 8 --paths forge forge-muon \
        --loss-steps 200 --lr 3e-4 --muon-lr 0.02

Prints one table last and writes benchmarks/results/llm_throughput_<shape>_<seq>[_<precision>|_loss].json.
``--device cpu --shape debug`` checks the script on a CPU (no compile, torch kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import harness  # this script's directory is on sys.path

FORGE_PATHS = {
    # name: PerformanceConfig overrides (everything else "auto": compile, cuDNN attention, Triton loss)
    "forge": {},
    "forge-eager": {"compile": False},  # Triton RMSNorm / RoPE / SwiGLU kernels instead of compiled blocks
    "forge-fp8": {"fp8": {"recipe": "tensorwise"}},
    "forge-fp8-attn": {"fp8": {"recipe": "tensorwise", "attention": True}},  # + cuDNN FP8 attention
    "forge-fp8-fastacc": {"fp8": {"recipe": "tensorwise", "fast_accum": True}},
    # every GEMM in FP8 (the LM head's inside the fused loss too), fast accumulation everywhere
    "forge-fp8-full": {"fp8": {"recipe": "tensorwise", "fast_accum": True, "lm_head": True}},
    # forge-fp8-full with the k / v projections (N = 1024 at the 4B shape) left in bf16
    "forge-fp8-full-kvbf16": {
        "fp8": {
            "recipe": "tensorwise",
            "fast_accum": True,
            "lm_head": True,
            "exclude": ["lm_head", "*.lm_head", "*.k_proj", "*.v_proj"],
        },
    },  # fmt: skip
    "forge-fp8-rowwise": {"fp8": {"recipe": "rowwise"}},
    "forge-flash": {"attention": {"sdpa": ["flash", "efficient", "math"]}},
    # the attention kernel pinned: SDPA (cuDNN first) or FlashAttention-4 (`pip install flash-attn-4`); `forge`
    # itself is `auto`, FA4 where it imports
    "forge-sdpa": {"attention": {"kernel": "sdpa"}},
    "forge-fa4": {"attention": {"kernel": "fa4"}},
}
# paths that are another path with our Muon as the optimizer
MUON_PATHS = {"forge-muon": "forge"}
HF_PATHS = ("hf-eager", "hf-compile", "hf-liger")
PATHS = (*FORGE_PATHS, *MUON_PATHS, *HF_PATHS)


def _build_forge(path: str, shape: str, device: str, dtype):
    import torch

    from forge_lightning.modules.llm import CausalLM
    from forge_lightning.performance import apply_performance

    overrides = dict(FORGE_PATHS[MUON_PATHS.get(path, path)])
    if device == "cpu":
        overrides["compile"] = False
    with torch.device("meta"):
        module = CausalLM(config=shape, performance=overrides)
    module.to_empty(device=device)
    module.model.init_weights()
    module.to(dtype)  # RoPE frequencies stay fp32 (the rotary module rebuilds them)
    apply_performance(module.parallel_plan(), module.performance, device)

    def loss_fn(input_ids, labels):
        loss_sum, tokens = module.loss_sum({"input_ids": input_ids, "labels": labels})
        return loss_sum / tokens

    return module.config, module, loss_fn


def _build_hf(path: str, shape: str, device: str, dtype):
    import torch
    import transformers

    from forge_lightning.modules.llm import LLMConfig

    config = LLMConfig.from_preset(shape)
    variant = path.removeprefix("hf-")
    if variant == "liger":
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{config.architecture}")()  # patches the HF classes
    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if variant == "compile":
        model = torch.compile(model)

    def loss_fn(input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    return config, model, loss_fn


def _random_batches(vocab: int, count: int, batch: int, seq: int, device: str):
    import torch

    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (count, batch, seq + 1), generator=generator)
    return [data[i].to(device) for i in range(count)]


def _text_batches(data_dir: str, count: int, batch: int, seq: int, device: str):
    """``count`` batches of ``seq + 1``-token windows of the quick-start corpus, in one seeded order."""
    import numpy as np
    import torch

    from forge_lightning.datamodules.indexed import IndexedDataset
    from forge_lightning.tools.data import build_quickstart

    record = build_quickstart(data_dir)
    dataset = IndexedDataset(Path(data_dir) / record["data_prefix"])
    stream = np.concatenate([dataset[i] for i in range(len(dataset))]).astype(np.int64)
    windows = len(stream) // (seq + 1)
    order = np.random.default_rng(0).permutation(windows)
    picks = [order[(i * batch + j) % windows] for i in range(count) for j in range(batch)]
    rows = np.stack([stream[w * (seq + 1) : (w + 1) * (seq + 1)] for w in picks])
    data = torch.from_numpy(rows).view(count, batch, seq + 1)
    return [data[i].to(device) for i in range(count)]


def _optimizer(args: argparse.Namespace, path: str, model, cuda: bool):
    """Fused AdamW over every parameter, or (Muon paths) our Muon + AdamW as ``optimizer: {name: muon}`` builds it."""
    import torch

    if path not in MUON_PATHS:
        return torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda, foreach=not cuda or None)
    from forge_lightning.optim import OptimizerConfig, build_optimizer

    muon = {"lr": args.muon_lr, "adjust_lr_fn": args.muon_adjust_lr}
    return build_optimizer(model.model, OptimizerConfig(name="muon", lr=args.lr, weight_decay=0.0, muon=muon))


def run_path(args: argparse.Namespace, path: str) -> dict:
    """Train one path (``args.warmup`` + ``args.steps`` steps, or ``args.loss_steps``) and measure it."""
    import torch

    from forge_lightning.modules.llm import llm_flops_per_token

    torch.manual_seed(0)
    device, cuda = args.device, args.device == "cuda"
    build = _build_forge if path in FORGE_PATHS or path in MUON_PATHS else _build_hf
    dtype = torch.float32 if args.precision == "autocast" else torch.bfloat16
    config, model, loss_fn = build(path, args.shape, device, dtype)
    optimizer = _optimizer(args, path, model, cuda)
    count = args.loss_steps or args.warmup + args.steps
    micro = count * args.accumulate
    if args.loss_steps:
        batches = _text_batches(args.data_dir, micro, args.batch, args.seq, device)
        if max(int(b.max()) for b in batches) >= config.vocab_size:
            raise ValueError(
                f"the corpus tokenizer's ids exceed {args.shape}'s vocab_size ({config.vocab_size})"
            )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    else:
        batches = _random_batches(config.vocab_size, micro, args.batch, args.seq, device)
        scheduler = None
    # one optimizer step per `accumulate` micro-batches
    steps_inputs = [batches[i : i + args.accumulate] for i in range(0, micro, args.accumulate)]
    losses, opt_marks = [], []  # opt_marks: (start, end) of each optimizer step: CUDA events or perf_counter

    def mark():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def step(micro_batches) -> None:
        for tokens in micro_batches:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=args.precision == "autocast"):
                loss = loss_fn(tokens[:, :-1], tokens[:, 1:]) / len(micro_batches)
            loss.backward()
            losses.append(loss.detach() * len(micro_batches))
        if args.loss_steps:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        start = mark()
        optimizer.step()
        opt_marks.append((start, mark()))
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()

    timer = harness.run_steps(step, steps_inputs, min(args.warmup, count - 1), cuda)
    tokens_per_s = timer.rate(args.batch * args.seq * args.accumulate)
    tflops = harness.tflops(tokens_per_s * llm_flops_per_token(config, args.seq))
    loss_values = [float(x) for x in losses]
    timed = opt_marks[-args.steps :] if not args.loss_steps else opt_marks
    opt_ms = [a.elapsed_time(b) if cuda else 1e3 * (b - a) for a, b in timed]
    return {
        "path": path,
        "shape": args.shape,
        "seq": args.seq,
        "batch": args.batch,
        "accumulate": args.accumulate,
        "precision": args.precision,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": harness.mfu(tflops),
        "peak_mem_gb": harness.peak_memory_gb(cuda),
        "step_s": timer.step_s,
        "optimizer": type(optimizer).__name__,
        "opt_step_ms": statistics.median(opt_ms),
        "final_loss": loss_values[-1],
        "last20_mean_loss": sum(loss_values[-20:]) / len(loss_values[-20:]),
        "losses": loss_values if args.loss_steps else None,
    }


def _child(args: argparse.Namespace, path: str) -> dict:
    run = harness.run_child([sys.executable, __file__, "--child", path, *sys.argv[1:]])
    return run.result() or {"path": path, "error": run.failure()}


def _table(results: list[dict], reference: str, loss: bool) -> str:
    ref = harness.reference_row(results, lambda r: r["path"] == reference) or {}
    columns = ["path", "optimizer", "batch", "tokens/s", "TFLOP/s", "MFU", "peak mem", "step", "opt step"]
    columns += [f"vs {reference}"]
    columns += ["last-20 loss", "vs ref loss"] if loss else []
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["path"], harness.failed(r["error"])])
            continue
        batch = r["batch"] if r.get("accumulate", 1) == 1 else f"{r['batch']} x {r['accumulate']}"
        row = [r["path"], r["optimizer"], batch, f"{r['tokens_per_s'] / 1e3:.1f}k", f"{r['tflops']:.0f}"]
        row += [f"{100 * r['mfu']:.1f}%", f"{r['peak_mem_gb']:.1f} GB", f"{r['step_s'] * 1e3:.0f} ms"]
        row.append(f"{r['opt_step_ms']:.1f} ms")
        row.append(harness.ratio(r["tokens_per_s"], ref.get("tokens_per_s")))
        if loss:
            loss_ref = ref.get("last20_mean_loss")
            row += [f"{r['last20_mean_loss']:.4f}", harness.change(r["last20_mean_loss"], loss_ref)]
        rows.append(row)
    return harness.markdown_table(columns, rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--batches", default=None, help="per-path batch overrides, e.g. hf-eager=4,hf-compile=4"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches per optimizer step (timed steps are optimizer steps)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", choices=("bf16", "autocast"), default="bf16")
    parser.add_argument("--paths", nargs="+", default=["forge", "forge-eager", *HF_PATHS], choices=PATHS)
    parser.add_argument("--reference", default=None, help="path the ratio columns divide by (default: first)")
    parser.add_argument("--loss-steps", type=int, default=0, help="train on real text for this many steps")
    parser.add_argument(
        "--lr", type=float, default=1e-4, help="AdamW's (and Muon's AdamW part's) learning rate"
    )
    parser.add_argument("--muon-lr", type=float, default=0.02, help="Muon's learning rate (Muon paths)")
    parser.add_argument("--muon-adjust-lr", choices=("original", "match_rms_adamw"), default="original")
    parser.add_argument("--data-dir", default="data/quickstart", help="quick-start data (built if missing)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="JSON output (default benchmarks/results/...)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = _parser().parse_args()
    overrides = dict(item.split("=") for item in args.batches.split(",")) if args.batches else {}
    if args.child:
        args.batch = int(overrides.get(args.child, args.batch))
        harness.emit_result(run_path(args, args.child))
        return
    results = []
    for path in args.paths:
        results.append(_child(args, path))
        shown = {k: v for k, v in results[-1].items() if k != "losses"}
        print(json.dumps(shown), flush=True)
    suffix = "_loss" if args.loss_steps else ("" if args.precision == "bf16" else f"_{args.precision}")
    name = f"llm_throughput_{args.shape}_{args.seq}{suffix}.json"
    out = Path(args.out or Path(__file__).parent / "results" / name)
    gpu = harness.machine(args.device == "cuda")
    meta = {"gpu": gpu, **harness.run_meta(__file__)}
    harness.write_json(out, {"meta": meta, "results": results})
    what = f"{args.loss_steps} steps on real text" if args.loss_steps else f"{args.steps} timed steps"
    print(f"\n{args.shape}, seq {args.seq}, {args.precision}, {what}, {gpu}, torch {meta['torch']}")
    print(_table(results, args.reference or args.paths[0], loss=bool(args.loss_steps)))


if __name__ == "__main__":
    main()

"""``python -m forge_lightning.tools.moe_placement``: record router loads, make synthetic ones, replay placements.

Three commands::

    record    --data DIR --output trace.npz [--steps N --experts E --top-k K]   train a small MoE LLM on the CPU on
              the quick-start data (``forge-data quickstart --output DIR``), recording its routers' loads
    synthetic --output trace.npz [--experts E --steps N --zipf S --drift P]     a Zipf-skewed, drifting trace
    simulate  TRACE... [--ep 8 32 64 --ranks-per-node 8 --spare-slots 1 --window W --replan-every N]
              [--output results.json]   plain EP vs greedy replication vs ours, one markdown table

``simulate`` prices a replica's per-step gradient sum at ``3 * intermediate_size`` token-equivalents (an
expert's ``3 D I`` fp32 gradient against a token's bf16 dispatch and combine, ``2 * 2 D`` bytes) unless
``--sync-tokens`` says otherwise, and one expert's weights plus Adam state at 16 bytes per parameter (bf16 weight,
fp32 master, two fp32 moments).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from forge_lightning.callbacks.router_load import load_trace, save_trace
from forge_lightning.distributed.placement_sim import Layout, replay, synthetic_trace


def record(args: argparse.Namespace) -> None:
    """Train a small MoE LLM on the quick-start data with a :class:`RouterLoadRecorder`."""
    import lightning.pytorch as pl
    import torch

    from forge_lightning.callbacks.router_load import RouterLoadRecorder
    from forge_lightning.datamodules.pretrain import PretrainDataModule
    from forge_lightning.modules.llm.config import PRESETS, LLMConfig
    from forge_lightning.modules.llm.module import CausalLM
    from forge_lightning.tools.data import QUICKSTART_PREFIX, QUICKSTART_TOKENIZER

    data_dir = Path(args.data)
    tokenizer = data_dir / QUICKSTART_TOKENIZER
    if not tokenizer.is_dir():
        raise SystemExit(
            f"moe_placement record: {tokenizer} is missing; run `forge-data quickstart --output {data_dir}`"
        )
    torch.manual_seed(args.seed)
    data = PretrainDataModule(
        str(data_dir / QUICKSTART_PREFIX),
        str(tokenizer),
        seq_length=args.seq_length,
        batch_size=args.batch_size,
        num_workers=0,
        pin_memory=False,
    )
    data.setup("fit")
    moe = {**PRESETS["debug-moe"]["moe"], "num_experts": args.experts, "num_experts_per_tok": args.top_k}
    config = LLMConfig.from_preset(
        "debug-moe", vocab_size=data.tokenizer.vocab_size, num_layers=args.layers, moe=moe
    )
    module = CausalLM.from_config(config.to_hf(), optimizer={"lr": args.lr}, performance={"compile": False})
    description = (
        f"recorded: debug-moe LLM preset with {args.layers} layers, {args.experts} experts, top-{args.top_k} "
        f"(softmax router, aux loss 0.001), trained from random init for {args.steps} steps on the CPU on the "
        f"quick-start corpus (Python standard-library sources), micro-batch {args.batch_size} x {args.seq_length} "
        f"tokens, seed {args.seed}"
    )
    recorder = RouterLoadRecorder(args.output, ep_size=None, description=description)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[recorder],
    )
    trainer.fit(module, data)
    print(f"wrote {args.output}: {len(recorder.rows)} steps; {description}")


def synthetic(args: argparse.Namespace) -> None:
    """Write a synthetic Zipf-skewed, drifting trace."""
    loads = synthetic_trace(
        steps=args.steps,
        layers=args.layers,
        experts=args.experts,
        assignments_per_step=args.tokens * args.top_k,
        zipf=args.zipf,
        drift=args.drift,
        seed=args.seed,
    )
    meta = {
        "description": (
            f"synthetic: Zipf({args.zipf}) expert popularity over a random ranking, adjacent ranks swapping with "
            f"probability {args.drift} per step, multinomial draws of {args.tokens} tokens x top-{args.top_k} per "
            f"step, seed {args.seed}"
        ),
        "num_layers": args.layers,
        "num_experts": args.experts,
        "top_k": args.top_k,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "synthetic": True,
    }
    save_trace(args.output, loads, list(range(1, args.steps + 1)), meta)
    print(f"wrote {args.output}: {meta['description']}")


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    """Replay each trace at each EP size; print one table; write the results JSON."""
    rows, records = [], []
    for path in args.traces:
        loads, _, meta = load_trace(path)
        hidden, inter = meta.get("hidden_size", 0), meta.get("intermediate_size", 0)
        sync = 3.0 * inter if args.sync_tokens is None else args.sync_tokens
        for ep in args.ep:
            if loads.shape[-1] % ep:
                print(
                    f"skipping EP={ep} for {path}: it does not divide {loads.shape[-1]} experts",
                    file=sys.stderr,
                )
                continue
            layout = Layout(
                ep_size=ep,
                ranks_per_node=args.ranks_per_node,
                spare_slots=args.spare_slots,
                cross_node_cost=args.cross_node_cost,
                replica_sync_tokens=sync,
                expert_state_bytes=16.0 * 3 * hidden * inter,
            )
            results = replay(loads, layout, window=args.window, replan_every=args.replan_every)
            records.append({"trace": str(path), "meta": meta, "layout": vars(layout), "results": results})
            plain = results["plain EP"]
            for name, r in results.items():
                rows.append(_row(Path(path).stem, ep, name, r, plain))
    columns = ["trace", "EP", "method", "max/mean load", "worst step", "comm / token", "vs plain", "replicas",
               "moved / re-plan", "plan ms (mean / max)"]  # fmt: skip
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    print("\n".join("| " + " | ".join(row) + " |" for row in rows))
    record_ = {
        "meta": {
            "command": "python -m forge_lightning.tools.moe_placement " + shlex.join(args.argv),
            "machine": f"cpu ({platform.processor() or platform.machine()})",
            "window": args.window,
            "replan_every": args.replan_every,
        },
        "runs": records,
    }
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(record_, indent=2) + "\n")
    return record_


def _row(trace: str, ep: int, name: str, r: dict[str, float], plain: dict[str, float]) -> list[str]:
    vs = f"{r['comm_per_token'] / plain['comm_per_token']:.3f}x" if plain["comm_per_token"] else "-"
    return [
        trace,
        str(ep),
        name,
        f"{r['imbalance']:.3f}",
        f"{r['imbalance_max']:.3f}",
        f"{r['comm_per_token']:.3f}",
        vs,
        f"{r['replicas']:.1f}",
        f"{r['moved_replicas_per_replan']:.1f}",
        f"{r['planning_ms_mean']:.1f} / {r['planning_ms_max']:.1f}",
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m forge_lightning.tools.moe_placement", description=__doc__
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="train a small MoE on the CPU, recording router loads")
    rec.add_argument(
        "--data", required=True, help="quick-start data directory (forge-data quickstart --output)"
    )
    rec.add_argument("--output", required=True)
    for flag, default in (("steps", 40), ("experts", 64), ("top-k", 4), ("layers", 2), ("batch-size", 8),
                          ("seq-length", 128), ("seed", 0)):  # fmt: skip
        rec.add_argument(f"--{flag}", type=int, default=default)
    rec.add_argument("--lr", type=float, default=3e-3)
    rec.set_defaults(run=record)
    syn = sub.add_parser("synthetic", help="write a synthetic skewed trace")
    syn.add_argument("--output", required=True)
    for flag, default in (("steps", 200), ("experts", 256), ("top-k", 8), ("layers", 2), ("tokens", 4194304),
                          ("hidden-size", 7168), ("intermediate-size", 2048), ("seed", 0)):  # fmt: skip
        syn.add_argument(f"--{flag}", type=int, default=default)
    syn.add_argument("--zipf", type=float, default=1.1)
    syn.add_argument("--drift", type=float, default=0.05)
    syn.set_defaults(run=synthetic)
    sim = sub.add_parser("simulate", help="replay traces: plain EP vs greedy replication vs ours")
    sim.add_argument("traces", nargs="+")
    sim.add_argument("--ep", type=int, nargs="+", default=[8, 32, 64])
    sim.add_argument("--ranks-per-node", type=int, default=8)
    sim.add_argument("--spare-slots", type=int, default=1)
    sim.add_argument("--cross-node-cost", type=float, default=4.0)
    sim.add_argument(
        "--sync-tokens", type=float, default=None, help="default: 3 x the trace's intermediate_size"
    )
    sim.add_argument("--window", type=int, default=10)
    sim.add_argument("--replan-every", type=int, default=10)
    sim.add_argument(
        "--output", default=None, help="results JSON (e.g. benchmarks/results/moe_placement.json)"
    )
    sim.set_defaults(run=simulate)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.argv = argv
    args.run(args)


if __name__ == "__main__":
    main()

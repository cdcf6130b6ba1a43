"""Megatron training throughput: our MegatronStrategy vs megatron-core's stock local spec vs our FSDP2 path.

Each path is one ``torchrun`` launch (``--nproc-per-node`` = the GPUs of its layout) on the same random tokens,
timed over ``--steps`` steps after ``--warmup`` (the GPUs synchronised at both ends). bf16 parameters over fp32
master weights everywhere, AdamW (lr ``--lr``, betas 0.9 / 0.95, weight decay 0.1, no clipping), one
micro-batch per optimizer step.

- ``forge-megatron``: ``CausalLM`` trained by Lightning's ``Trainer`` with ``MegatronStrategy``, ``precision:
  bf16-mixed`` (megatron's ``Float16Module`` + its optimizer with fp32 main weights), our layer spec (SDPA core
  attention, forge's RMSNorm) — what ``forge fit`` runs. ``-distopt``: with ``use_distributed_optimizer``;
  ``-overlap``: distributed optimizer + ``overlap_grad_reduce`` + ``overlap_param_gather``.
- ``megatron-local``: what a megatron-core user writes without TransformerEngine: a ``GPTModel`` of
  ``get_gpt_layer_local_spec(normalization="RMSNorm")`` (its ``DotProductAttention`` materialises the scores),
  ``Float16Module``, megatron's DDP and ``get_megatron_optimizer``, and megatron's schedule
  (``get_forward_backward_func``) in a plain loop. ``-overlap`` as above.
- ``forge-fsdp2``: our FSDP2 path, exactly ``benchmarks/fsdp_throughput.py``'s ``forge-fsdp2`` (imported from it):
  ``FSDP2Strategy``, bf16 parameters / fp32 reduce, the CUDA ``performance`` defaults (compiled blocks, cuDNN
  attention, Triton fused loss).
- ``forge-megatron-moe`` (``-overlap``): ``forge-megatron`` on the ``--moe-model``; logs the expert load, i.e.
  per MoE layer and step the most tokens any expert got over the mean per expert (from each router's routing map,
  summed over every rank's tokens), averaged over the layers and timed steps (max in the JSON).

A path is written ``name[:layout][@micro_batch]``. The layout is ``1`` (default: one GPU) or a product of
``tpN`` (tensor parallel; with sequence parallelism on the forge paths — megatron-core's local spec refuses
it, so ``megatron-local`` runs TP without SP), ``dpN`` (data parallel) and ``epN`` (expert parallel, laid over
the data-parallel ranks as megatron-core does; ``ep2`` alone means DP = EP = 2). GPUs = TP × DP. The micro-batch
is per data-parallel rank (``--batch`` unless ``@N``), so tokens per step = micro-batch × seq × DP.

    # one H200
    python benchmarks/megatron_throughput.py --model llama3.2-1b --seq 4096 \\
        --paths forge-megatron@4 megatron-local@1 forge-fsdp2@4 forge-megatron-moe@2
    # two H200s
    python benchmarks/megatron_throughput.py --model llama3.2-1b --seq 4096 \\
        --paths forge-megatron:dp2@4 forge-megatron:tp2@8 megatron-local:dp2@1 megatron-local:tp2@2 \\
        forge-fsdp2:dp2@4 forge-megatron-moe:dp2@2 forge-megatron-moe:ep2@2
    # one table of both machines' JSON files (no launch)
    python benchmarks/megatron_throughput.py --merge RESULTS_1GPU.json RESULTS_2GPU.json
    # script check on a CPU (tiny models, gloo). megatron-core hard-codes CUDA calls: the test suite's CPU shim
    # maps them to the CPU, installed by tests/megatron/cpu_site/sitecustomize.py in every process of the run
    # that imports megatron-core (this script imports nothing from tests/)
    PYTHONPATH=tests/megatron/cpu_site python benchmarks/megatron_throughput.py --device cpu --model debug \\
        --moe-model debug-moe --seq 64 --batch 2 --warmup 2 --steps 3 --paths forge-megatron forge-megatron:tp2 ...

Prints one table last (tokens/s and per GPU, TFLOP/s per GPU, MFU against 989, peak memory over the ranks,
step time, ratios against forge-fsdp2 on as many GPUs and megatron-local at the same layout, MoE: against EP = 1
at the same TP × DP and the expert load) and writes benchmarks/results/megatron_throughput_<model>_<seq>_<N>gpu.json
after every launch. FLOPs per token as everywhere (``llm_flops_per_token``: 6·N active + attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fsdp_throughput (and its llm_throughput import)
import fsdp_throughput as fsdp
import harness
import step_profile

_OVERLAP = {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}
# path -> (runner, trains the --moe-model, MegatronStrategy / megatron-core DDP + optimizer options)
PATHS: dict[str, tuple[str, bool, dict]] = {
    "forge-megatron": ("forge", False, {}),
    "forge-megatron-distopt": ("forge", False, {"use_distributed_optimizer": True}),
    "forge-megatron-overlap": ("forge", False, _OVERLAP),
    "megatron-local": ("local", False, {}),
    "megatron-local-overlap": ("local", False, _OVERLAP),
    "forge-fsdp2": ("fsdp2", False, {}),
    "forge-megatron-moe": ("forge", True, {}),
    "forge-megatron-moe-overlap": ("forge", True, _OVERLAP),
}
DEFAULT_PATHS = ["forge-megatron", "megatron-local@1", "forge-fsdp2"]
# Benchmark-only MoE shapes: (preset they start from, overrides).
MOE_MODELS: dict[str, tuple[str, dict]] = {
    # Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 key-value heads of 128, q/k norm, experts of width 768,
    # renormalised top-8, untied vocabulary of 151,936) with 12 layers instead of 48 and 32 experts instead of 128:
    # 2.66 B parameters, 1.30 B active per token (2.04 B / 0.68 B without embedding and head). bf16 over fp32
    # masters with Adam: ~48 GB of weights, gradients and optimizer state at EP = 1.
    "qwen3-moe-bench": (
        "qwen3-30b-a3b",
        dict(
            num_layers=12,
            moe=dict(
                num_experts=32,
                num_experts_per_tok=8,
                intermediate_size=768,
                norm_topk_prob=True,
                aux_loss_coef=0.001,
            ),
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Parallel degrees of one launch; GPUs = TP × DP (EP splits the experts over DP ranks)."""

    tp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    def label(self, runner: str) -> str:
        """e.g. ``TP=2+SP``, ``DP=2 EP=2``, ``1 GPU``."""
        parts = []
        if self.tp > 1:
            parts.append(f"TP={self.tp}" + ("+SP" if runner == "forge" else ""))
        if self.dp > 1:
            parts.append(f"DP={self.dp}")
        if self.ep > 1:
            parts.append(f"EP={self.ep}")
        return " ".join(parts) or "1 GPU"


def parse_layout(text: str) -> Layout:
    """``1`` or a product of ``tpN`` / ``dpN`` / ``epN`` (``ep2`` alone: DP = EP = 2)."""
    if text in ("", "1"):
        return Layout()
    tokens = re.findall(r"(tp|dp|ep)(\d+)", text)
    if "".join(k + n for k, n in tokens) != text or len({k for k, _ in tokens}) != len(tokens):
        raise SystemExit(
            f"layout {text!r}: write `1` or a product of tpN, dpN, epN (e.g. tp2, dp2, ep2, tp2dp2)"
        )
    degrees = {k: int(n) for k, n in tokens}
    ep = degrees.get("ep", 1)
    layout = Layout(tp=degrees.get("tp", 1), dp=degrees.get("dp", ep), ep=ep)
    if min(layout.tp, layout.dp, layout.ep) < 1 or layout.dp % layout.ep:
        raise SystemExit(f"layout {text!r}: ep ({layout.ep}) must divide dp ({layout.dp}), every degree >= 1")
    return layout


def split_spec(spec: str) -> tuple[str, str, Layout, int | None]:
    """``name[:layout][@micro_batch]`` -> (name, layout text, layout, micro-batch or ``None`` for ``--batch``)."""
    rest, _, batch = spec.partition("@")
    name, _, layout_text = rest.partition(":")
    if name not in PATHS:
        raise SystemExit(f"unknown path {name!r}; choose from {', '.join(PATHS)}")
    layout = parse_layout(layout_text)
    runner, moe, _ = PATHS[name]
    if runner == "fsdp2" and (layout.tp > 1 or layout.ep > 1):
        raise SystemExit(f"{spec}: forge-fsdp2 runs data parallel only (layout 1 or dpN)")
    if layout.ep > 1 and not moe:
        raise SystemExit(f"{spec}: expert parallelism needs a MoE path (forge-megatron-moe...)")
    return name, layout_text or "1", layout, int(batch) if batch else None


def model_config(name: str):
    """An :class:`LLMConfig` from a preset name or one of this script's :data:`MOE_MODELS`."""
    from forge_lightning.modules.llm import LLMConfig

    if name in MOE_MODELS:
        preset, overrides = MOE_MODELS[name]
        return LLMConfig.from_preset(preset, **overrides)
    return LLMConfig.from_preset(name)


def describe(config) -> str:
    """One line naming the shape (for the table's header and the JSON)."""
    parts = [
        f"{config.architecture}: hidden {config.hidden_size}, {config.num_layers} layers",
        f"{config.num_heads} / {config.num_kv_heads} heads of {config.head_dim}",
    ]
    if config.num_moe_layers < config.num_layers:
        parts.append(f"FFN {config.intermediate_size}")
    if config.moe is not None:
        moe = config.moe
        parts.append(
            f"{moe.num_experts} experts of width {moe.intermediate_size}, top-{moe.num_experts_per_tok} "
            f"(MoE in {config.num_moe_layers} layers)"
        )
    parts.append(f"vocab {config.vocab_size} ({'tied' if config.tie_word_embeddings else 'untied'})")
    total, active = config.num_parameters(), config.num_parameters(active=True)
    size = f"{_count(total)} parameters" + (f", {_count(active)} active" if active != total else "")
    return ", ".join(parts) + "; " + size


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


# ----- child: one path on every rank -----------------------------------------------------------------------
class _ExpertLoad:
    """Tokens routed to each expert, per MoE layer and step, from megatron's routers (``TopKRouter`` returns
    ``(probs, routing_map [tokens, experts])``).

    A global forward hook finds the routers during the first step and hands over to per-router hooks (so later
    steps pay nothing for the modules that are not routers).
    """

    def __init__(self) -> None:
        import torch
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts: dict[int, list] = {}  # router id -> [E] counts per call, in call order
        self.routers: list = []
        self._router_type = TopKRouter
        self._global = torch.nn.modules.module.register_module_forward_hook(self._global_hook)
        self._handles: list = []

    def _record(self, module, _inputs, output) -> None:
        routing_map = output[1]
        self.counts.setdefault(id(module), []).append(routing_map.sum(0))

    def _global_hook(self, module, inputs, output) -> None:
        if isinstance(module, self._router_type):
            if id(module) not in self.counts:
                self.routers.append(module)
            self._record(module, inputs, output)

    def after_first_step(self) -> None:
        self._global.remove()
        self._handles = [r.register_forward_hook(self._record) for r in self.routers]

    def summary(self, timed_steps: int) -> dict:
        """Collective: the max-over-mean expert load of the global batch, over the MoE layers and timed steps."""
        import torch
        import torch.distributed as dist

        for handle in self._handles:
            handle.remove()
        # [layers, steps, E] of this rank's tokens (one forward per router and step: one micro-batch, no recompute)
        counts_LSE = torch.stack(
            [torch.stack(self.counts[id(r)][-timed_steps:]) for r in self.routers]
        ).double()
        dist.all_reduce(counts_LSE)  # every rank routes its own tokens (its sequence shard under SP)
        ratio_LS = counts_LSE.amax(-1) / counts_LSE.mean(-1)
        return {
            "expert_load_max_over_mean": float(ratio_LS.mean()),
            "expert_load_max_over_mean_worst": float(ratio_LS.max()),
            "moe_layers": len(self.routers),
        }


def _run_forge_megatron(args, layout: Layout, options: dict, config, tokens) -> dict:
    import lightning.pytorch as pl
    import torch

    from forge_lightning.strategies.megatron import MegatronStrategy

    pl.seed_everything(0, verbose=False)
    module = _native_module(config, args)
    strategy = MegatronStrategy(
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=layout.tp > 1,
        expert_model_parallel_size=layout.ep,
        **options,
    )
    timer = harness.StepTimer(args.warmup, args.steps, args.device == "cuda")
    profiler = _profiler(args)
    load = _ExpertLoad() if config.moe is not None else None
    summary: dict = {}
    losses = []

    class Timing(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].detach())
            timer.after_step(batch_idx + 1)
            profiler.after_step(batch_idx + 1)
            if load is not None and batch_idx == 0:
                load.after_first_step()

        def on_train_end(self, trainer, pl_module):
            if load is not None:
                summary.update(load.summary(timer.steps))

    batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timing()],
        use_distributed_sampler=False,  # each data-parallel rank brings its own tokens (TP ranks the same ones)
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    out = {"timer": timer, "losses": losses, **summary}
    return out | ({"profile": profiler.summary} if profiler.summary else {})


def _profiler(args) -> step_profile.StepProfiler:
    """Records ``--profile`` timed steps on rank 0 (the timed steps after it include the profiler's overhead)."""
    steps = args.profile if int(os.environ.get("RANK", "0")) == 0 else 0
    return step_profile.StepProfiler(args.warmup, min(steps, args.steps), args.device == "cuda")


def _native_module(config, args):
    """``CausalLM`` with its native weights on the CPU, as ``forge fit`` builds it (the strategy copies them into
    megatron's twin). On a GPU machine the random initialisation runs on the GPU and the weights then move to the
    CPU: the same module in seconds instead of the CPU's serial random numbers (35 s for the 1B shape on a 2-core
    machine), GPU lease time spent on nothing the benchmark measures."""
    import torch

    from forge_lightning.modules.llm import CausalLM

    if args.device != "cuda":
        return CausalLM(config=config, optimizer={"lr": args.lr})
    with torch.device("cuda", int(os.environ["LOCAL_RANK"])):
        module = CausalLM(config=config, optimizer={"lr": args.lr})
    module.cpu()
    torch.cuda.empty_cache()
    return module


def _local_gpt(config, layout: Layout, seq: int):
    """megatron-core's GPTModel of ``config`` from its stock local spec, as a megatron-core user builds it."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tf_config = TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_heads,
        num_query_groups=config.num_kv_heads,
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=config.attention_bias,
        qk_layernorm=config.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=config.initializer_range,
        tensor_model_parallel_size=layout.tp,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )
    scaling = config.rope_scaling or {}
    model = GPTModel(
        config=tf_config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=config.qk_norm, normalization="RMSNorm"),
        vocab_size=config.vocab_size,
        max_sequence_length=seq,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(config.rope_theta),
        rope_scaling=scaling.get("rope_type") == "llama3",
        rope_scaling_factor=scaling.get("factor", 8.0),
    )
    return tf_config, model


def _local_model_and_optimizer(config, layout: Layout, options: dict, args, device):
    """The stock local-spec GPTModel in ``Float16Module`` and megatron's DDP, megatron's optimizer (fp32 main
    weights), and the schedule's hooks, wired as megatron-LM's training loop wires them."""
    import torch
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    tf_config, model = _local_gpt(config, layout, args.seq)
    model = Float16Module(tf_config, model.to(device))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=options.get("overlap_grad_reduce", False),
        overlap_param_gather=options.get("overlap_param_gather", False),
        use_distributed_optimizer=options.get("use_distributed_optimizer", False),
    )
    model = DistributedDataParallel(tf_config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            clip_grad=0.0,  # as the other paths: no clipping
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=ddp_config.use_distributed_optimizer,
            overlap_param_gather=ddp_config.overlap_param_gather,
        ),
        [model],
    )
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.grad_scale_func = optimizer.scale_loss
    if ddp_config.overlap_grad_reduce:
        tf_config.no_sync_func, tf_config.grad_sync_func = model.no_sync, model.start_grad_sync
    return model, optimizer


def _local_forward_step(data_iterator, model):
    """megatron's ``forward_step_func``: the per-token losses ``[b, s]`` and their mean as the loss."""
    input_ids, labels = next(data_iterator)
    losses_BS = model(input_ids, None, None, labels=labels)

    def mean_loss(losses_BS):
        loss = losses_BS.float().mean()
        return loss, {"loss": loss.detach()}

    return losses_BS, mean_loss


def _run_megatron_local(args, layout: Layout, options: dict, config, tokens) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model, optimizer = _local_model_and_optimizer(config, layout, options, args, device)
    forward_backward = get_forward_backward_func()
    timer = harness.StepTimer(args.warmup, args.steps, cuda)
    profiler = _profiler(args)
    losses = []
    for step, t in enumerate(tokens):
        t = t.to(device)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=_local_forward_step,
            data_iterator=iter([(t[:, :-1], t[:, 1:])]),
            model=model,
            num_microbatches=1,
            seq_length=args.seq,
            micro_batch_size=args.batch,
            forward_only=False,
        )
        optimizer.step()
        losses += [r["loss"] for r in reduced]  # this rank's micro-batch
        timer.after_step(step + 1)
        profiler.after_step(step + 1)
    parallel_state.destroy_model_parallel()
    out = {"timer": timer, "losses": losses}
    return out | ({"profile": profiler.summary} if profiler.summary else {})


def _run_fsdp2(args, layout: Layout, options: dict, config, tokens) -> dict:
    timer, losses, _ = fsdp._run_forge(_fsdp_args(args), "forge-fsdp2", tokens)
    return {"timer": timer, "losses": losses}


def _fsdp_args(args) -> argparse.Namespace:
    """The options fsdp_throughput's forge path and token generator read."""
    return argparse.Namespace(
        shape=args.model,
        seq=args.seq,
        batch=args.batch,
        warmup=args.warmup,
        steps=args.steps,
        lr=args.lr,
        loss_steps=0,
        eager=False,
        profile=0,
        device=args.device,
    )


def child(args) -> None:
    from forge_lightning.modules.llm import llm_flops_per_token

    runner, moe, options = PATHS[args.child]
    layout = parse_layout(args.layout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == layout.gpus, f"launched {world} processes for layout {args.layout}"
    config = model_config(args.moe_model if moe else args.model)
    run = {"forge": _run_forge_megatron, "local": _run_megatron_local, "fsdp2": _run_fsdp2}[runner]
    with harness.errors_reported():
        # Seeded per data-parallel rank (megatron's rank order puts the TP ranks of one replica next to each other).
        tokens = fsdp._tokens(_fsdp_args(args), config.vocab_size, rank // layout.tp, layout.dp)
        out = run(args, layout, options, config, tokens)
    harness.emit(f"RANKMEM {harness.peak_memory_gb(args.device == 'cuda'):.3f}")
    if rank:
        return
    timer = out.pop("timer")
    losses = [float(x) for x in out.pop("losses")]  # a sanity check: every path starts near ln(vocab)
    tokens_per_s = timer.rate(args.batch * args.seq * layout.dp)
    tflops = harness.tflops(tokens_per_s / world * llm_flops_per_token(config, args.seq))
    result = {
        "path": args.child,
        "layout": args.layout,
        "label": layout.label(runner),
        "gpus": world,
        **dataclasses.asdict(layout),
        "batch": args.batch,
        "model": args.moe_model if moe else args.model,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / world,
        "tflops": tflops,
        "mfu": harness.mfu(tflops),
        "step_s": timer.step_s,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        **out,
    }
    harness.emit_result(result)


# ----- parent: one torchrun per path ----------------------------------------------------------------------
def _child_env(args, gpus: int) -> dict:
    env = {**os.environ}
    if "OMP_NUM_THREADS" not in env:
        # Building the native model and megatron's twin runs on the CPU: give each rank its share of the cores.
        env["OMP_NUM_THREADS"] = "1" if args.device == "cpu" else str(max(1, (os.cpu_count() or 1) // gpus))
    return env


def _launch(args, spec: str) -> dict:
    path, layout_text, layout, batch = split_spec(spec)
    batch = batch or args.batch
    child_args = [*sys.argv[1:], "--child", path, "--layout", layout_text, "--batch", str(batch)]
    cmd = harness.torchrun(layout.gpus, __file__, child_args)
    run = harness.run_child(cmd, _child_env(args, layout.gpus), args.launch_timeout, fsdp.LAUNCH_TIMEOUT)
    launch_s = run.seconds
    if args.log_dir:
        log = Path(args.log_dir) / f"megatron_{path}_{layout_text}_mb{batch}.log"
        log.write_text(run.stdout + run.stderr)
    print(f"{spec}: {launch_s:.0f} s", flush=True)
    # Searched anywhere in a line: another rank's unterminated output may precede a line this script wrote.
    peaks = [float(m) for m in re.findall(r"RANKMEM ([0-9.]+)$", run.stdout, flags=re.MULTILINE)]
    result = run.result()
    if result and peaks:
        return {**result, "peak_mem_gb": max(peaks), "launch_s": launch_s}
    error = run.failure()
    runner = PATHS[path][0]
    return {"path": path, "layout": layout_text, "label": layout.label(runner), "gpus": layout.gpus,
            **dataclasses.asdict(layout), "batch": batch, "error": error, "launch_s": launch_s}  # fmt: skip


def _best(results: list[dict], keep) -> float | None:
    """The highest tokens/s/GPU among the successful rows ``keep`` accepts."""
    return harness.best(results, "tokens_per_s_per_gpu", keep)


def _ratios(r: dict, results: list[dict]) -> tuple[str, str, str]:
    """Tokens/s/GPU of row ``r`` against forge-fsdp2 on as many GPUs, megatron-local at the same TP × DP (dense
    megatron rows) and, for MoE rows with EP > 1, the MoE paths at EP = 1 and the same TP × DP (best of each)."""
    value, is_moe = r["tokens_per_s_per_gpu"], PATHS[r["path"]][1]
    fsdp_ref = _best(results, lambda o: o["path"] == "forge-fsdp2" and o["gpus"] == r["gpus"])
    local_ref = _best(
        results, lambda o: o["path"].startswith("megatron-local") and (o["tp"], o["dp"]) == (r["tp"], r["dp"])
    )
    ep1_ref = _best(
        results, lambda o: PATHS[o["path"]][1] and (o["tp"], o["dp"], o["ep"]) == (r["tp"], r["dp"], 1)
    )
    dense_megatron = not is_moe and r["path"] != "forge-fsdp2"
    vs_local = dense_megatron and not r["path"].startswith("megatron-local")
    return (
        harness.ratio(value, fsdp_ref) if dense_megatron else "-",
        harness.ratio(value, local_ref) if vs_local else "-",
        harness.ratio(value, ep1_ref) if is_moe and r["ep"] > 1 else "-",
    )


def _table(results: list[dict]) -> str:
    moe = any(PATHS[r["path"]][1] for r in results)
    columns = ["path", "layout", "GPUs", "micro-batch", "tokens/s", "tokens/s/GPU", "TFLOP/s/GPU", "MFU"]
    columns += ["peak mem", "step", "vs forge-fsdp2", "vs megatron-local"]
    columns += ["vs EP=1", "expert load max/mean"] if moe else []
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["path"], r["label"], r["gpus"], r["batch"], harness.failed(r["error"])])
            continue
        vs_fsdp, vs_local, vs_ep1 = _ratios(r, results)
        row = [r["path"], r["label"], r["gpus"], r["batch"], f"{r['tokens_per_s']:,.0f}"]
        row += [f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['tflops']:.{0 if r['tflops'] >= 10 else 4}f}"]
        row += [f"{100 * r['mfu']:.1f}%", f"{r['peak_mem_gb']:.1f} GB", f"{r['step_s'] * 1e3:.0f} ms"]
        row += [vs_fsdp, vs_local]
        if moe:
            load = f"{r['expert_load_max_over_mean']:.3f}" if "expert_load_max_over_mean" in r else "-"
            row += [vs_ep1, load]
        rows.append(row)
    return harness.markdown_table(columns, rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-1b", help="preset of the dense paths")
    parser.add_argument(
        "--moe-model",
        default="qwen3-moe-bench",
        help=f"preset of the MoE paths ({', '.join(MOE_MODELS)} or any)",
    )
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument(
        "--batch", type=int, default=4, help="micro-batch per data-parallel rank (`@N` overrides)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--paths",
        nargs="+",
        default=None,
        help=f"`name[:layout][@micro_batch]`; names: {', '.join(PATHS)}; layouts: 1, tpN, dpN, epN and products",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        default=[],
        help="earlier runs' JSON files: their rows join this run's table and JSON (without --paths: only the table)",
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=None, help="JSON output (default benchmarks/results/...)")
    parser.add_argument("--log-dir", default=None, help="write each launch's full output here")
    parser.add_argument("--launch-timeout", type=float, default=300, help="seconds before a launch is killed")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="forge-megatron and megatron-local paths: profile this many timed steps on rank 0 (GPU kernel time "
        "by kind, GPU idle time and what the GPU waited for); the speed columns then include the profiler's "
        "overhead",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="1", help=argparse.SUPPRESS)
    return parser


def _merge(files: list[str]) -> tuple[list[dict], list[dict]]:
    """(metas, rows) of earlier runs' JSON files, in order."""
    metas, rows = [], []
    for file in files:
        data = json.loads(Path(file).read_text())
        metas += data.get("merged", []) + [{**data["meta"], "file": str(file)}]
        rows += data["results"]
    return metas, rows


def _report(metas: list[dict], results: list[dict]) -> None:
    """The run settings and shapes, then the table (printed last: only the tail of the output may come back)."""
    print()
    for line in dict.fromkeys(
        f"seq {m.get('seq')}, {m.get('steps')} timed steps after {m.get('warmup')}, {m['gpu']}, torch {m['torch']}, "
        f"megatron-core {m['megatron_core']}"
        for m in metas
    ):
        print(line)
    for model, text in {k: v for m in metas for k, v in m["models"].items()}.items():
        print(f"{model}: {text}")
    for r in results:
        if r.get("profile"):
            print(
                f"profile {r['path']}:{r['layout']}@{r['batch']}: "
                + "\n".join(step_profile.describe(r["profile"]))
            )
    print(_table(results))


def main() -> None:
    args = _parser().parse_args()
    if args.child:
        child(args)
        return
    if args.paths is None:  # with --merge alone: only the table of the earlier runs
        args.paths = [] if args.merge else DEFAULT_PATHS
    specs = [split_spec(spec) for spec in args.paths]  # refuse a bad spec before the first launch
    metas, earlier = _merge(args.merge)
    if not specs:
        _report(metas, earlier)
        return
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    gpus = "-".join(str(n) for n in sorted({layout.gpus for _, _, layout, _ in specs}))
    suffix = "_cpu" if args.device == "cpu" else ""
    name = f"megatron_throughput_{args.model}_{args.seq}_{gpus}gpu{suffix}.json"
    out = Path(args.out or Path(__file__).parent / "results" / name)
    import megatron.core

    models = {args.model: describe(model_config(args.model))}
    if any(PATHS[path][1] for path, *_ in specs):
        models[args.moe_model] = describe(model_config(args.moe_model))
    meta = {
        "gpu": harness.machine(args.device == "cuda"),
        **harness.run_meta(__file__),
        "megatron_core": megatron.core.__version__,
        "seq": args.seq,
        "warmup": args.warmup,
        "steps": args.steps,
        "models": models,
    }
    results = []
    for spec in args.paths:
        results.append(_launch(args, spec))
        print(json.dumps(results[-1]), flush=True)
        record = {"meta": meta, "merged": metas, "results": earlier + results}
        harness.write_json(out, record)  # after every launch: kept if the run is cut short
    _report([*metas, meta], earlier + results)


if __name__ == "__main__":
    main()

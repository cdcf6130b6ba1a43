"""Qwen2.5-VL training throughput on one GPU: our VisionLanguageModule vs transformers, side by side in one run.

The model is the Qwen2.5-VL-3B shape (vision: 32 blocks of 1280, 16 heads, SwiGLU 3420, windows of 112 px, full
attention in blocks 7, 15, 23, 31, patch 14, merge 2; text: Qwen2.5-3B, 36 layers of 2048, 16 / 2 heads, FFN
11008, vocab 151936, tied embeddings, M-RoPE sections 16 / 24 / 24) with random weights: nothing is downloaded.

Every row trains on the same synthetic samples, rebuilt from ``--seed`` in each child (each row's ``data_digest``
shows they match): one image per sample, its sides drawn from ``--image-sides`` (224-896 px) and turned into
patches by our ``Qwen2VLImageProcessor`` (so the grids are real), then question / answer text of ``--text-tokens``
(64-1024) random tokens; labels on the answer only. Each step takes the next ``--samples-per-step`` samples. Rows:

- ``transformers+liger``: ``Qwen2_5_VLForConditionalGeneration``, bf16 weights, SDPA, Liger kernels
  (``apply_liger_kernel_to_qwen2_5_vl``: fused linear cross-entropy, RMSNorm, RoPE, SwiGLU), AdamW on the bf16
  weights, batches padded to the longest sample: what a Trainer user gets. Without liger-kernel installed the row
  says so and runs plain ``transformers``.
- ``transformers``: the same without Liger.
- ``ours-padded``: ``VisionLanguageModule`` on the same padded batches (equal work): fp32 master weights + bf16
  autocast, the module's fused linear cross-entropy (``LMLoss``), its ``performance`` defaults applied as the
  strategies apply them (compiled blocks and cuDNN-first SDPA on CUDA), fused AdamW.
- ``ours-packed``: ``ours-padded`` on the step's samples packed into rows of ``--seq-length`` tokens
  (``VLMPackedDataset``: ``document_ids`` and per-sample M-RoPE ``position_ids``); the LLM and the vision tower
  attend per document with ``--attention`` (default ``varlen`` on CUDA: the encoder's shapes change with every
  image grid, which FlexAttention, compiled for static shapes, does not suit).
- ``forge-fit``: the product path, ``forge fit`` of ``configs/vlm/qwen2.5-vl-3b/sft_fsdp2.yaml`` on one device
  with text records drawn like these samples (``benchmarks/vlm_fit_row.py`` says what it changes); compared on
  real tokens/s (its token ids differ, so its loss is not comparable). ``forge-fit:ac=selective,rows=2`` sets the
  activation checkpointing of every component and the packed rows of a step, taken as one micro-batch (the
  recipe's: ``batch_size`` 1 x ``accumulate_grad_batches`` 2), to match an ``ours-packed`` row.

Rows take options after a colon. ``transformers+liger:fp32`` keeps transformers' weights (and AdamW) in fp32 and
computes under bf16 autocast, as ours do: the numerically like-for-like baseline of a loss comparison.
``ours-packed:ac=selective,eager`` sets that row's activation checkpointing
(``ac=none|selective|full``, default ``--activation-checkpointing``) and compilation (``eager``, or ``compile``
on any device; default: the ``performance`` default, compiled on CUDA, unless ``--no-compile``) and attention
(``attn=auto|sdpa|flex|varlen|fa4``, default ``--attention``), so one run can hold several variants. ``attn=fa4``
runs FlashAttention-4 for packed rows and for the attention without documents (``performance.attention.kernel``);
``auto`` leaves that kernel ``auto`` and the other choices pin it to SDPA.

Every row trains the same real tokens per step, so the loss of a step is the same quantity on every row (the mean
over the step's answer tokens). FLOPs per step come from ``VisionLanguageModule.batch_stats`` of the step's padded
batch: 6·N per real token, the LLM's attention over each sample's real length, and the vision encoder's own
(windowed) count; MFU against 989 TFLOP/s. Peak memory is ``max_memory_allocated`` over the timed steps.

    python benchmarks/vlm_throughput.py --steps 10 --warmup 3 --samples-per-step 8 --seq-length 4096 \\
        --rows transformers+liger ours-padded:ac=selective ours-packed:ac=selective ours-packed:ac=none forge-fit

``--loss-steps N`` instead trains the baseline and ours for N steps on identical inputs from the same initial
weights (transformers' random init, saved in bf16 with ``save_pretrained`` and loaded by every row; ours loads
it with ``from_pretrained``) with the same AdamW and warm-up, and reports the final loss difference in percent:

    python benchmarks/vlm_throughput.py --loss-steps 50 --samples-per-step 8 \\
        --rows transformers+liger ours-padded ours-packed

Prints one table last; writes ``benchmarks/results/vlm_throughput[_loss].json`` (``--out``). ``--tiny --device
cpu`` checks the script on a CPU (a tiny shape, small images and texts, no compile).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness  # this script's directory is on sys.path

REPO = Path(__file__).resolve().parents[1]
HF_ROWS = ("transformers+liger", "transformers")
OUR_ROWS = ("ours-padded", "ours-packed")
FIT_ROW = "forge-fit"
ROWS = (*HF_ROWS, *OUR_ROWS, FIT_ROW)
# Per-row options of our rows, written `ours-packed:ac=selective,eager` (see parse_row).
AC_CHOICES = ("none", "selective", "full")
ATTENTION_CHOICES = ("auto", "sdpa", "flex", "varlen", "fa4")
# <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>, <|endoftext|> of the Qwen2-VL vocabulary.
_QWEN_TOKENS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
_QWEN_PAD = 151643
SHAPES: dict[str, dict[str, Any]] = {
    # https://huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct/blob/main/config.json
    "qwen2.5-vl-3b": {
        "text_config": {
            "hidden_size": 2048,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "intermediate_size": 11008,
            "vocab_size": 151936,
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [16, 24, 24],
            },
            "tie_word_embeddings": True,
        },
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "num_heads": 16,
            "intermediate_size": 3420,
            "out_hidden_size": 2048,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
        },
        **_QWEN_TOKENS,
        "pad_token_id": _QWEN_PAD,
        "tie_word_embeddings": True,
    },
    # CPU checks: the processor's real 14-px patches, two blocks per tower, a 512-token vocabulary.
    "tiny": {
        "text_config": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 512,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": True,
            "bos_token_id": 499,
            "eos_token_id": 499,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "num_heads": 2,
            "intermediate_size": 32,
            "out_hidden_size": 64,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
        },
        "image_token_id": 500,
        "video_token_id": 501,
        "vision_start_token_id": 502,
        "vision_end_token_id": 503,
        "pad_token_id": 499,
        "tie_word_embeddings": True,
    },
}
"""Hugging Face ``Qwen2_5_VLConfig`` fields by shape name."""
# Image sides and text lengths of the tiny shape (the full shape's are the options' defaults).
_TINY_RANGES = {"image_sides": (56, 112), "text_tokens": (16, 64)}


# ----- the synthetic samples (identical in every child) -----------------------------------------------------
def _shape(args: argparse.Namespace) -> dict[str, Any]:
    return SHAPES["tiny" if args.tiny else args.shape]


def _png(rng: Any, width: int, height: int) -> bytes:
    """A smooth random RGB image (a coarse random grid, upscaled) as PNG bytes."""
    import numpy as np
    from PIL import Image

    coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), resample=Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_dataset(args: argparse.Namespace, count: int) -> Any:
    """``count`` seeded samples as a ``VLMDataset`` (images decoded and processed when a sample is read): a short
    prompt, ``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch + ``<|vision_end|>``, a question, then a
    trained answer ended by the pad / end-of-text token."""
    import numpy as np

    from forge_lightning.datamodules.chat import Conversation
    from forge_lightning.datamodules.vlm.dataset import VLMDataset
    from forge_lightning.datamodules.vlm.image_processor import Qwen2VLImageProcessor
    from forge_lightning.datamodules.vlm.records import ImageSource
    from forge_lightning.datamodules.vlm.scan import VLMSample
    from forge_lightning.datamodules.vlm.vision_inputs import Qwen2VLVisionInputs

    shape = _shape(args)
    vision = Qwen2VLVisionInputs(
        Qwen2VLImageProcessor(
            patch_size=shape["vision_config"]["patch_size"],
            merge_size=shape["vision_config"]["spatial_merge_size"],
        ),
        **{k: shape[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")},
    )
    # Text tokens: ids below every special token of the shape.
    text_vocab = min(shape["pad_token_id"], *(shape[k] for k in _QWEN_TOKENS))
    rng = np.random.default_rng(args.seed)
    samples = []
    for i in range(count):
        width, height = (int(s) for s in rng.integers(args.image_sides[0], args.image_sides[1] + 1, 2))
        text = int(rng.integers(args.text_tokens[0], args.text_tokens[1] + 1))
        prompt, question = 8, max(1, int(text * rng.uniform(0.2, 0.6)))
        answer = max(1, text - prompt - question)
        image = vision.placeholder_ids((width, height))
        words = rng.integers(0, text_vocab, prompt + question + answer)
        tokens = [*words[:prompt], *image, *words[prompt:-answer], *words[-answer:], shape["pad_token_id"]]
        trainable = np.zeros(len(tokens), dtype=bool)
        trainable[-answer - 1 :] = True
        samples.append(
            VLMSample(
                source=f"synthetic:{i}",
                conversation=Conversation(messages=[], source=f"synthetic:{i}"),
                tokens=np.asarray(tokens, dtype=np.int32),
                trainable=trainable,
                images=[ImageSource(ref=f"synthetic:{i}.png", data=_png(rng, width, height))],
                sizes=[(width, height)],
                num_patches=vision.num_patches((width, height)),
            )
        )
    too_long = [s for s in samples if s.length > args.seq_length]
    if too_long:
        raise ValueError(
            f"{too_long[0].source} has {too_long[0].length} tokens, more than --seq-length ({args.seq_length}): "
            "raise --seq-length or lower --image-sides / --text-tokens"
        )
    return VLMDataset(samples, vision)


def step_batches(args: argparse.Namespace, count: int) -> list[dict[str, Any]]:
    """Per step: the ``padded`` batch of its samples (``vlm_collate``) and the same samples ``packed`` into rows
    of ``--seq-length`` (``VLMPackedDataset`` rows, ``packed_collate``)."""
    from forge_lightning.datamodules.vlm.dataset import VLMDataset, vlm_collate
    from forge_lightning.datamodules.vlm.packing import VLMPackedDataset, pack_bins, packed_collate

    per_step, pad_id = args.samples_per_step, _shape(args)["pad_token_id"]
    dataset = make_dataset(args, count * per_step)
    steps = []
    for step in range(count):
        part = VLMDataset(dataset.samples[step * per_step : (step + 1) * per_step], dataset.vision)
        items = [part[i] for i in range(len(part))]
        bins = pack_bins(part, args.seq_length, seed=args.seed + step)
        rows = VLMPackedDataset(part, bins, args.seq_length, pad_id=pad_id)
        steps.append({"padded": vlm_collate(items, pad_id=pad_id), "packed": packed_collate(list(rows))})
    return steps


def _digest(steps: list[dict[str, Any]]) -> str:
    """Short hash of every step's tokens, labels and pixels (equal across rows when they train the same data)."""
    sha = hashlib.sha1()
    for step in steps:
        for key in ("input_ids", "labels", "pixel_values", "image_grid_thw"):
            sha.update(step["padded"][key].contiguous().numpy().tobytes())
    return sha.hexdigest()[:12]


# ----- the rows -----------------------------------------------------------------------------------------------
def _hf_config(args: argparse.Namespace) -> Any:
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(**_shape(args))
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = config.vision_config._attn_implementation = "sdpa"
    return config


def _work_file(args: argparse.Namespace, name: str) -> Path:
    tag = f"{'tiny' if args.tiny else args.shape}_seed{args.seed}"
    return Path(args.work_dir) / f"{tag}_{name}"


def _liger() -> bool:
    """Patches transformers' Qwen2.5-VL classes with Liger kernels; ``False`` when liger-kernel is not installed."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2_5_vl
    except ImportError:
        return False
    apply_liger_kernel_to_qwen2_5_vl()
    return True


def build_hf(
    args: argparse.Namespace, row: str
) -> tuple[Any, Callable[[dict[str, Any]], Any], dict[str, Any]]:
    """transformers' model in bf16 (random init, or the saved initial weights in loss mode), its loss and the
    row's settings."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    liger = row == "transformers+liger" and _liger()
    dtype = torch.float32 if args.fp32_weights else torch.bfloat16
    if args.loss_steps:
        init = _work_file(args, "init")
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            init, dtype=dtype, attn_implementation="sdpa"
        )
        model.to(args.device)
    else:
        with torch.device(args.device):
            model = Qwen2_5_VLForConditionalGeneration._from_config(_hf_config(args), dtype=dtype)
    model.train()
    autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.fp32_weights)

    def loss_fn(batch: dict[str, Any]) -> Any:
        # Our labels come shifted (labels[i] is the target of position i); transformers takes them as shift_labels.
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}
        with autocast:
            return model(**inputs, labels=batch["labels"], shift_labels=batch["labels"], use_cache=False).loss

    weights = "fp32 weights + bf16 autocast" if args.fp32_weights else "bf16 weights"
    setting = f"{weights}, SDPA, " + ("Liger kernels" if liger else "no Liger")
    if row == "transformers+liger" and not liger:
        setting += " (liger-kernel not installed: plain transformers)"
    info = {"setting": setting, "liger": liger, "attention": f"sdpa ({model.config._attn_implementation})"}
    return model, loss_fn, info


def build_ours(
    args: argparse.Namespace, row: str
) -> tuple[Any, Callable[[dict[str, Any]], Any], dict[str, Any]]:
    """Our module with fp32 master weights and its performance settings applied, its loss and the row's settings."""
    import torch

    from forge_lightning.modules.layers.attention import resolve_attention_backend
    from forge_lightning.modules.vlm import VisionLanguageModule
    from forge_lightning.performance import apply_performance, resolve

    kernel = args.attention if args.attention in ("auto", "fa4") else "sdpa"
    performance: dict[str, Any] = {"attention": {"packed": args.attention, "kernel": kernel}}
    if args.activation_checkpointing != "none":
        performance["activation_checkpointing"] = args.activation_checkpointing
    if args.compile in (False, "always"):
        performance["compile"] = args.compile == "always"
    if args.loss_steps:
        module = VisionLanguageModule.from_pretrained(_work_file(args, "init"), performance=performance)
        module.to(device=args.device, dtype=torch.float32)
    else:
        with torch.device("meta"):
            module = VisionLanguageModule(
                config=str(_work_file(args, "config.json")), performance=performance
            )
        module.to_empty(device=args.device)
        module.model.init_weights()
    module.train()
    apply_performance(module.parallel_plan(), module.performance, args.device)
    resolved = resolve(module.performance, args.device)
    device = torch.device(args.device)
    packed = resolve_attention_backend(args.attention, device)
    vision = resolve_attention_backend(args.attention, device, varying_shapes=True)
    llm = f"packed {packed}" if row == "ours-packed" else "sdpa with the padding mask"
    sdpa = ", ".join(resolved.sdpa) if resolved.sdpa else "torch's default"
    attention = (
        f"LLM {llm}; vision {vision} per window; kernel {resolved.attention_kernel}; SDPA order {sdpa}"
    )
    compiled = "compiled blocks" if resolved.compile else "eager"
    setting = f"fp32 masters + bf16 autocast, {compiled}, AC {args.activation_checkpointing}, "
    setting += f"loss kernel {resolved.kernels['cross_entropy']}"

    def loss_fn(batch: dict[str, Any]) -> Any:
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16):
            loss_sum, tokens = module.loss_sum(batch)
        return loss_sum / tokens

    return module, loss_fn, {"setting": setting, "attention": attention}


def flops_per_step(args: argparse.Namespace, steps: list[dict[str, Any]]) -> list[float]:
    """Training FLOPs of each step by ``VisionLanguageModule.batch_stats`` on its padded batch (a model on the
    meta device: the count reads shapes only)."""
    import torch

    from forge_lightning.modules.vlm import VisionLanguageModule

    with torch.device("meta"):
        module = VisionLanguageModule(config=str(_work_file(args, "config.json")))
    return [module.batch_stats(step["padded"])["flops"] for step in steps]


def _to(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) for k, v in batch.items()}


def parse_row(row: str, args: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """The row's name and ``args`` with its options applied (``ours-packed:ac=selective,eager``).

    Raises:
        SystemExit: an unknown row or option.
    """
    name, _, options = row.partition(":")
    if name not in ROWS:
        raise SystemExit(f"--rows: unknown row {name!r}; rows are {', '.join(ROWS)}")
    settings = argparse.Namespace(**vars(args), fp32_weights=False, fit_ac=None, fit_rows=None)
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        if name == FIT_ROW:
            if key == "ac" and value in AC_CHOICES:
                settings.fit_ac = value
            elif key == "rows" and value.isdigit() and int(value) > 0:
                settings.fit_rows = int(value)
            else:
                raise SystemExit(
                    f"--rows {row!r}: unknown option {option!r}; {FIT_ROW} takes ac={'|'.join(AC_CHOICES)}, rows=N"
                )
        elif name in HF_ROWS:
            if option != "fp32":
                raise SystemExit(f"--rows {row!r}: unknown option {option!r}; {name} takes fp32")
            settings.fp32_weights = True
        elif key == "ac" and value in AC_CHOICES:
            settings.activation_checkpointing = value
        elif key == "attn" and value in ATTENTION_CHOICES:
            settings.attention = value
        elif option in ("eager", "compile"):
            settings.compile = {"eager": False, "compile": "always"}[option]
        else:
            raise SystemExit(
                f"--rows {row!r}: unknown option {option!r}; options are ac={'|'.join(AC_CHOICES)}, "
                f"attn={'|'.join(ATTENTION_CHOICES)}, eager, compile"
            )
    return name, settings


def run_row(args: argparse.Namespace, row: str) -> dict[str, Any]:
    """Train one row (``--warmup`` + ``--steps`` steps, or ``--loss-steps``) and measure it."""
    import torch

    name, args = parse_row(row, args)
    if name == FIT_ROW:
        import vlm_fit_row

        work = _work_file(args, "fit")
        work.mkdir(parents=True, exist_ok=True)
        base = json.loads(_work_file(args, "config.json").read_text())
        return {"row": row, **vlm_fit_row.run(args, base, work)}
    torch.manual_seed(args.seed)
    cuda = args.device == "cuda"
    count = args.loss_steps or args.warmup + args.steps
    steps = step_batches(args, count)
    layout = "packed" if name == "ours-packed" else "padded"
    flops = flops_per_step(args, steps)
    samples = [len(s["padded"]["input_ids"]) for s in steps]
    tokens = [int(s["padded"]["attention_mask"].sum()) for s in steps]
    digest = _digest(steps)
    batches = [_to(s[layout], args.device) for s in steps]
    build = build_hf if name in HF_ROWS else build_ours
    model, loss_fn, info = build(args, name)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, fused=cuda, foreach=not cuda or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    losses = []

    def step(batch: dict[str, Any]) -> None:
        loss = loss_fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.detach())

    warmup = min(args.warmup, count - 1)
    timer = harness.run_steps(step, batches, warmup, cuda)
    timed = slice(warmup, count)
    tokens_per_s = timer.rate(sum(tokens[timed]) / timer.steps)
    tflops = harness.tflops(sum(flops[timed]) / timer.elapsed_s)
    loss_values = [float(x) for x in losses]
    shapes = [list(b["input_ids"].shape) for b in batches]
    return {
        "row": row,
        **info,
        "layout": layout,
        "tokens_per_s": tokens_per_s,
        "samples_per_s": timer.rate(sum(samples[timed]) / timer.steps),
        "tflops": tflops,
        "mfu": harness.mfu(tflops),
        "peak_mem_gb": harness.peak_memory_gb(cuda),
        "step_s": timer.step_s,
        "median_step_s": timer.median_step_s,
        "timed_steps": timer.steps,
        "real_tokens_per_step": sum(tokens[timed]) / timer.steps,
        "padded_tokens_per_step": sum(a * b for a, b in shapes[timed]) / timer.steps,
        "batch_shapes": shapes,
        "first_loss": loss_values[0],
        "last_loss": loss_values[-1],
        "losses": loss_values,
        "data_digest": digest,
        "params": sum(p.numel() for p in model.parameters()),
    }


def write_init(args: argparse.Namespace) -> dict[str, Any]:
    """Loss mode: transformers' seeded random init, saved in bf16 where every row loads it."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(_hf_config(args), dtype=torch.bfloat16)
    model.save_pretrained(_work_file(args, "init"))
    return {"init": str(_work_file(args, "init"))}


# ----- the parent: children, table, JSON --------------------------------------------------------------------
def _child(args: argparse.Namespace, child: str) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    run = harness.run_child(
        [sys.executable, str(Path(__file__).resolve()), "--child", child, *sys.argv[1:]], env
    )
    log = Path(args.work_dir) / "logs" / f"vlm_{child}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(run.stdout + run.stderr)
    return run.result() or {"row": child, "error": run.failure(), "log": str(log)}


def _baseline(results: list[dict[str, Any]]) -> dict[str, Any]:
    return next((harness.reference_row(results, lambda r, b=b: r["row"] == b) for b in HF_ROWS if any(
        r["row"] == b for r in results)), None) or {}  # fmt: skip


def _tail_loss(row: dict[str, Any], steps: int = 20) -> float:
    """Mean loss of the last ``steps`` steps (less noisy than the last step alone)."""
    tail = row["losses"][-steps:]
    return sum(tail) / len(tail)


def table(results: list[dict[str, Any]], loss: bool) -> str:
    """One row per path. Speed: the ratio against the first plain transformers row. Loss: the last-20 mean loss
    against every transformers row (each weight precision)."""
    if loss:
        refs = [r for r in results if r["row"].partition(":")[0] in HF_ROWS and "error" not in r]
        columns = ["row", "setting", "first loss", "final loss", "last-20 loss"]
        columns += [f"vs {ref['row']}" for ref in refs]
    else:
        ref = _baseline(results)
        columns = ["row", "setting", "attention", "real tokens/s", "samples/s", "TFLOP/s", "MFU", "peak mem"]
        columns += [f"vs {ref.get('row', 'baseline')}", "first loss", "last loss"]
    lines = []
    for r in results:
        if "error" in r:
            lines.append([r["row"], harness.failed(r["error"])])
            continue
        if loss:
            line = [r["row"], r["setting"], f"{r['first_loss']:.4f}", f"{r['last_loss']:.4f}"]
            line.append(f"{_tail_loss(r):.4f}")
            lines.append([*line, *(harness.change(_tail_loss(r), _tail_loss(ref)) for ref in refs)])
            continue
        line = [r["row"], r["setting"], r["attention"], f"{r['tokens_per_s'] / 1e3:.2f}k"]
        line += [f"{r['samples_per_s']:.2f}", f"{r['tflops']:.1f}", f"{100 * r['mfu']:.1f}%"]
        line += [f"{r['peak_mem_gb']:.1f} GB", harness.ratio(r["tokens_per_s"], ref.get("tokens_per_s"))]
        lines.append([*line, f"{r['first_loss']:.4f}", f"{r['last_loss']:.4f}"])
    return harness.markdown_table(columns, lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-vl-3b", choices=[s for s in SHAPES if s != "tiny"])
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny shape with small images and texts (CPU checks)"
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        default=["transformers+liger", "ours-padded", "ours-packed"],
        help=f"rows: {', '.join(ROWS)}; options (module docstring): transformers+liger:fp32, "
        f"ours-packed:ac={'|'.join(AC_CHOICES)},attn={'|'.join(ATTENTION_CHOICES)},eager|compile, "
        "forge-fit:ac=...,rows=N",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--samples-per-step", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=4096, help="tokens per packed row (ours-packed)")
    parser.add_argument("--image-sides", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="image width and height range in pixels (default 224 896)")  # fmt: skip
    parser.add_argument("--text-tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="text tokens per sample (default 64 1024)")  # fmt: skip
    parser.add_argument("--attention", default=None, choices=ATTENTION_CHOICES,
                        help="our packed-attention backend (LLM packed rows, vision windows); default varlen on "
                        "CUDA (the encoder's shapes change with every image grid), auto elsewhere")  # fmt: skip
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="ours: no torch.compile")
    parser.add_argument(
        "--loss-steps", type=int, default=0, help="compare losses over this many steps instead"
    )
    parser.add_argument(
        "--activation-checkpointing", default="none", choices=("none", "selective", "full"), help="ours"
    )
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work-dir", default="data/vlm_work", help="config, initial weights and logs")
    parser.add_argument("--out", default=None, help="JSON output (default benchmarks/results/...)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    ranges = _TINY_RANGES if args.tiny else {"image_sides": (224, 896), "text_tokens": (64, 1024)}
    for name, default in ranges.items():
        low, high = getattr(args, name) or default
        if not 0 < low <= high:
            raise SystemExit(f"--{name.replace('_', '-')} ({low} {high}): need 0 < MIN <= MAX")
        setattr(args, name, (low, high))
    for name in ("steps", "samples_per_step", "seq_length"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1")
    if args.attention is None:
        args.attention = "varlen" if args.device.startswith("cuda") else "auto"
    for row in args.rows:
        name, _ = parse_row(row, args)
        if name == FIT_ROW and args.loss_steps:
            raise SystemExit(f"--loss-steps: the {FIT_ROW} row trains other token ids; leave it out")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        with harness.errors_reported():
            run = write_init if args.child == "init" else lambda a: run_row(a, a.child)
            harness.emit_result(run(args))
        return
    sys.path.insert(0, str(REPO))
    config_file = _work_file(args, "config.json")
    config_file.parent.mkdir(parents=True, exist_ok=True)
    _hf_config(args).to_json_file(config_file)
    if args.loss_steps:
        init = _child(args, "init")
        if "error" in init:
            raise SystemExit(f"writing the initial weights failed: {init['error']}")
    suffix = "_loss" if args.loss_steps else ""
    shape = "tiny" if args.tiny else args.shape
    name = (
        f"vlm_throughput{suffix}.json" if shape == "qwen2.5-vl-3b" else f"vlm_throughput_{shape}{suffix}.json"
    )
    out = Path(args.out or REPO / "benchmarks" / "results" / name)
    gpu = harness.machine(args.device == "cuda")
    results: list[dict[str, Any]] = []
    for row in args.rows:
        results.append(_child(args, row))
        print(
            json.dumps({k: v for k, v in results[-1].items() if k not in ("losses", "batch_shapes")}),
            flush=True,
        )
        digests = {r["data_digest"] for r in results if r.get("data_digest")}
        meta = {"gpu": gpu, **harness.run_meta(__file__), "shape": shape, "same_data": len(digests) <= 1}
        harness.write_json(
            out, {"meta": meta, "results": results}
        )  # after every row: a cut-off run keeps them
    what = (
        f"{args.loss_steps} steps, same inputs and initial weights"
        if args.loss_steps
        else f"{args.steps} timed steps"
    )
    print(f"\n{shape}, {args.samples_per_step} samples per step (images {args.image_sides[0]}-{args.image_sides[1]} px, "
          f"text {args.text_tokens[0]}-{args.text_tokens[1]} tokens), packed rows of {args.seq_length}, {what}, "
          f"{gpu}, torch {meta['torch']}; data {'identical' if meta['same_data'] else 'DIFFERENT'} across rows; {out}")  # fmt: skip
    print(table(results, loss=bool(args.loss_steps)))


if __name__ == "__main__":
    main()

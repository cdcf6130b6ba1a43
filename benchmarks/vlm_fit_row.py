"""The ``forge-fit`` row of ``vlm_throughput.py``: the product path, ``forge fit`` of the Qwen2.5-VL recipe.

The child writes what the recipe reads: LLaVA JSON lines with one ``<image>`` per record (PNG files beside them,
the sides drawn from ``--image-sides`` as in the other rows) and a question / answer of about ``--text-tokens``
tokens, a ChatML byte-level BPE tokenizer with the Qwen-VL vision tokens (no download), and the benchmark shape's
``config.json`` with that tokenizer's special-token ids (the compute does not depend on the ids). It then runs
``python -m forge_lightning fit`` with ``configs/vlm/qwen2.5-vl-3b/sft_fsdp2.yaml`` and only these changes: one
device, the random-init config instead of ``pretrained``, the data above, ``seq_length`` = ``--seq-length``,
``max_steps``, and the callbacks reduced to ``ThroughputMonitor`` (no checkpoint or export of the 3B model). The
samples are drawn like the other rows' but are not the same token ids (those are random ids, these are text), so
the row is compared on real tokens/s, not on its loss.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import harness  # this script's directory is on sys.path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "vlm" / "qwen2.5-vl-3b" / "sft_fsdp2.yaml"
_VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
_CONFIG_IDS = ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id")
_MAX_WORDS = 400  # distinct words of the synthetic text, each one token of the tokenizer


def _word(i: int) -> str:
    return "".join(chr(ord("a") + int(d)) for d in f"{i:03d}")


def write_data(
    args: argparse.Namespace, base_config: dict[str, Any], work: Path, count: int
) -> dict[str, Path]:
    """Records, images, tokenizer and model config of the row under ``work``."""
    import numpy as np
    from PIL import Image
    from tokenizers import Tokenizer

    from forge_lightning.datamodules.chat import add_chat_template
    from forge_lightning.datamodules.tokenizer import add_special_tokens, train_bpe_tokenizer

    tokenizer_dir = work / "tokenizer"
    # A three-letter word takes at most two merges; the vocabulary must fit the model's (the tiny shape's 512).
    vocab = min(256 + 2 * _MAX_WORDS + 64, base_config["text_config"]["vocab_size"] - len(_VISION_TOKENS) - 8)
    words = [_word(i) for i in range(min(_MAX_WORDS, (vocab - 256 - 8) // 2))]
    train_bpe_tokenizer([" ".join(words)] * 4, vocab, tokenizer_dir, min_frequency=1)
    add_chat_template(tokenizer_dir, "chatml")
    add_special_tokens(tokenizer_dir, _VISION_TOKENS)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = dict(zip(_CONFIG_IDS, (tokenizer.token_to_id(t) for t in _VISION_TOKENS), strict=True))
    config = {**base_config, **ids, "pad_token_id": tokenizer.token_to_id("<|endoftext|>")}
    config_file = work / "config.json"
    config_file.write_text(json.dumps(config, indent=2))

    rng = np.random.default_rng(args.seed)
    images, records = work / "images", []
    images.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        width, height = (int(s) for s in rng.integers(args.image_sides[0], args.image_sides[1] + 1, 2))
        coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR).save(images / f"{i}.png")
        text = int(rng.integers(args.text_tokens[0], args.text_tokens[1] + 1))
        question = max(1, int(text * rng.uniform(0.2, 0.6)))
        said = [
            " ".join(words[w] for w in rng.integers(0, len(words), n))
            for n in (question, max(1, text - question))
        ]
        records.append({
            "image": f"{i}.png",
            "conversations": [{"from": "human", "value": "<image>\n" + said[0]}, {"from": "gpt", "value": said[1]}],
        })  # fmt: skip
    train = work / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"train": train, "images": images, "tokenizer": tokenizer_dir, "config": config_file}


def write_recipe(args: argparse.Namespace, files: dict[str, Path], work: Path, max_steps: int) -> Path:
    """The recipe with the row's changes (module docstring)."""
    import yaml

    recipe = yaml.safe_load(RECIPE.read_text())
    trainer = recipe["trainer"]
    cuda = args.device.startswith("cuda")
    harness.single_device_trainer(trainer, cuda=cuda, work=work, max_steps=max_steps)
    model = recipe["model"]["init_args"]
    del model["pretrained"]
    model["config"] = str(files["config"])
    if args.fit_ac is not None:
        for name in ("vision", "projector", "llm"):
            model["components"].setdefault(name, {})["activation_checkpointing"] = args.fit_ac
    data = recipe["data"]["init_args"]
    if args.fit_rows is not None:
        data["batch_size"], trainer["accumulate_grad_batches"] = args.fit_rows, 1
    data.update(
        train_files=str(files["train"]), image_root=str(files["images"]), tokenizer=str(files["tokenizer"])
    )
    data.update(seq_length=args.seq_length, num_workers=2 if cuda else 0, pin_memory=cuda)
    data["max_patches_per_row"] = max(data["max_patches_per_row"], 8 * args.seq_length)
    if not cuda:  # CPU checks: FlashAttention and the compiler need the GPU
        recipe["performance"] = {"attention": {"packed": "auto"}, "compile": False}
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run(args: argparse.Namespace, base_config: dict[str, Any], work: Path) -> dict[str, Any]:
    """Write the data and recipe, run ``forge fit`` in a child process, and read its throughput windows."""

    max_steps, timed = harness.fit_steps(args.steps)
    # Each optimizer step takes accumulate_grad_batches packed rows of about seq_length tokens.
    rows_per_step = args.fit_rows or 2  # the recipe: batch_size 1 x accumulate_grad_batches 2
    count = max(
        64, 2 * rows_per_step * max_steps * args.seq_length // max(1, sum(args.text_tokens) // 2 + 400)
    )
    files = write_data(args, base_config, work, count)
    recipe = write_recipe(args, files, work, max_steps)
    command, measured = harness.forge_fit(recipe, work)
    tflops = measured["tflops"]
    return {
        "setting": f"forge fit {RECIPE.relative_to(REPO)}: 1 device, seq_length {args.seq_length}, "
        + (f"AC {args.fit_ac}, " if args.fit_ac else "the recipe's AC, ")
        + (f"{args.fit_rows} rows per micro-batch, " if args.fit_rows else "")
        + f"{count} text records, {timed} timed steps",
        "attention": "the recipe's performance settings",
        "layout": "packed (data module)",
        **measured,
        "mfu": harness.mfu(tflops),
        "timed_steps": measured["windows"] * harness.FIT_WINDOW,
        "first_loss": measured["losses"][0],
        "last_loss": measured["losses"][-1],
        "data_digest": None,
        "command": " ".join(command[1:]),
    }

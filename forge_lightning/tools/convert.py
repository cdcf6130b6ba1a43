"""``forge-convert``: checkpoint conversions.

``forge-convert ckpt-to-hf --ckpt last.ckpt --output DIR [--dtype bfloat16]`` turns a Lightning checkpoint of a
model with ``save_pretrained`` (e.g. ``CausalLM``) into a Hugging Face directory. Later conversions (LoRA merge,
Megatron) plug in as one function each in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_lightning_checkpoint(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"forge-convert: checkpoint {path} not found")
    return torch.load(path, map_location="cpu", weights_only=True)


def ckpt_to_hf(args: argparse.Namespace) -> None:
    """Export the model in a Lightning checkpoint as a Hugging Face directory."""
    ckpt = _load_lightning_checkpoint(Path(args.ckpt))
    module_path = args.module
    module_name, _, class_name = module_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    hparams = ckpt.get("hyper_parameters")
    if not hparams:
        raise SystemExit(
            f"forge-convert: {args.ckpt} holds no hyper_parameters; was it written by {class_name}?"
        )
    module = cls(**hparams)
    missing, unexpected = module.load_state_dict(ckpt["state_dict"], strict=False)
    if missing or unexpected:
        raise SystemExit(
            f"forge-convert: checkpoint does not match {class_name}: missing {missing}, unexpected {unexpected}"
        )
    module.save_pretrained(Path(args.output), dtype=DTYPES[args.dtype] if args.dtype else None)
    print(f"wrote {args.output}")


def _add_ckpt_to_hf(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt-to-hf", help="Lightning checkpoint -> Hugging Face directory")
    p.add_argument("--ckpt", required=True, help="Lightning .ckpt file")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument(
        "--module", default="forge_lightning.modules.llm.CausalLM", help="LightningModule class path"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights before saving")
    p.set_defaults(func=ckpt_to_hf)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_ckpt_to_hf]


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``forge-convert``."""
    parser = argparse.ArgumentParser(prog="forge-convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()

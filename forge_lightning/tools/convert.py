"""``forge-convert``: checkpoint conversions.

``forge-convert ckpt-to-hf --ckpt last.ckpt --output DIR [--dtype bfloat16]`` turns a Lightning checkpoint of a
model with ``save_pretrained`` (e.g. ``CausalLM``) into a Hugging Face directory. ``forge-convert merge-lora --base HF_DIR --adapter DIR --output DIR`` folds a LoRA adapter
into its base model and saves a full fp32 Hugging Face checkpoint. ``forge-convert hf-to-megatron`` /
``megatron-to-hf`` convert between Hugging Face and MegatronStrategy's megatron-core dist-checkpoints (megatron-core
is imported only when one of them runs). ``forge-convert verify PATH`` checks a checkpoint or export against its
manifest (:mod:`forge_lightning.manifest`). Each command is one function in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from forge_lightning import manifest
from forge_lightning.manifest import verify_before_load

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_lightning_checkpoint(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"forge-convert: checkpoint {path} not found")
    verify_before_load(path)
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
    dtype = DTYPES[args.dtype] if args.dtype else None
    module.save_pretrained(Path(args.output), dtype=dtype, overwrite=args.overwrite)
    print(f"wrote {args.output}")


def _add_ckpt_to_hf(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt-to-hf", help="Lightning checkpoint -> Hugging Face directory")
    p.add_argument("--ckpt", required=True, help="Lightning .ckpt file")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument(
        "--module", default="forge_lightning.modules.llm.CausalLM", help="LightningModule class path"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights before saving")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(func=ckpt_to_hf)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def merge_lora(args: argparse.Namespace) -> None:
    """Merge a LoRA adapter into its base Hugging Face model and save the result in fp32."""
    from forge_lightning.modules.llm import DecoderLM, LLMConfig, load_pretrained, save_pretrained
    from forge_lightning.modules.lora import merge_adapter

    base, adapter = Path(args.base), Path(args.adapter)
    if not (base / "config.json").is_file():
        raise SystemExit(f"forge-convert: no config.json in base model directory {base}")
    if not (adapter / "adapter_config.json").is_file():
        raise SystemExit(f"forge-convert: no adapter_config.json in adapter directory {adapter}")
    config = LLMConfig.load(base)
    model = load_pretrained(DecoderLM(config).float(), base)
    merged = merge_adapter(model, adapter)
    save_pretrained(merged, config, args.output, dtype=torch.float32, overwrite=args.overwrite)
    # The tokenizer travels with the model: the adapter's (saved with the fine-tuning data) or else the base's.
    source = adapter if (adapter / "tokenizer_config.json").is_file() else base
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, Path(args.output) / name)
    print(f"wrote {args.output}")


def _add_merge_lora(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge-lora", help="LoRA adapter + base Hugging Face model -> merged fp32 checkpoint")
    p.add_argument("--base", required=True, help="base Hugging Face model directory")
    p.add_argument("--adapter", required=True, help="PEFT adapter directory (adapter_config.json)")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(func=merge_lora)


def _megatron_convert(command: str) -> Any:
    """``forge_lightning.tools.megatron_convert``, imported on demand (it imports megatron-core)."""
    try:
        return importlib.import_module("forge_lightning.tools.megatron_convert")
    except ImportError as err:
        raise SystemExit(
            f"forge-convert {command} needs megatron-core: install the `megatron` extra ({err})"
        ) from err


def hf_to_megatron(args: argparse.Namespace) -> None:
    """Write a Hugging Face directory as a MegatronStrategy checkpoint (weights only)."""
    print(f"wrote {_megatron_convert('hf-to-megatron').hf_to_megatron(args.hf, args.output)}")


def megatron_to_hf(args: argparse.Namespace) -> None:
    """Write the weights of a MegatronStrategy checkpoint (any layout) as a Hugging Face directory."""
    convert = _megatron_convert("megatron-to-hf").megatron_to_hf
    dtype = DTYPES[args.dtype] if args.dtype else None
    print(f"wrote {convert(args.megatron, args.output, dtype=dtype, overwrite=args.overwrite)}")


def _add_megatron(sub: argparse._SubParsersAction) -> None:
    """``hf-to-megatron`` / ``megatron-to-hf``; megatron-core (the ``megatron`` extra) is imported only by them."""
    p = sub.add_parser(
        "hf-to-megatron", help="Hugging Face directory -> MegatronStrategy checkpoint (weights)"
    )
    p.add_argument("--hf", required=True, help="Hugging Face model directory")
    p.add_argument("--output", required=True, help="megatron checkpoint directory to create")
    p.set_defaults(func=hf_to_megatron)
    p = sub.add_parser(
        "megatron-to-hf", help="MegatronStrategy checkpoint (any layout) -> Hugging Face directory"
    )
    p.add_argument(
        "--megatron", required=True, help="checkpoint directory (MegatronStrategy or hf-to-megatron)"
    )
    p.add_argument("--output", required=True, help="Hugging Face directory to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights before saving")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(func=megatron_to_hf)


def verify(args: argparse.Namespace) -> None:
    """Check a checkpoint or export against its manifest; exit 1 naming each file that is missing or changed."""
    path = Path(args.path)
    if not path.exists():
        raise SystemExit(f"forge-convert verify: {path} does not exist")
    result = manifest.verify(path, threads=args.threads)
    if result.manifest is None:
        raise SystemExit(
            f"forge-convert verify: {path} has no manifest ({manifest.manifest_of(path).name}): it was written "
            "before forge-lightning wrote manifests, or by another tool, and cannot be verified"
        )
    for name in result.unlisted:
        print(f"not covered by the manifest (not checked): {name}")
    manifest.refuse_mismatch(path, result.problems)
    print(
        f"verified {path}: {result.checked} files, {result.bytes / 1e9:.2f} GB match {result.manifest.name}"
    )


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a checkpoint or export against its manifest")
    p.add_argument("path", help="checkpoint file or directory, or Hugging Face export directory")
    p.add_argument("--threads", type=int, default=manifest.HASH_THREADS, help="files hashed at a time")
    p.set_defaults(func=verify)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_ckpt_to_hf,
    _add_merge_lora,
    _add_megatron,
    _add_verify,
]


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``forge-convert``."""
    parser = argparse.ArgumentParser(prog="forge-convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (FileExistsError, manifest.ManifestError) as error:
        raise SystemExit(f"forge-convert: {error}") from None


if __name__ == "__main__":
    main()

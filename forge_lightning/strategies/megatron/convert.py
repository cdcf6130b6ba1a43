"""``forge-convert hf-to-megatron`` / ``megatron-to-hf``: Hugging Face <-> megatron-core dist-checkpoint.

A megatron checkpoint here is megatron-core's ``dist_checkpointing`` directory of the GPT model's sharded state
dict (loadable at any TP / PP layout) plus the Hugging Face ``config.json`` it came from. Conversion runs in one
process on the CPU (TP = PP = 1)::

    forge-convert hf-to-megatron --hf HF_DIR --output MEGATRON_DIR
    forge-convert megatron-to-hf --megatron MEGATRON_DIR --output HF_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from forge_lightning.modules.llm.config import LLMConfig


@contextmanager
def _single_process_world() -> Any:
    """A one-process gloo group with megatron's parallel state at TP = PP = 1 (torn down on exit)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    owned = not dist.is_initialized()
    if owned:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()


def _build(config: LLMConfig) -> torch.nn.Module:
    from forge_lightning.modules.llm.megatron import build_gpt_model, transformer_config
    from forge_lightning.strategies.megatron.layer_spec import gpt_decoder_spec

    tf_config = transformer_config(config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    spec = gpt_decoder_spec(tf_config, use_transformer_engine=False)
    return build_gpt_model(config, tf_config, spec, pre_process=True, post_process=True)


def hf_to_megatron(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write a Hugging Face checkpoint as a megatron-core dist-checkpoint directory (plus its ``config.json``).

    Args:
        hf_dir: Hugging Face directory (``config.json`` + safetensors).
        out_dir: the megatron checkpoint directory to create (must not exist or be empty).
    """
    from megatron.core import dist_checkpointing

    from forge_lightning.strategies.megatron.bridge import load_hf_checkpoint

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = LLMConfig.load(hf_dir)
    with _single_process_world():
        model = _build(config)
        load_hf_checkpoint([model], config, hf_dir)
        dist_checkpointing.save(model.sharded_state_dict(), str(out_dir))
    shutil.copy2(hf_dir / "config.json", out_dir / "config.json")
    return out_dir


def megatron_to_hf(
    megatron_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a megatron-core dist-checkpoint directory (from :func:`hf_to_megatron`) as a Hugging Face directory.

    Args:
        megatron_dir: the megatron checkpoint directory (with its ``config.json``).
        out_dir: the Hugging Face directory to write.
        dtype: cast floating tensors (default: as stored).
        overwrite: replace a non-empty ``out_dir``.
    """
    from megatron.core import dist_checkpointing

    from forge_lightning.modules.llm.hf import save_pretrained
    from forge_lightning.strategies.megatron.bridge import export_hf_state

    megatron_dir = Path(megatron_dir)
    config = LLMConfig.load(megatron_dir / "config.json")
    with _single_process_world():
        model = _build(config)
        state = dist_checkpointing.load(model.sharded_state_dict(), str(megatron_dir))
        model.load_state_dict(state)
        tensors = export_hf_state([model], config)
    return save_pretrained(None, config, out_dir, dtype=dtype, overwrite=overwrite, state_dict=tensors)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf_to_megatron_command(args: argparse.Namespace) -> None:
    print(f"wrote {hf_to_megatron(args.hf, args.output)}")


def _megatron_to_hf_command(args: argparse.Namespace) -> None:
    dtype = _DTYPES[args.dtype] if args.dtype else None
    print(f"wrote {megatron_to_hf(args.megatron, args.output, dtype=dtype, overwrite=args.overwrite)}")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``hf-to-megatron`` and ``megatron-to-hf`` on ``forge-convert``'s subparsers."""
    p = sub.add_parser("hf-to-megatron", help="Hugging Face directory -> megatron-core dist-checkpoint")
    p.add_argument("--hf", required=True, help="Hugging Face model directory")
    p.add_argument("--output", required=True, help="megatron checkpoint directory to create")
    p.set_defaults(func=_hf_to_megatron_command)
    p = sub.add_parser("megatron-to-hf", help="megatron-core dist-checkpoint -> Hugging Face directory")
    p.add_argument("--megatron", required=True, help="megatron checkpoint directory (from hf-to-megatron)")
    p.add_argument("--output", required=True, help="Hugging Face directory to write")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast weights before saving")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(func=_megatron_to_hf_command)

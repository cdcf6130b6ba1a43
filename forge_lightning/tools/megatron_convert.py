"""``forge-convert hf-to-megatron`` / ``megatron-to-hf``: Hugging Face <-> MegatronStrategy checkpoints.

Both read and write MegatronStrategy's checkpoint format (``forge_lightning/strategies/megatron/checkpoint.py``): megatron-core's ``dist_checkpointing``
directory (torch_dist) + ``meta.pt`` + the Hugging Face ``config.json``. ``hf-to-megatron`` writes the weights
only (no optimizer, no loop state); ``megatron-to-hf`` reads the weights of any checkpoint, whatever layout trained
it. Conversion runs in one process (TP = PP = 1) through the decoder LM's megatron-core twin
(``forge_lightning.modules.llm.megatron``)::

    forge-convert hf-to-megatron --hf HF_DIR --output MEGATRON_DIR
    forge-convert megatron-to-hf --megatron MEGATRON_DIR --output HF_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.strategies.megatron import checkpoint as ckpt

_ONE_PROCESS = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1}


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
    from forge_lightning.modules.llm.megatron import build_gpt_model, gpt_decoder_spec, transformer_config

    tf_config = transformer_config(config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    spec = gpt_decoder_spec(tf_config, use_transformer_engine=False)
    return build_gpt_model(config, tf_config, spec, pre_process=True, post_process=True)


def hf_to_megatron(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write a Hugging Face checkpoint as a MegatronStrategy checkpoint directory holding the weights only.

    Args:
        hf_dir: Hugging Face directory (``config.json`` + safetensors).
        out_dir: the megatron checkpoint directory to create (must not exist or be empty).
    """
    from forge_lightning.modules.llm.megatron import load_hf_checkpoint

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    config = LLMConfig.load(hf_dir)
    with _single_process_world():
        model = _build(config)
        load_hf_checkpoint([model], config, hf_dir)
        checkpoint = {
            ckpt.SHARDED_KEY: ckpt.sharded_state_dict([model], None, is_loading=False),
            ckpt.HF_CONFIG_KEY: json.loads((hf_dir / "config.json").read_text()),
            ckpt.INFO_KEY: {"layout": _ONE_PROCESS, "world_size": 1, "optimizer": None},
        }
        ckpt.MegatronCheckpointIO().save_checkpoint(checkpoint, out_dir)
    return out_dir


def megatron_to_hf(
    megatron_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the weights of a MegatronStrategy checkpoint (any layout) as a Hugging Face directory.

    Args:
        megatron_dir: a checkpoint directory written by MegatronStrategy or :func:`hf_to_megatron`.
        out_dir: the Hugging Face directory to write.
        dtype: cast floating tensors (default: as stored).
        overwrite: replace a non-empty ``out_dir``.
    """
    from forge_lightning.modules.llm.hf import save_pretrained
    from forge_lightning.modules.llm.megatron import export_hf_state

    megatron_dir = Path(megatron_dir)
    ckpt.check_is_checkpoint(megatron_dir)
    config = LLMConfig.load(ckpt.read_hf_config(megatron_dir))
    with _single_process_world():
        model = _build(config).to(_stored_dtype(megatron_dir))
        template = ckpt.sharded_state_dict([model], None, is_loading=True)
        loaded = ckpt.MegatronCheckpointIO().load_checkpoint(megatron_dir, sharded_state_dict=template)
        ckpt.load_into([model], None, loaded[ckpt.SHARDED_KEY])
        tensors = export_hf_state([model], config)
    return save_pretrained(None, config, out_dir, dtype=dtype, overwrite=overwrite, state_dict=tensors)


def _stored_dtype(path: Path) -> torch.dtype:
    """The dtype the checkpoint's model weights were saved in (bf16 for bf16 training, else fp32)."""
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(str(path))
    return stored["embedding.word_embeddings.weight"].dtype

"""Hugging Face interchange of whole Qwen2.5-VL checkpoints (``config.json`` and safetensors).

Tensor names, by layout (both are read; the transformers 5 one is written)::

    ours                 transformers 5              published / transformers 4
    vision.*             model.visual.*              visual.*
    llm.model.*          model.language_model.*      model.*
    llm.lm_head.weight   lm_head.weight              lm_head.weight      (absent when tie_word_embeddings)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from forge_lightning.modules.llm.hf import (
    TIED_HEAD_KEY,
    export_tensors,
    generation_files,
    load_hf_state_dict,
    load_hf_weights,
    refuse_existing,
    write_hf_checkpoint,
)
from forge_lightning.modules.vlm.config import VLMConfig
from forge_lightning.modules.vlm.model import VisionLanguageModel
from forge_lightning.modules.vlm.qwen2_5_vit import HF_PREFIXES, load_hf_vision_weights, to_hf_state_dict

TEXT_PREFIX = "model.language_model."
LEGACY_TEXT_PREFIX = "model."


def llm_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The language model's entries of a Qwen2.5-VL state dict, named as in ``DecoderLM`` (``model.*``,
    ``lm_head.weight``); the vision entries are left out."""
    nested = any(k.startswith(TEXT_PREFIX) for k in state)
    out = {}
    for key, tensor in state.items():
        if key.startswith(HF_PREFIXES) or key.endswith("rotary_emb.inv_freq"):
            continue
        if nested and key.startswith(TEXT_PREFIX):
            key = LEGACY_TEXT_PREFIX + key[len(TEXT_PREFIX) :]
        out[key] = tensor
    return out


def from_pretrained(path: str | os.PathLike[str], *, attention_backend: str = "auto") -> VisionLanguageModel:
    """A :class:`VisionLanguageModel` built from the ``config.json`` in ``path`` and filled with its weights.

    Args:
        path: a Qwen2.5-VL checkpoint directory (``model.safetensors`` or a sharded index).
        attention_backend: see :class:`VisionLanguageModel`.

    Raises:
        FileNotFoundError: no ``config.json`` or weights in ``path``.
        ValueError: the config is not Qwen2.5-VL, or tensors are missing, unexpected or of the wrong shape.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    config = VLMConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = VisionLanguageModel(config, attention_backend=attention_backend)
    state = load_hf_state_dict(path)
    load_hf_vision_weights(model.vision, state)
    load_hf_weights(model.llm, llm_state(state), source=f"checkpoint {path} (language model)")
    return model


def save_pretrained(
    model: VisionLanguageModel,
    config: VLMConfig,
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    *,
    overwrite: bool = False,
) -> Path:
    """Export ``model`` as a transformers 5 Qwen2.5-VL checkpoint directory (atomically, with a manifest).

    Args:
        model: the model to export (full, unsharded tensors on any device).
        config: its configuration (written as ``config.json``).
        out_dir: destination directory.
        dtype: cast floating tensors to this dtype; default keeps each tensor's dtype.
        max_shard_size: largest shard, in bytes or as a string (``"5GB"``, ``"500MB"``).
        overwrite: replace an existing non-empty ``out_dir``.

    Returns:
        The output directory.
    """
    refuse_existing(Path(out_dir), overwrite)  # before the tensors are copied to the host
    vision = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in to_hf_state_dict(model.vision, prefix=HF_PREFIXES[0]).items()
    }
    text = {
        (k if k == TIED_HEAD_KEY else TEXT_PREFIX + k.removeprefix(LEGACY_TEXT_PREFIX)): v
        for k, v in export_tensors(model.llm.state_dict(), config.llm, dtype).items()
    }
    hf_config = config.to_hf()
    saved_dtype = str(next(iter(text.values())).dtype).removeprefix("torch.")
    hf_config["torch_dtype"] = hf_config["dtype"] = hf_config["text_config"]["dtype"] = saved_dtype
    files = {"config.json": hf_config, **generation_files(hf_config["text_config"])}
    return write_hf_checkpoint(
        out_dir, {**vision, **text}, files, max_shard_size=max_shard_size, overwrite=overwrite
    )

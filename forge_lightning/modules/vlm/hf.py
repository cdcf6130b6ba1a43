"""Hugging Face interchange of whole VLM checkpoints (``config.json`` and safetensors): Qwen2.5-VL, Qwen3-VL,
LLaVA (SigLIP or CLIP tower) and LLaVA-OneVision.

Tensor names by family (:data:`LAYOUTS`; every listed layout is read, the first one written)::

    ours                 Qwen2.5-VL, Qwen3-VL: tf 5 | published   LLaVA: published | transformers 5 in memory
    vision.*             model.visual.*             | visual.*     vision_tower.vision_model.* | model.vision_tower.*
                                                                   (and vision_tower.*, as transformers 5 saves)
    projector.*          -                                         multi_modal_projector.* | model.multi_modal_projector.*
    llm.model.*          model.language_model.*     | model.*      language_model.model.* | model.language_model.*
    llm.lm_head.weight   lm_head.weight                            language_model.lm_head.weight | lm_head.weight

LLaVA-OneVision has LLaVA's names and ``image_newline`` (ours ``projector.image_newline``; transformers 5 in memory
``model.image_newline``). ``lm_head.weight`` is absent when ``tie_word_embeddings``. LLaVA is written in the published layout, which every
transformers version loads (transformers 5 maps it onto its own). Rotary ``inv_freq`` buffers and SigLIP's
attention-pooling head (``vision.head.*``, unused by LLaVA) are skipped on load.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from forge_lightning.modules.layers.state_dict import load_exact
from forge_lightning.modules.llm.hf import (
    export_tensors,
    generation_files,
    load_hf_state_dict,
    load_hf_weights,
    refuse_existing,
    write_hf_checkpoint,
)
from forge_lightning.modules.vlm.config import VLMConfig
from forge_lightning.modules.vlm.model import VisionLanguageModel

_COMPONENTS = ("vision.", "projector.", "llm.")


@dataclass(frozen=True)
class Layout:
    """How one composed Hugging Face architecture names its tensors.

    Args:
        prefixes: each of our prefixes (``vision.``, ``projector.``, ``llm.model.``, ``llm.lm_head.``) and the
            Hugging Face prefixes that stand for it; the first is written. The longest matching prefix wins.
        skipped: patterns (``re.search``, on our names) of checkpoint tensors that are never loaded.
    """

    prefixes: Mapping[str, tuple[str, ...]]
    skipped: tuple[str, ...] = ()

    def to_ours(self, state: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
        """``state`` under our names, the skipped tensors left out.

        Raises:
            ValueError: tensors that belong to no component, or one tensor under two layouts' names (the message
                names up to 8).
        """
        rules = sorted(
            ((hf, ours) for ours, hfs in self.prefixes.items() for hf in hfs), key=lambda r: -len(r[0])
        )
        out, origin, strays, twice = {}, {}, [], []
        for key, tensor in state.items():
            rule = next(((hf, ours) for hf, ours in rules if key.startswith(hf)), None)
            if rule is None:
                strays.append(key)
                continue
            name = rule[1] + key[len(rule[0]) :]
            if any(re.search(pattern, name) for pattern in self.skipped):
                continue
            if name in out:
                twice.append(f"{origin[name]} and {key}")
            out[name], origin[name] = tensor, key
        if strays:
            raise ValueError(
                f"{source} holds tensors outside the vision encoder, projector and language model: "
                f"{', '.join(sorted(strays)[:8])}"
            )
        if twice:
            raise ValueError(f"{source} holds tensors twice, in two layouts: {', '.join(sorted(twice)[:8])}")
        return out

    def to_hf(self, name: str) -> str:
        """The Hugging Face name of our tensor ``name``."""
        ours = next(p for p in sorted(self.prefixes, key=len, reverse=True) if name.startswith(p))
        return self.prefixes[ours][0] + name[len(ours) :]


_QWEN_VL_LAYOUT = Layout(
    prefixes={
        "vision.": ("model.visual.", "visual."),
        "llm.model.": ("model.language_model.", "model."),
        "llm.lm_head.": ("lm_head.",),
    },
    skipped=(r"inv_freq$",),
)

_LLAVA_PREFIXES = {
    "vision.": (
        "vision_tower.vision_model.",
        "vision_tower.",
        "model.vision_tower.vision_model.",
        "model.vision_tower.",
    ),
    "projector.": ("multi_modal_projector.", "model.multi_modal_projector."),
    "llm.model.": ("language_model.model.", "model.language_model.", "language_model."),
    "llm.lm_head.": ("language_model.lm_head.", "lm_head."),
}
_LLAVA_SKIPPED = (r"inv_freq$", r"^vision\.head\.")

LAYOUTS: dict[str, Layout] = {
    "qwen2_5_vl": _QWEN_VL_LAYOUT,
    "qwen3_vl": _QWEN_VL_LAYOUT,
    "qwen3_vl_moe": _QWEN_VL_LAYOUT,
    "llava": Layout(prefixes=_LLAVA_PREFIXES, skipped=_LLAVA_SKIPPED),
    "llava_onevision": Layout(
        prefixes={**_LLAVA_PREFIXES, "projector.image_newline": ("image_newline", "model.image_newline")},
        skipped=_LLAVA_SKIPPED,
    ),
}
"""Tensor names by ``model_type``."""


def from_pretrained(path: str | os.PathLike[str], *, attention_backend: str = "auto") -> VisionLanguageModel:
    """A :class:`VisionLanguageModel` built from the ``config.json`` in ``path`` and filled with its weights.

    The model is built on the meta device and takes the checkpoint's tensors as its parameters (cast to fp32, the
    dtype it builds in; see :func:`load_pretrained`), so it is never randomly initialised and, for an fp32
    checkpoint, the host holds one copy of the weights.

    Args:
        path: a Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, LLaVA or LLaVA-OneVision checkpoint directory
            (``model.safetensors`` or a sharded index).
        attention_backend: see :class:`VisionLanguageModel`.

    Raises:
        FileNotFoundError: no ``config.json`` or weights in ``path``.
        ValueError: the config is of no supported family, or tensors are missing, unexpected or of the wrong
            shape.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    config = VLMConfig.from_hf(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = VisionLanguageModel(config, attention_backend=attention_backend)
    return load_pretrained(model, path)


def load_pretrained(model: VisionLanguageModel, path: str | os.PathLike[str]) -> VisionLanguageModel:
    """Fill ``model`` (materialised, or built on the meta device) with the weights of the checkpoint in ``path``,
    strictly (in place; also returned). The config is not compared: use :func:`from_pretrained` to build the model
    the checkpoint describes.

    Raises:
        FileNotFoundError: no weights in ``path``.
        ValueError: tensors are missing, unexpected or of the wrong shape (named).
    """
    path = Path(path)
    state = LAYOUTS[model.config.family.model_type].to_ours(load_hf_state_dict(path), f"checkpoint {path}")
    parts = {c: {k[len(c) :]: v for k, v in state.items() if k.startswith(c)} for c in _COMPONENTS}
    del state
    load_exact(model.vision, parts.pop("vision."), what=f"the vision weights of {path}")
    load_exact(
        model.projector, parts.pop("projector."), what=f"the projector weights of {path}", owner="projector"
    )
    load_hf_weights(model.llm, parts.pop("llm."), source=f"checkpoint {path} (language model)")
    return model


def save_pretrained(
    model: VisionLanguageModel,
    config: VLMConfig,
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    *,
    overwrite: bool = False,
    state_dict: Mapping[str, Tensor] | None = None,
) -> Path:
    """Export ``model`` as a checkpoint directory of its family (atomically, with a manifest) that transformers'
    ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration`` / ``LlavaForConditionalGeneration`` /
    ``LlavaOnevisionForConditionalGeneration`` loads.

    Args:
        model: the model to export (full, unsharded tensors on any device).
        config: its configuration (written as ``config.json``).
        out_dir: destination directory.
        dtype: cast floating tensors to this dtype; default keeps each tensor's dtype.
        max_shard_size: largest shard, in bytes or as a string (``"5GB"``, ``"500MB"``).
        overwrite: replace an existing non-empty ``out_dir``.
        state_dict: full tensors to write instead of ``model.state_dict()`` (``vision.*``, ``projector.*``,
            ``llm.*``: e.g. gathered from a sharded model, or with LoRA adapters merged).

    Returns:
        The output directory.

    Raises:
        ValueError: the config cannot be written as its family's checkpoint (see :meth:`VLMConfig.to_hf`).
    """
    refuse_existing(Path(out_dir), overwrite)  # before the tensors are copied to the host
    hf_config = config.to_hf()
    layout = LAYOUTS[config.family.model_type]
    state = model.state_dict() if state_dict is None else state_dict
    tensors = {
        layout.to_hf(k): (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
        .detach()
        .cpu()
        .contiguous()
        for k, v in state.items()
        if k.startswith(("vision.", "projector."))
    }
    llm_state = {k.removeprefix("llm."): v for k, v in state.items() if k.startswith("llm.")}
    text = {layout.to_hf("llm." + k): v for k, v in export_tensors(llm_state, config.llm, dtype).items()}
    saved_dtype = str(next(iter(text.values())).dtype).removeprefix("torch.")
    hf_config["torch_dtype"] = hf_config["dtype"] = hf_config["text_config"]["dtype"] = saved_dtype
    files = {"config.json": hf_config, **generation_files(hf_config["text_config"])}
    return write_hf_checkpoint(
        out_dir, {**tensors, **text}, files, max_shard_size=max_shard_size, overwrite=overwrite
    )

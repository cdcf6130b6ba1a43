"""A VLM composed from the checkpoints of its parts: a vision encoder's and an LLM's Hugging Face directories (e.g.
a ``SiglipVisionModel`` or ``CLIPVisionModel`` and a Qwen3 ``AutoModelForCausalLM``), with a freshly initialised projector between them::

    model:
      vision: {pretrained: path/to/siglip, feature_layer: -2}   # config and weights; other keys override the config
      projector: mlp                                            # always fresh
      llm: {pretrained: path/to/qwen3}                          # or a preset / config.json path: config only
      image_token_id: 151655                                    # a token of the LLM's vocabulary

Any section may instead be given as :class:`~forge_lightning.modules.vlm.config.VLMConfig` takes it (fields, a
preset): those parts start from random weights. Nothing here depends on which encoder meets which LLM: the encoder's
checkpoint type (:data:`VISION_CHECKPOINTS`) and the LLM's architecture are each read on their own.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.hf import load_hf_state_dict, load_pretrained
from forge_lightning.modules.vlm.clip import ClipVisionConfig
from forge_lightning.modules.vlm.config import VLMConfig
from forge_lightning.modules.vlm.model import VisionLanguageModel
from forge_lightning.modules.vlm.siglip import SiglipVisionConfig, load_hf_siglip_weights


@dataclass(frozen=True)
class VisionCheckpoint:
    """How to read a standalone encoder checkpoint of one ``model_type``.

    Args:
        vision_type: the ``vision.type`` it builds.
        read_config: its config from the ``config.json`` dict and field overrides.
        load_weights: copies its tensors (a loaded state dict) into the encoder; ``source`` names the checkpoint.
    """

    vision_type: str
    read_config: Callable[..., Any]
    load_weights: Callable[..., nn.Module]


_SIGLIP = VisionCheckpoint("siglip", SiglipVisionConfig.from_hf, load_hf_siglip_weights)
_CLIP = VisionCheckpoint("clip", ClipVisionConfig.from_hf, load_hf_siglip_weights)
VISION_CHECKPOINTS: dict[str, VisionCheckpoint] = {
    "siglip_vision_model": _SIGLIP,  # transformers' SiglipVisionModel
    "siglip": _SIGLIP,  # SiglipModel (image and text towers): its vision tower
    "clip_vision_model": _CLIP,  # CLIPVisionModel
    "clip": _CLIP,  # CLIPModel: its vision tower
}
"""Encoder checkpoints ``vision.pretrained`` reads, by their ``config.json`` ``model_type``."""


def build_vlm(
    config: VLMConfig | Mapping[str, Any], *, attention_backend: str = "auto"
) -> VisionLanguageModel:
    """A :class:`VisionLanguageModel`, its ``vision`` and ``llm`` loaded from their checkpoints where the sections
    name one (``pretrained``; see the module docstring), the rest freshly initialised.

    Args:
        config: a :class:`VLMConfig` (everything fresh), or a mapping of its fields whose ``vision`` / ``llm``
            sections may hold ``pretrained: <directory>``.
        attention_backend: see :class:`VisionLanguageModel`.

    Returns:
        The model; ``model.config`` is the resolved :class:`VLMConfig` (what ``save_pretrained`` writes).

    Raises:
        FileNotFoundError: a ``pretrained`` directory without ``config.json`` or weights.
        ValueError: an encoder checkpoint of an unsupported type, overrides that are not config fields, weights
            that do not fit, or a composed config that fails :class:`VLMConfig`'s checks.
    """
    if isinstance(config, VLMConfig):
        return VisionLanguageModel(config, attention_backend=attention_backend)
    fields = dict(config)
    vision, vision_source = _vision_section(fields.pop("vision", None))
    llm, llm_dir = _llm_section(fields.pop("llm", None))
    model = VisionLanguageModel(
        VLMConfig(vision=vision, llm=llm, **fields), attention_backend=attention_backend
    )
    if vision_source is not None:
        checkpoint, path = vision_source
        checkpoint.load_weights(model.vision, load_hf_state_dict(path), source=f"checkpoint {path}")
    if llm_dir is not None:
        load_pretrained(model.llm, llm_dir)
    return model


def _vision_section(section: Any) -> tuple[Any, tuple[VisionCheckpoint, Path] | None]:
    """The ``vision`` section for :class:`VLMConfig` and, with ``pretrained``, the checkpoint to load."""
    if not (isinstance(section, Mapping) and "pretrained" in section):
        return section, None
    overrides = dict(section)
    path = Path(overrides.pop("pretrained"))
    hf = _read_config(path, "vision.pretrained")
    model_type = hf.get("model_type")
    if model_type not in VISION_CHECKPOINTS:
        raise ValueError(
            f"vision.pretrained: {path} holds a {model_type!r} checkpoint; supported encoder checkpoints: "
            f"{', '.join(VISION_CHECKPOINTS)}"
        )
    checkpoint = VISION_CHECKPOINTS[model_type]
    kind = overrides.pop("type", checkpoint.vision_type)
    if kind != checkpoint.vision_type:
        raise ValueError(
            f"vision.type ({kind!r}) differs from that of the {model_type!r} checkpoint in {path} "
            f"({checkpoint.vision_type!r})"
        )
    try:
        return checkpoint.read_config(hf, **overrides), (checkpoint, path)
    except TypeError as err:
        raise ValueError(f"vision: overrides of the checkpoint in {path}: {err}") from err


def _llm_section(section: Any) -> tuple[Any, Path | None]:
    """The ``llm`` section for :class:`VLMConfig` and, with ``pretrained``, the checkpoint directory to load."""
    if not (isinstance(section, Mapping) and "pretrained" in section):
        return section, None
    overrides = dict(section)
    path = Path(overrides.pop("pretrained"))
    _read_config(path, "llm.pretrained")
    try:
        return dataclasses.replace(LLMConfig.load(path), **overrides), path
    except TypeError as err:
        raise ValueError(f"llm: overrides of the checkpoint in {path}: {err}") from err


def _read_config(path: Path, field: str) -> dict[str, Any]:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{field}: no config.json in {path}")
    return json.loads((path / "config.json").read_text())

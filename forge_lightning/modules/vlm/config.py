"""Configuration of a vision-language model: a vision encoder, a projector and a decoder LM, with the special
tokens that tie them together. Reads and writes the ``config.json`` of Qwen2.5-VL checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.vlm.qwen2_5_vit import Qwen25VisionConfig

VISION_TYPES: dict[str, type] = {"qwen2_5_vit": Qwen25VisionConfig}
"""Vision encoder configs by the ``type`` of a ``vision`` section."""

PROJECTORS = ("none",)
"""Projectors between encoder and LLM; ``none`` when the encoder itself ends in the LLM's width (Qwen2.5-VL's patch
merger, ``vision.merger``)."""

HF_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
HF_MODEL_TYPE = "qwen2_5_vl"

# transformers' Qwen2.5-VL vision config default, used when a config.json omits the key (released ones write 2).
_HF_TOKENS_PER_SECOND = 4
_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass(kw_only=True)
class VLMConfig:
    """A vision-language model: ``vision`` encoder ─ ``projector`` ─ ``llm``.

    Args:
        vision: the encoder's config, or a mapping with a ``type`` (a key of :data:`VISION_TYPES`, default
            ``qwen2_5_vit``) and that config's fields.
        llm: the language model's config (or its fields as a mapping); it needs multimodal RoPE
            (``rope_scaling.mrope_section``).
        projector: the module that maps encoder features to the LLM width (see :data:`PROJECTORS`).
        image_token_id: the ``<|image_pad|>`` token; one per merged image patch, replaced by its feature.
        video_token_id: the ``<|video_pad|>`` token; one per merged video patch.
        vision_start_token_id: the ``<|vision_start|>`` token before each image or video.
        vision_end_token_id: the ``<|vision_end|>`` token after each image or video.
        tokens_per_second: temporal RoPE positions per second of video (``vision_config.tokens_per_second``).
    """

    vision: Qwen25VisionConfig
    llm: LLMConfig
    projector: str = "none"
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tokens_per_second: float = 2

    def __post_init__(self) -> None:
        if isinstance(self.vision, Mapping):
            fields = dict(self.vision)
            kind = fields.pop("type", "qwen2_5_vit")
            if kind not in VISION_TYPES:
                raise ValueError(
                    f"vision.type ({kind!r}) is not supported; supported: {', '.join(VISION_TYPES)}"
                )
            self.vision = VISION_TYPES[kind](**fields)
        if isinstance(self.llm, Mapping):
            self.llm = LLMConfig(**self.llm)
        if self.projector not in PROJECTORS:
            raise ValueError(f"projector ({self.projector!r}) must be one of {', '.join(PROJECTORS)}")
        if self.vision.out_hidden_size != self.llm.hidden_size:
            raise ValueError(
                f"vision.out_hidden_size ({self.vision.out_hidden_size}) must equal llm.hidden_size "
                f"({self.llm.hidden_size}) with projector 'none'"
            )
        if self.llm.mrope_section is None:
            raise ValueError(
                "llm.rope_scaling has no mrope_section: a Qwen2.5-VL language model takes multimodal RoPE positions"
            )
        ids = {name: getattr(self, name) for name in _TOKEN_FIELDS}
        for name, value in ids.items():
            if not isinstance(value, int) or not 0 <= value < self.llm.vocab_size:
                raise ValueError(
                    f"{name} ({value!r}) must be a token id in [0, llm.vocab_size={self.llm.vocab_size})"
                )
        if len(set(ids.values())) != len(ids):
            raise ValueError(f"the special token ids must differ: {ids}")
        if not self.tokens_per_second > 0:
            raise ValueError(f"tokens_per_second ({self.tokens_per_second}) must be positive")

    @property
    def vision_type(self) -> str:
        """The ``type`` of the vision section (a key of :data:`VISION_TYPES`)."""
        return next(k for k, v in VISION_TYPES.items() if isinstance(self.vision, v))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> VLMConfig:
        """Read a Qwen2.5-VL ``config.json`` dict: transformers 5 nests the LLM in ``text_config``; older files keep
        the text fields at the top level.

        Raises:
            ValueError: another ``model_type``, no ``vision_config``, or a field that fails validation.
        """
        if hf.get("model_type") != HF_MODEL_TYPE:
            raise ValueError(f"model_type ({hf.get('model_type')!r}) must be {HF_MODEL_TYPE!r} (Qwen2.5-VL)")
        if "vision_config" not in hf:
            raise ValueError("a Qwen2.5-VL config.json needs a vision_config")
        text = (
            dict(hf["text_config"])
            if "text_config" in hf
            else {k: v for k, v in hf.items() if k != "vision_config"}
        )
        text["model_type"] = "qwen2_5_vl_text"
        if "tie_word_embeddings" in hf:  # transformers ties by the top-level flag
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        vision = hf["vision_config"]
        tokens = {name: hf[name] for name in _TOKEN_FIELDS if name in hf}
        return cls(
            vision=Qwen25VisionConfig.from_hf(vision),
            llm=LLMConfig.from_hf(text),
            tokens_per_second=vision.get("tokens_per_second", _HF_TOKENS_PER_SECOND),
            **tokens,
        )

    def to_hf(self) -> dict[str, Any]:
        """A transformers 5 ``config.json`` dict (``text_config`` and ``vision_config`` nested)."""
        text = self.llm.to_hf()
        vision = {
            **self.vision.to_hf(),
            "model_type": "qwen2_5_vl_vision",
            "tokens_per_second": self.tokens_per_second,
        }
        hf = {
            "architectures": [HF_ARCHITECTURE],
            "model_type": HF_MODEL_TYPE,
            "text_config": text,
            "vision_config": vision,
            "tie_word_embeddings": self.llm.tie_word_embeddings,
            **{name: getattr(self, name) for name in _TOKEN_FIELDS},
        }
        if "dtype" in text:
            hf["torch_dtype"] = hf["dtype"] = text["dtype"]
        return hf

"""Configuration of a vision-language model: a vision encoder, a projector and a decoder LM, with the special
tokens that tie them together. Reads and writes the ``config.json`` of Qwen2.5-VL, Qwen3-VL and LLaVA checkpoints.

The ``vision.type`` decides the family (:data:`FAMILIES`): the Hugging Face architecture it exports as, the
projector that architecture has, whether the LLM takes multimodal RoPE positions, and which token fields it uses::

    vision.type   family       model_type   projector   LLM positions          token fields
    qwen2_5_vit   Qwen2.5-VL   qwen2_5_vl   none        M-RoPE [3, B, S]       image / video / vision start, end
    qwen3_vit     Qwen3-VL     qwen3_vl     none        interleaved M-RoPE     image / video / vision start, end
    qwen3_vit     Qwen3-VL-MoE qwen3_vl_moe none        interleaved M-RoPE     as Qwen3-VL (LLM qwen3_vl_moe_text)
    siglip        LLaVA        llava        mlp         1-D (the LLM's own)    image
    clip          LLaVA        llava        mlp         1-D (the LLM's own)    image
    siglip_anyres LLaVA-OV     llava_onevision  mlp_newline  1-D               image, video

LLaVA reads both towers: its ``vision_config`` ``model_type`` picks one (none means CLIP, as in transformers). One
vision type may stand for several families that differ in their LLM (:data:`FAMILY_VARIANTS`): the LLM's
``architecture`` picks among them (Qwen3-VL with a ``qwen3_vl_moe_text`` LLM is Qwen3-VL-MoE).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.vlm.anyres import AnyResVisionConfig
from forge_lightning.modules.vlm.clip import ClipVisionConfig
from forge_lightning.modules.vlm.projector import (
    PROJECTORS,
    IdentityProjectorConfig,
    MLPNewlineProjectorConfig,
    MLPProjectorConfig,
)
from forge_lightning.modules.vlm.qwen2_5_vit import Qwen25VisionConfig
from forge_lightning.modules.vlm.qwen3_vit import Qwen3VisionConfig
from forge_lightning.modules.vlm.siglip import SiglipVisionConfig

VISION_TYPES: dict[str, type] = {
    "qwen2_5_vit": Qwen25VisionConfig,
    "qwen3_vit": Qwen3VisionConfig,
    "siglip": SiglipVisionConfig,
    "clip": ClipVisionConfig,
    "siglip_anyres": AnyResVisionConfig,
}
"""Vision encoder configs by the ``type`` of a ``vision`` section."""

# transformers' Qwen2.5-VL vision config default, used when a config.json omits the key (released ones write 2).
_HF_TOKENS_PER_SECOND = 4
# transformers' LlavaConfig defaults, used when a config.json omits the key.
_HF_LLAVA_DEFAULTS = {
    "image_token_index": 32000,
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "multimodal_projector_bias": True,
    "projector_hidden_act": "gelu",
}
# transformers' LlavaOnevisionConfig defaults.
_HF_ONEVISION_DEFAULTS = {
    "image_token_index": 151646,
    "video_token_index": 151647,
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
    "multimodal_projector_bias": True,
    "projector_hidden_act": "gelu",
    "vision_aspect_ratio": "anyres_max_9",
}
# The vision_config model_type transformers reads a file without one as.
_HF_DEFAULT_VISION = {"llava": "clip_vision_model", "llava_onevision": "siglip_vision_model"}
_FAMILY_FIELDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "tokens_per_second",
)


@dataclass(frozen=True)
class Family:
    """A composed architecture, chosen by ``vision.type``.

    Args:
        name: its name in messages.
        model_type: the ``model_type`` of its Hugging Face ``config.json``.
        architecture: the transformers class it exports as.
        vision_model_types: the ``vision_config`` ``model_type`` values it reads.
        projector: the projector the architecture has (the default of ``projector``).
        mrope: the LLM takes multimodal RoPE positions (``llm.rope_scaling.mrope_section``), or else 1-D ones.
        fields: the token / timing fields of :class:`VLMConfig` it uses, with their defaults (``None``: required);
            the others must stay unset.
        from_hf: reads its ``config.json`` dict.
        to_hf: writes it.
        mrope_interleaved: with ``mrope``, the LLM's M-RoPE is interleaved (Qwen3-VL), not chunked (Qwen2.5-VL).
        projector_required: the tower needs the family's projector (LLaVA-OneVision's ``image_newline``).
        llm_architecture: the LLM ``architecture`` that makes a vision type this family rather than its default
            one (:data:`FAMILY_VARIANTS`); ``None`` for the defaults.
    """

    name: str
    model_type: str
    architecture: str
    vision_model_types: tuple[str, ...]
    projector: str
    mrope: bool
    fields: Mapping[str, Any]
    from_hf: Callable[[Mapping[str, Any]], VLMConfig]
    to_hf: Callable[[VLMConfig], dict[str, Any]]
    mrope_interleaved: bool = False
    projector_required: bool = False
    llm_architecture: str | None = None


@dataclass(kw_only=True)
class VLMConfig:
    """A vision-language model: ``vision`` encoder ─ ``projector`` ─ ``llm``.

    Args:
        vision: the encoder's config, or a mapping with a ``type`` (a key of :data:`VISION_TYPES`, default
            ``qwen2_5_vit``) and that config's fields. Its type picks the family (see the module docstring).
        llm: the language model's config, its fields as a mapping, a Hugging Face text config (a mapping with a
            ``model_type``), or a preset name / ``config.json`` path (:meth:`LLMConfig.load`). Qwen2.5-VL needs multimodal RoPE (``rope_scaling.mrope_section``), LLaVA
            plain RoPE.
        projector: the module that maps encoder features to the LLM width: a name in
            :data:`~forge_lightning.modules.vlm.projector.PROJECTORS`, a mapping with a ``type`` and that config's
            fields, or a projector config; default: the family's (``none`` for Qwen2.5-VL, ``mlp`` for LLaVA).
        image_token_id: the image placeholder (``<|image_pad|>``, LLaVA's ``<image>``): one per image feature,
            replaced by it. Default 151655 for Qwen2.5-VL; LLaVA needs it set.
        video_token_id: Qwen2.5-VL's ``<|video_pad|>`` token, one per merged video patch (default 151656).
        vision_start_token_id: Qwen2.5-VL's ``<|vision_start|>`` token before each image or video (default 151652).
        vision_end_token_id: Qwen2.5-VL's ``<|vision_end|>`` token after each image or video (default 151653).
        tokens_per_second: Qwen2.5-VL's temporal RoPE positions per second of video
            (``vision_config.tokens_per_second``; default 2).

    Fields a family does not use (:attr:`Family.fields`) must stay unset.
    """

    vision: (
        Qwen25VisionConfig | Qwen3VisionConfig | SiglipVisionConfig | ClipVisionConfig | AnyResVisionConfig
    )
    llm: LLMConfig
    projector: IdentityProjectorConfig | MLPProjectorConfig | MLPNewlineProjectorConfig | str | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    tokens_per_second: float | None = None

    def __post_init__(self) -> None:
        self.vision = _section(self.vision, VISION_TYPES, "vision", default="qwen2_5_vit")
        if isinstance(self.llm, Mapping):
            # A Hugging Face text config (it names its model_type) or LLMConfig's own fields.
            self.llm = LLMConfig.load(self.llm) if "model_type" in self.llm else LLMConfig(**self.llm)
        elif isinstance(self.llm, str):
            self.llm = LLMConfig.load(self.llm)
        family = self.family
        self.projector = _section(
            family.projector if self.projector is None else self.projector, PROJECTORS, "projector"
        )
        self.projector.check_widths(self.vision.out_hidden_size, self.llm.hidden_size)
        if family.projector_required and self.projector_type != family.projector:
            raise ValueError(
                f"projector ({self.projector_type!r}) cannot feed vision.type {self.vision_type!r} ({family.name}): "
                f"it needs projector {family.projector!r}"
            )
        if family.mrope and self.llm.mrope_section is None:
            raise ValueError(
                f"llm.rope_scaling has no mrope_section: a {family.name} language model takes multimodal RoPE "
                "positions"
            )
        if family.mrope and self.llm.mrope_interleaved != family.mrope_interleaved:
            want, got = ("interleaved", "chunked") if family.mrope_interleaved else ("chunked", "interleaved")
            raise ValueError(
                f"llm.rope_scaling mrope_interleaved is {self.llm.mrope_interleaved}: a {family.name} language "
                f"model takes {want} multimodal RoPE, not {got} (set mrope_interleaved: "
                f"{str(family.mrope_interleaved).lower()})"
            )
        deepstack = self.vision.deepstack_layers if isinstance(self.vision, Qwen3VisionConfig) else []
        if len(deepstack) > self.llm.num_layers:
            raise ValueError(
                f"vision.deepstack_layers ({deepstack}) feed {len(deepstack)} decoder layers, but llm.num_layers is "
                f"{self.llm.num_layers}"
            )
        if not family.mrope and self.llm.mrope_section is not None:
            raise ValueError(
                f"llm.rope_scaling has an mrope_section, but vision.type {self.vision_type!r} ({family.name}) gives "
                "the language model 1-D positions: use a text config without multimodal RoPE"
            )
        self._check_family_fields(family)

    def _check_family_fields(self, family: Family) -> None:
        for name in _FAMILY_FIELDS:
            value = getattr(self, name)
            if name not in family.fields:
                if value is not None:
                    raise ValueError(
                        f"{name} ({value!r}) is not used by vision.type {self.vision_type!r} ({family.name}): "
                        "leave it unset"
                    )
                continue
            if value is None:
                if family.fields[name] is None:
                    raise ValueError(
                        f"{name} must be set for vision.type {self.vision_type!r} ({family.name}): the id of its "
                        "placeholder token in the LLM's vocabulary"
                    )
                setattr(self, name, family.fields[name])
        ids = {name: getattr(self, name) for name in family.fields if name.endswith("_token_id")}
        for name, value in ids.items():
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < self.llm.vocab_size:
                raise ValueError(
                    f"{name} ({value!r}) must be a token id in [0, llm.vocab_size={self.llm.vocab_size})"
                )
        if len(set(ids.values())) != len(ids):
            raise ValueError(f"the special token ids must differ: {ids}")
        if self.tokens_per_second is not None and not self.tokens_per_second > 0:
            raise ValueError(f"tokens_per_second ({self.tokens_per_second}) must be positive")

    @property
    def vision_type(self) -> str:
        """The ``type`` of the vision section (a key of :data:`VISION_TYPES`)."""
        return _type_of(self.vision, VISION_TYPES)

    @property
    def projector_type(self) -> str:
        """The ``type`` of the projector (a key of :data:`~forge_lightning.modules.vlm.projector.PROJECTORS`)."""
        return _type_of(self.projector, PROJECTORS)

    @property
    def family(self) -> Family:
        """The composed architecture of :attr:`vision_type` and the LLM's architecture (see :data:`FAMILIES`,
        :data:`FAMILY_VARIANTS`)."""
        variants = FAMILY_VARIANTS.get(self.vision_type, ())
        return next(
            (f for f in variants if f.llm_architecture == self.llm.architecture), FAMILIES[self.vision_type]
        )

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> VLMConfig:
        """Read the ``config.json`` dict of a Qwen2.5-VL, Qwen3-VL or LLaVA checkpoint (the family by ``model_type``).

        Raises:
            ValueError: an unsupported ``model_type``, no ``vision_config``, a ``vision_config`` of another family,
                or a field that fails validation.
        """
        model_type = hf.get("model_type")
        families = [f for f in _all_families() if f.model_type == model_type]
        if not families:
            supported = ", ".join(dict.fromkeys(f"{f.model_type} ({f.name})" for f in _all_families()))
            raise ValueError(f"model_type ({model_type!r}) is not supported; supported: {supported}")
        if "vision_config" not in hf:
            raise ValueError(f"a {families[0].name} config.json needs a vision_config")
        vision_type = hf["vision_config"].get("model_type", _HF_DEFAULT_VISION.get(model_type))
        if vision_type is None:
            return families[0].from_hf(hf)
        family = next((f for f in families if vision_type in f.vision_model_types), None)
        if family is None:
            types = [t for f in families for t in f.vision_model_types]
            owner = next((f for f in _all_families() if vision_type in f.vision_model_types), None)
            takes = f"{model_type!r} takes a vision_config of model_type {' / '.join(types)}"
            if owner is None:
                raise ValueError(f"vision_config model_type ({vision_type!r}) is not supported: {takes}")
            raise ValueError(
                f"model_type ({model_type!r}) must be {owner.model_type!r} for a vision_config of model_type "
                f"{vision_type!r} ({owner.name}); {takes}"
            )
        return family.from_hf(hf)

    def to_hf(self) -> dict[str, Any]:
        """The family's transformers 5 ``config.json`` dict (``text_config`` and ``vision_config`` nested).

        Raises:
            ValueError: the projector is not the one the family's architecture has.
        """
        family = self.family
        if self.projector_type != family.projector:
            raise ValueError(
                f"a {family.name} checkpoint ({family.architecture}) has projector {family.projector!r}; this "
                f"config has {self.projector_type!r}, which transformers cannot load"
            )
        hf = family.to_hf(self)
        if "dtype" in hf["text_config"]:
            hf["torch_dtype"] = hf["dtype"] = hf["text_config"]["dtype"]
        return hf


def _section(value: Any, types: Mapping[str, type], field: str, *, default: str | None = None) -> Any:
    """A config of one of ``types`` from a config, a type name, or a mapping of a ``type`` and the fields."""
    if isinstance(value, tuple(types.values())):
        return value
    if isinstance(value, str):
        kind, fields, label = value, {}, field
    elif isinstance(value, Mapping):
        fields = dict(value)
        kind, label = fields.pop("type", default), f"{field}.type"
        if "pretrained" in fields:
            raise ValueError(
                f"{field}.pretrained names a checkpoint to load: build the model with "
                "forge_lightning.modules.vlm.build_vlm, which reads it"
            )
    else:
        raise ValueError(f"{field} must be a config, a type name or a mapping, got {type(value).__name__}")
    if kind not in types:
        raise ValueError(f"{label} ({kind!r}) is not supported; supported: {', '.join(types)}")
    try:
        return types[kind](**fields)
    except TypeError as err:  # an unknown or missing field
        raise ValueError(f"{field} (type {kind!r}): {err}") from err


def _type_of(config: Any, types: Mapping[str, type]) -> str:
    # The exact class: one config class may extend another (CLIP's and LLaVA-OneVision's extend SigLIP's).
    return next(k for k, v in types.items() if type(config) is v)


# ---------------------------------------------------------------- Qwen2.5-VL


def _qwen_vl_text_and_tokens(hf: Mapping[str, Any], text_model_type: str) -> tuple[LLMConfig, dict[str, int]]:
    """The LLM config and special tokens of a Qwen-VL ``config.json``: transformers 5 nests the LLM in
    ``text_config``; older files keep the text fields at the top level."""
    text = (
        dict(hf["text_config"])
        if "text_config" in hf
        else {k: v for k, v in hf.items() if k != "vision_config"}
    )
    text["model_type"] = text_model_type
    if "tie_word_embeddings" in hf:  # transformers ties by the top-level flag
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    tokens = {name: hf[name] for name in _FAMILY_FIELDS if name.endswith("_token_id") and name in hf}
    return LLMConfig.from_hf(text), tokens


def _qwen_vl_to_hf(config: VLMConfig, vision: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": [config.family.architecture],
        "model_type": config.family.model_type,
        "text_config": config.llm.to_hf(),
        "vision_config": vision,
        "tie_word_embeddings": config.llm.tie_word_embeddings,
        **{name: getattr(config, name) for name in _FAMILY_FIELDS if name.endswith("_token_id")},
    }


def _qwen2_5_vl_from_hf(hf: Mapping[str, Any]) -> VLMConfig:
    llm, tokens = _qwen_vl_text_and_tokens(hf, "qwen2_5_vl_text")
    vision = hf["vision_config"]
    return VLMConfig(
        vision=Qwen25VisionConfig.from_hf(vision),
        llm=llm,
        tokens_per_second=vision.get("tokens_per_second", _HF_TOKENS_PER_SECOND),
        **tokens,
    )


def _qwen2_5_vl_to_hf(config: VLMConfig) -> dict[str, Any]:
    vision = {
        **config.vision.to_hf(),
        "model_type": "qwen2_5_vl_vision",
        "tokens_per_second": config.tokens_per_second,
    }
    return _qwen_vl_to_hf(config, vision)


# ---------------------------------------------------------------- Qwen3-VL


def _qwen3_vl_from_hf(hf: Mapping[str, Any]) -> VLMConfig:
    llm, tokens = _qwen_vl_text_and_tokens(hf, "qwen3_vl_text")
    return VLMConfig(vision=Qwen3VisionConfig.from_hf(hf["vision_config"]), llm=llm, **tokens)


def _qwen3_vl_to_hf(config: VLMConfig) -> dict[str, Any]:
    return _qwen_vl_to_hf(config, {**config.vision.to_hf(), "model_type": "qwen3_vl_vision"})


# ---------------------------------------------------------------- Qwen3-VL-MoE


def _qwen3_vl_moe_from_hf(hf: Mapping[str, Any]) -> VLMConfig:
    llm, tokens = _qwen_vl_text_and_tokens(hf, "qwen3_vl_moe_text")
    return VLMConfig(vision=Qwen3VisionConfig.from_hf(hf["vision_config"]), llm=llm, **tokens)


def _qwen3_vl_moe_to_hf(config: VLMConfig) -> dict[str, Any]:
    return _qwen_vl_to_hf(config, {**config.vision.to_hf(), "model_type": "qwen3_vl_moe_vision"})


# ---------------------------------------------------------------- LLaVA


def _llava_text(hf: Mapping[str, Any], default_model_type: str) -> LLMConfig:
    """The LLM of a LLaVA-style ``config.json``: any architecture :class:`LLMConfig` reads (Llama, Qwen2, ...)."""
    if "text_config" not in hf:
        raise ValueError(f"a {hf['model_type']} config.json needs a text_config")
    text = {"model_type": default_model_type, **hf["text_config"]}  # transformers' default text model
    # LlavaConfig lifts the text config's flag to the top level, where transformers ties by it.
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    return LLMConfig.from_hf(text)


def _llava_from_hf(hf: Mapping[str, Any], *, vision_config: type[SiglipVisionConfig]) -> VLMConfig:
    hf = {**_HF_LLAVA_DEFAULTS, **hf}
    return VLMConfig(
        vision=vision_config.from_hf(
            hf["vision_config"],
            feature_layer=hf["vision_feature_layer"],
            feature_select_strategy=hf["vision_feature_select_strategy"],
        ),
        llm=_llava_text(hf, "llama"),
        projector=MLPProjectorConfig(
            bias=hf["multimodal_projector_bias"], hidden_act=hf["projector_hidden_act"]
        ),
        image_token_id=hf.get("image_token_id", hf["image_token_index"]),
    )


def _llava_to_hf(config: VLMConfig) -> dict[str, Any]:
    vision, projector = config.vision, config.projector
    return {
        "architectures": [config.family.architecture],
        "model_type": config.family.model_type,
        "text_config": config.llm.to_hf(),
        "vision_config": vision.to_hf(),
        "image_token_index": config.image_token_id,
        "image_seq_length": vision.tokens_per_image,
        "vision_feature_layer": vision.feature_layer,
        "vision_feature_select_strategy": vision.feature_select_strategy,
        "multimodal_projector_bias": projector.bias,
        "projector_hidden_act": projector.hidden_act,
        "tie_word_embeddings": config.llm.tie_word_embeddings,
    }


# ---------------------------------------------------------------- LLaVA-OneVision


def _onevision_from_hf(hf: Mapping[str, Any]) -> VLMConfig:
    hf = {**_HF_ONEVISION_DEFAULTS, **hf}
    return VLMConfig(
        vision=AnyResVisionConfig.from_hf(
            hf["vision_config"],
            feature_layer=hf["vision_feature_layer"],
            feature_select_strategy=hf["vision_feature_select_strategy"],
            image_grid_pinpoints=hf.get("image_grid_pinpoints"),
            vision_aspect_ratio=hf["vision_aspect_ratio"],
        ),
        llm=_llava_text(hf, "qwen2"),
        projector=MLPNewlineProjectorConfig(
            bias=hf["multimodal_projector_bias"], hidden_act=hf["projector_hidden_act"]
        ),
        image_token_id=hf.get("image_token_id", hf["image_token_index"]),
        video_token_id=hf.get("video_token_id", hf["video_token_index"]),
    )


def _onevision_to_hf(config: VLMConfig) -> dict[str, Any]:
    hf = _llava_to_hf(config)
    del hf["image_seq_length"]  # tokens per image vary with its size
    return {
        **hf,
        "video_token_index": config.video_token_id,
        "image_grid_pinpoints": config.vision.image_grid_pinpoints,
        "vision_aspect_ratio": config.vision.vision_aspect_ratio,
    }


def _llava_family(vision_config: type[SiglipVisionConfig]) -> Family:
    """LLaVA with the tower of ``vision_config`` (SigLIP or CLIP)."""
    return Family(
        name="LLaVA",
        model_type="llava",
        architecture="LlavaForConditionalGeneration",
        vision_model_types=(vision_config.HF_MODEL_TYPE,),
        projector="mlp",
        mrope=False,
        fields={"image_token_id": None},
        from_hf=functools.partial(_llava_from_hf, vision_config=vision_config),
        to_hf=_llava_to_hf,
    )


# <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|> of the Qwen2-VL vocabulary, which later Qwen-VL keep.
_QWEN_VL_TOKENS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}

FAMILIES: dict[str, Family] = {
    "qwen2_5_vit": Family(
        name="Qwen2.5-VL",
        model_type="qwen2_5_vl",
        architecture="Qwen2_5_VLForConditionalGeneration",
        vision_model_types=("qwen2_5_vl_vision", "qwen2_5_vl"),
        projector="none",
        mrope=True,
        fields={**_QWEN_VL_TOKENS, "tokens_per_second": 2},
        from_hf=_qwen2_5_vl_from_hf,
        to_hf=_qwen2_5_vl_to_hf,
    ),
    "qwen3_vit": Family(
        name="Qwen3-VL",
        model_type="qwen3_vl",
        architecture="Qwen3VLForConditionalGeneration",
        # Early Qwen3-VL files name their vision_config "qwen3_vl", as transformers still reads.
        vision_model_types=("qwen3_vl_vision", "qwen3_vl"),
        projector="none",
        mrope=True,
        fields=_QWEN_VL_TOKENS,
        from_hf=_qwen3_vl_from_hf,
        to_hf=_qwen3_vl_to_hf,
        mrope_interleaved=True,
    ),
    "siglip": _llava_family(SiglipVisionConfig),
    "clip": _llava_family(ClipVisionConfig),
    "siglip_anyres": Family(
        name="LLaVA-OneVision",
        model_type="llava_onevision",
        architecture="LlavaOnevisionForConditionalGeneration",
        vision_model_types=("siglip_vision_model",),
        projector="mlp_newline",
        mrope=False,
        # The video placeholder is kept for the checkpoint; videos are not encoded (yet).
        fields={"image_token_id": None, "video_token_id": _HF_ONEVISION_DEFAULTS["video_token_index"]},
        from_hf=_onevision_from_hf,
        to_hf=_onevision_to_hf,
        projector_required=True,
    ),
}
"""The composed architectures by ``vision.type`` (the default of each, see :data:`FAMILY_VARIANTS`)."""

FAMILY_VARIANTS: dict[str, tuple[Family, ...]] = {
    "qwen3_vit": (
        Family(
            name="Qwen3-VL-MoE",
            model_type="qwen3_vl_moe",
            architecture="Qwen3VLMoeForConditionalGeneration",
            vision_model_types=("qwen3_vl_moe_vision",),
            projector="none",
            mrope=True,
            fields=_QWEN_VL_TOKENS,
            from_hf=_qwen3_vl_moe_from_hf,
            to_hf=_qwen3_vl_moe_to_hf,
            mrope_interleaved=True,
            llm_architecture="qwen3_vl_moe_text",
        ),
    ),
}
"""Other families of a ``vision.type``, picked by the LLM's ``architecture`` (:attr:`Family.llm_architecture`)."""


def _all_families() -> list[Family]:
    return [*FAMILIES.values(), *(f for variants in FAMILY_VARIANTS.values() for f in variants)]

"""Pi0.5 configuration: the vision tower, the two Gemma stacks, the action head, and the preset table.

Sizes of the public checkpoint (lerobot ``pi05_base`` / openpi ``pi05_base``): SigLIP So400m/14 at 224 px,
Gemma 2B as the backbone and Gemma 300M as the action expert (both: 18 layers, 8 query heads, one key/value head
of size 256, so the expert can attend to the backbone's keys and values layer by layer).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_lightning.modules.vlm.siglip import SiglipVisionConfig

PROMPT_PADDINGS = ("longest", "max_length")


def _check_positive(owner: str, name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{owner}{name} ({value}) must be positive")


@dataclass(kw_only=True)
class SiglipConfig(SiglipVisionConfig):
    """The SigLIP vision tower as PaliGemma feeds Pi0.5: the last layer's output after ``post_layernorm``, one token
    per patch, whole patches only.

    The fields are :class:`~forge_lightning.modules.vlm.siglip.SiglipVisionConfig`'s (the tower is the VLM
    family's); ``feature_layer`` and ``feature_select_strategy`` choose LLaVA's features and must keep their
    defaults here.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision.patch_size ({self.patch_size}) must divide vision.image_size ({self.image_size})"
            )
        for name in ("feature_layer", "feature_select_strategy"):
            value, default = getattr(self, name), _SIGLIP_DEFAULTS[name]
            if value != default:
                raise ValueError(
                    f"vision.{name} ({value!r}) selects LLaVA's features; Pi0.5 reads the tower's last layer "
                    f"after post_layernorm: leave it at {default!r}"
                )


_SIGLIP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SiglipVisionConfig)}


@dataclass(kw_only=True)
class GemmaConfig:
    """Architecture of one Gemma stack (the backbone or the action expert).

    Args:
        hidden_size: model width.
        intermediate_size: width of the gated GELU MLP.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads.
        head_dim: size of one head.
        rms_norm_eps: RMSNorm epsilon.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_positive("", f.name, getattr(self, f.name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")


# openpi's / lerobot's Gemma variants (paligemma_variant, action_expert_variant in lerobot's config.json).
GEMMA_VARIANTS: dict[str, dict[str, int]] = {
    "gemma_2b": {"hidden_size": 2048, "intermediate_size": 16384, "num_layers": 18},
    "gemma_300m": {"hidden_size": 1024, "intermediate_size": 4096, "num_layers": 18},
}
"""Gemma sizes by lerobot / openpi variant name (8 query heads, one key/value head of size 256)."""


@dataclass(kw_only=True)
class Pi05Config:
    """Architecture and flow-matching settings of a Pi0.5 model (Physical Intelligence, 2025).

    Args:
        vision: the SigLIP tower (a dict is converted).
        llm: the Gemma backbone (PaliGemma's language model).
        action_expert: the smaller Gemma that denoises action chunks; its layers attend to the backbone's keys
            and values, so ``num_layers``, ``num_kv_heads`` and ``head_dim`` must match the backbone's.
        vocab_size: token embeddings of the backbone (PaliGemma: 257152).
        chunk_size: actions predicted per observation (openpi's ``action_horizon``).
        max_state_dim: states longer than this are refused (shorter ones are used as they are).
        max_action_dim: action width inside the model; shorter actions are zero-padded.
        tokenizer_max_length: most prompt tokens (longer prompts are truncated).
        prompt_padding: ``"longest"`` pads each batch's prompts to its longest one, rounded up to a multiple of
            ``prompt_pad_multiple`` (at most ``tokenizer_max_length``); ``"max_length"`` pads every prompt to
            ``tokenizer_max_length``, as lerobot and openpi do. Padding is masked, so both give the same losses
            and actions; ``"longest"`` does not spend the backbone's compute on padding.
        prompt_pad_multiple: see ``prompt_padding`` (a few distinct widths keep compiled blocks from recompiling).
        num_inference_steps: Euler steps from noise to actions.
        state_bins: bins over ``[-1, 1]`` of the normalised state written into the prompt.
        rope_theta: RoPE base wavelength of both stacks.
        min_period: shortest period of the sinusoidal flow-time embedding.
        max_period: longest period of the sinusoidal flow-time embedding.
        time_beta_alpha: training flow times are ``Beta(alpha, beta) * time_scale + time_offset``.
        time_beta_beta: see ``time_beta_alpha``.
        time_scale: see ``time_beta_alpha``.
        time_offset: see ``time_beta_alpha``.
        initializer_range: standard deviation of the normal initialisation of linear and embedding weights.
    """

    vision: SiglipConfig
    llm: GemmaConfig
    action_expert: GemmaConfig
    vocab_size: int = 257152
    chunk_size: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    tokenizer_max_length: int = 200
    prompt_padding: str = "longest"
    prompt_pad_multiple: int = 32
    num_inference_steps: int = 10
    state_bins: int = 256
    rope_theta: float = 10000.0
    min_period: float = 4e-3
    max_period: float = 4.0
    time_beta_alpha: float = 1.5
    time_beta_beta: float = 1.0
    time_scale: float = 0.999
    time_offset: float = 0.001
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if isinstance(self.vision, Mapping):
            self.vision = SiglipConfig(**self.vision)
        for name in ("llm", "action_expert"):
            if isinstance(getattr(self, name), Mapping):
                setattr(self, name, GemmaConfig(**getattr(self, name)))
        for name in ("vocab_size", "chunk_size", "max_state_dim", "max_action_dim", "tokenizer_max_length"):
            _check_positive("", name, getattr(self, name))
        for name in ("num_inference_steps", "state_bins", "rope_theta", "min_period", "max_period"):
            _check_positive("", name, getattr(self, name))
        _check_positive("", "prompt_pad_multiple", self.prompt_pad_multiple)
        if self.prompt_padding not in PROMPT_PADDINGS:
            raise ValueError(
                f"prompt_padding {self.prompt_padding!r} is not one of {', '.join(map(repr, PROMPT_PADDINGS))}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            llm, expert = getattr(self.llm, name), getattr(self.action_expert, name)
            if llm != expert:
                raise ValueError(
                    f"action_expert.{name} ({expert}) must equal llm.{name} ({llm}): the expert attends to the "
                    "backbone's keys and values layer by layer"
                )
        if self.action_expert.hidden_size % 2:
            raise ValueError(
                f"action_expert.hidden_size ({self.action_expert.hidden_size}) must be even (sin/cos time "
                "embedding)"
            )

    # ----- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> Pi05Config:
        """Build ``PRESETS[name]`` with top-level fields in ``overrides`` replaced."""
        if name not in PRESETS:
            raise KeyError(f"unknown Pi0.5 preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls(**{**_copy(PRESETS[name]), **overrides})

    @classmethod
    def load(cls, source: Pi05Config | Mapping[str, Any] | str | Path) -> Pi05Config:
        """A config from a preset name, a dict of fields, a lerobot ``config.json`` or a directory holding one.

        A lerobot / openpi policy ``config.json`` (``"type": "pi05"``) is read with :meth:`from_lerobot`; any
        other JSON file must hold this class's fields.
        """
        if isinstance(source, Pi05Config):
            return dataclasses.replace(source)
        if isinstance(source, Mapping):
            return cls.from_lerobot(source) if source.get("type") == "pi05" else cls(**_copy(source))
        if isinstance(source, str) and source in PRESETS:
            return cls.from_preset(source)
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{str(source)!r} is neither a Pi0.5 preset ({', '.join(PRESETS)}) nor a config.json or a "
                "directory holding one"
            )
        return cls.load(json.loads(path.read_text()))

    @classmethod
    def from_lerobot(cls, config: Mapping[str, Any], **overrides: Any) -> Pi05Config:
        """Read a lerobot ``PI05Config`` ``config.json`` (sizes from its Gemma variants, at public SigLIP size).

        Args:
            config: the parsed ``config.json`` of a lerobot Pi0.5 policy.
            overrides: fields to replace (e.g. ``vision``, ``llm``, ``action_expert``, ``vocab_size`` for a
                checkpoint built at other sizes than its variant names say).
        """
        if config.get("type", "pi05") != "pi05":
            raise ValueError(f"config.json describes a {config.get('type')!r} policy, not 'pi05'")
        height, width = config.get("image_resolution", (224, 224))
        if height != width:
            raise ValueError(f"image_resolution ({height}, {width}) must be square")
        base = _copy(PRESETS["pi05-base"])
        base["vision"]["image_size"] = height
        for ours, theirs in (("llm", "paligemma_variant"), ("action_expert", "action_expert_variant")):
            variant = config.get(theirs, "gemma_2b" if ours == "llm" else "gemma_300m")
            if variant not in GEMMA_VARIANTS:
                raise ValueError(f"{theirs} ({variant!r}) must be one of {', '.join(GEMMA_VARIANTS)}")
            base[ours] = {**base[ours], **GEMMA_VARIANTS[variant]}
        for ours, theirs in _LEROBOT_FIELDS.items():
            if theirs in config:
                base[ours] = config[theirs]
        return cls(**{**base, **overrides})

    def training_flops_per_sample(self, num_cameras: int, prompt_tokens: float | None = None) -> float:
        """Training FLOPs (forward + backward, ``3 x`` the forward's) of one sample with ``num_cameras`` images
        and a prompt of ``prompt_tokens`` tokens, padding included (default ``tokenizer_max_length``).

        Matmuls count ``2 * in * out`` per token they process and attention ``4 * d_attn * keys`` per query (the
        full square, masked or not), as the LLM formula does: the SigLIP tower and patch embedding on
        ``num_patches`` tokens per camera, the projector, the backbone on the prefix (images plus the padded
        prompt; its last layer only makes the keys and values the action tokens
        read), and the action expert on the ``chunk_size`` action tokens, which attend to the prefix and to each
        other. Per-sample work (the time embedding and the adaptive norms' modulation) is left out: under 0.01%
        at ``pi05-base``.
        """
        v, g, e = self.vision, self.llm, self.action_expert
        image_tokens = num_cameras * v.num_patches
        prefix = image_tokens + (self.tokenizer_max_length if prompt_tokens is None else prompt_tokens)
        vision_layer = 4 * v.hidden_size**2 + 2 * v.hidden_size * v.intermediate_size
        patch = 3 * v.patch_size**2 * v.hidden_size
        projector = v.hidden_size * g.hidden_size
        forward = 2 * image_tokens * (v.num_layers * vision_layer + patch + projector)
        forward += 4 * v.num_layers * v.hidden_size * v.num_patches * image_tokens
        key_value = 2 * g.hidden_size * g.num_kv_heads * g.head_dim
        forward += 2 * prefix * ((g.num_layers - 1) * _gemma_layer_weights(g) + key_value)
        forward += 4 * (g.num_layers - 1) * g.num_heads * g.head_dim * prefix * prefix
        chunk = self.chunk_size
        action_io = 2 * self.max_action_dim * e.hidden_size
        forward += 2 * chunk * (e.num_layers * _gemma_layer_weights(e) + action_io)
        forward += 4 * e.num_layers * e.num_heads * e.head_dim * chunk * (prefix + chunk)
        return 3.0 * forward

    def to_dict(self) -> dict[str, Any]:
        """Plain fields (nested dicts for the sub-configs), as :meth:`load` reads them back."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _copy(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _plain(v) if not isinstance(v, Mapping) else dict(v) for k, v in fields.items()}


# Our field -> lerobot PI05Config field (same meaning and units).
_LEROBOT_FIELDS = {
    "chunk_size": "chunk_size",
    "max_state_dim": "max_state_dim",
    "max_action_dim": "max_action_dim",
    "tokenizer_max_length": "tokenizer_max_length",
    "num_inference_steps": "num_inference_steps",
    "min_period": "min_period",
    "max_period": "max_period",
    "time_beta_alpha": "time_sampling_beta_alpha",
    "time_beta_beta": "time_sampling_beta_beta",
    "time_scale": "time_sampling_scale",
    "time_offset": "time_sampling_offset",
}

PRESETS: dict[str, dict[str, Any]] = {
    # The sizes of the committed parity fixture (tests/fixtures/pi05): trains on a CPU in seconds.
    "debug": {
        "vision": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "patch_size": 8,
            "image_size": 32,
        },
        "llm": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "head_dim": 16},
        "action_expert": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "head_dim": 16},
        "vocab_size": 272,
        "chunk_size": 5,
        "max_state_dim": 8,
        "max_action_dim": 6,
        "tokenizer_max_length": 20,
        "num_inference_steps": 4,
    },
    # The VLA quick start (configs/quickstart/vla.yaml): 32-pixel images in 4-pixel patches (64 tokens), a
    # 16-token prompt, 10-action chunks of 2-D actions; ~0.4 M parameters, trains on 2 CPU cores in minutes.
    "quickstart": {
        "vision": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_layers": 2,
            "num_heads": 4,
            "patch_size": 4,
            "image_size": 32,
        },
        "llm": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "head_dim": 16},
        "action_expert": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_layers": 2,
            "num_heads": 4,
            "head_dim": 16,
        },
        "vocab_size": 272,
        "chunk_size": 10,
        "max_state_dim": 8,
        "max_action_dim": 2,
        "tokenizer_max_length": 16,
        "num_inference_steps": 10,
    },
    # lerobot/pi05_base and openpi's pi05_base: PaliGemma 3B (SigLIP So400m/14 + Gemma 2B) + Gemma 300M expert.
    "pi05-base": {
        "vision": {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_layers": 27,
            "num_heads": 16,
            "patch_size": 14,
            "image_size": 224,
        },
        "llm": {"hidden_size": 2048, "intermediate_size": 16384, "num_layers": 18},
        "action_expert": {"hidden_size": 1024, "intermediate_size": 4096, "num_layers": 18},
    },
}
"""Named Pi0.5 configurations (``Pi05Config.from_preset(name)``)."""


def _gemma_layer_weights(config: GemmaConfig) -> int:
    """Matmul weights of one Gemma decoder layer (attention projections and the gated MLP)."""
    h, d = config.hidden_size, config.head_dim
    attention = 2 * h * config.num_heads * d + 2 * h * config.num_kv_heads * d
    return attention + 3 * h * config.intermediate_size

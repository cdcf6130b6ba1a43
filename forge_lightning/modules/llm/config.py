"""Decoder LM configuration, the preset table, Hugging Face ``config.json`` mapping and FLOP accounting."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_lightning.modules.layers.rope import ROPE_SCALING_KEYS, ROPE_TYPES

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""Supported Hugging Face ``model_type`` values and the ``architectures`` class each exports as."""

# What each architecture fixes about biases and q/k norm, as transformers builds it. `"attention_bias"` as a value
# means "equal to attention_bias" (Llama's and Qwen3's `attention_bias` covers q/k/v and o_proj alike).
_ARCH_RULES: dict[str, dict[str, Any]] = {
    "llama": {"o_proj_bias": "attention_bias", "qk_norm": False},
    "mistral": {"attention_bias": False, "o_proj_bias": False, "mlp_bias": False, "qk_norm": False},
    "qwen2": {"attention_bias": True, "o_proj_bias": False, "mlp_bias": False, "qk_norm": False},
    "qwen3": {"o_proj_bias": "attention_bias", "mlp_bias": False, "qk_norm": True},
}

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class LLMConfig:
    """Architecture of a dense decoder-only LM (Llama 2/3/3.1/3.2, Qwen2/2.5, Qwen3, Mistral without sliding window).

    Args:
        vocab_size: number of token embeddings (and logits).
        hidden_size: model width.
        intermediate_size: width of the SwiGLU hidden layer.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA; 1 is MQA); ``None`` means ``num_heads``.
        head_dim: size of one head; ``None`` means ``hidden_size // num_heads``.
        max_position_embeddings: longest sequence the model is meant for.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base wavelength.
        rope_scaling: ``None`` for plain RoPE, or ``{"rope_type": "linear" | "llama3", ...}`` with the
            Hugging Face parameters of that type (``type`` is accepted as an alias of ``rope_type``).
        attention_bias: bias on the q/k/v projections.
        o_proj_bias: bias on the attention output projection.
        mlp_bias: bias on the three MLP projections.
        qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
        tie_word_embeddings: the output head shares the input embedding matrix.
        initializer_range: standard deviation of the normal initialisation of Linear / Embedding weights.
        bos_token_id: beginning-of-sequence token.
        eos_token_id: end-of-sequence token(s).
        pad_token_id: padding token.
        architecture: Hugging Face ``model_type`` used when exporting (see :data:`ARCHITECTURES`).
        torch_dtype: dtype name the Hugging Face checkpoint stores (informational; written to ``config.json``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    architecture: str = "llama"
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            _check_positive(name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                    "when head_dim is not set"
                )
            self.head_dim = self.hidden_size // self.num_heads
        _check_positive("head_dim", self.head_dim)
        _check_positive("max_position_embeddings", self.max_position_embeddings)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        if self.initializer_range < 0:
            raise ValueError(f"initializer_range ({self.initializer_range}) must be non-negative")
        if self.torch_dtype is not None and self.torch_dtype not in _DTYPES:
            raise ValueError(f"torch_dtype ({self.torch_dtype!r}) must be one of {', '.join(_DTYPES)}")
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)
        self._check_architecture()

    def _check_architecture(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture ({self.architecture!r}) is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        for name, rule in _ARCH_RULES[self.architecture].items():
            expected = getattr(self, rule) if isinstance(rule, str) else rule
            if getattr(self, name) != expected:
                because = f" (it follows {rule})" if isinstance(rule, str) else ""
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be {expected} for architecture {self.architecture!r}"
                    f"{because}"
                )

    # ---------------------------------------------------------------- sizes and FLOPs

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameter count of the model this config builds (tied weights counted once).

        Args:
            non_embedding: leave out the input embedding table and the output head (tied or not).
        """
        H, V, D = self.hidden_size, self.vocab_size, self.head_dim
        q_out, kv_out = self.num_heads * D, self.num_kv_heads * D
        attn = H * (q_out + 2 * kv_out) + q_out * H
        attn += (q_out + 2 * kv_out) * self.attention_bias + H * self.o_proj_bias + 2 * D * self.qk_norm
        mlp = 3 * H * self.intermediate_size + (2 * self.intermediate_size + H) * self.mlp_bias
        body = self.num_layers * (attn + mlp + 2 * H) + H
        if non_embedding:
            return body
        return body + V * H * (1 if self.tie_word_embeddings else 2)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len``; see :func:`llm_flops_per_token`."""
        return llm_flops_per_token(self, seq_len)

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(cls, source: LLMConfig | Mapping[str, Any] | str | Path) -> LLMConfig:
        """Build a config from a preset name, a Hugging Face config dict, ``config.json`` or its directory.

        Args:
            source: an :class:`LLMConfig` (copied), a Hugging Face ``config.json`` dict, a name in
                :data:`PRESETS`, a path to a ``config.json`` file, or a directory containing one.
        """
        if isinstance(source, LLMConfig):
            return dataclasses.replace(source)
        if isinstance(source, Mapping):
            return cls.from_hf(source)
        if isinstance(source, str) and source in PRESETS:
            return cls.from_preset(source)
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{str(source)!r} is neither a preset ({', '.join(PRESETS)}) nor an existing config.json or "
                "directory containing one"
            )
        return cls.from_hf(json.loads(path.read_text()))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LLMConfig:
        """Build ``PRESETS[name]`` with ``overrides`` applied (derived fields such as ``head_dim`` follow them)."""
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    # ---------------------------------------------------------------- Hugging Face config.json

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LLMConfig:
        """Read a Hugging Face ``config.json`` dict (classic ``rope_scaling`` or transformers 5 ``rope_parameters``).

        Raises:
            ValueError: unsupported ``model_type``, activation, rope type, or a model that needs sliding-window
                attention.
        """
        arch = hf.get("model_type")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture: model_type {arch!r} (architectures {hf.get('architectures')}); "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        missing = [k for k in _HF_REQUIRED if k not in hf]
        if missing:
            raise ValueError(f"Hugging Face config lacks required fields: {', '.join(missing)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act ({hf['hidden_act']!r}) is not supported; only 'silu' (SwiGLU) is")
        _check_full_attention(hf, arch)
        rope_theta, rope_scaling = _rope_from_hf(hf)
        attention_bias = arch == "qwen2" or bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads"),
            head_dim=hf.get("head_dim", 128 if arch == "qwen3" else None),
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=attention_bias,
            o_proj_bias=attention_bias if arch in ("llama", "qwen3") else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if arch == "llama" else False,
            qk_norm=arch == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=hf.get("initializer_range", 0.02),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            architecture=arch,
            torch_dtype=hf.get("dtype", hf.get("torch_dtype")),
        )

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers (4.x and 5.x) loads as this architecture.

        RoPE is written both ways: ``rope_theta`` + ``rope_scaling`` (classic) and ``rope_parameters``
        (transformers 5); the dtype both as ``torch_dtype`` and ``dtype``.
        """
        params = {k: v for k, v in (self.rope_scaling or {}).items() if k != "rope_type"}
        rope_type = self.rope_scaling["rope_type"] if self.rope_scaling else "default"
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": {"rope_type": rope_type, "rope_theta": self.rope_theta, **params},
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "attention_dropout": 0.0,
            "use_cache": True,
        }
        if self.torch_dtype is not None:
            hf["torch_dtype"] = hf["dtype"] = self.torch_dtype
        if self.architecture in ("llama", "qwen3"):
            hf["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.architecture in ("qwen2", "qwen3"):
            hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        if self.architecture == "mistral":
            hf["sliding_window"] = None
        return hf


_HF_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")


def _normalise_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Validate rope scaling; return a fresh dict keyed by ``rope_type`` (``None`` for plain RoPE)."""
    if scaling is None:
        return None
    params = dict(scaling)
    rope_type = params.pop("rope_type", None) or params.pop("type", "default")
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type ({rope_type!r}) is not supported; supported rope types: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    expected = ROPE_SCALING_KEYS[rope_type]
    if set(params) != expected:
        raise ValueError(
            f"rope_scaling of type {rope_type!r} takes exactly {sorted(expected)}, got {sorted(params)}"
        )
    if not params["factor"] >= 1:
        raise ValueError(f"rope_scaling factor ({params['factor']}) must be >= 1")
    if rope_type == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(
            f"rope_scaling high_freq_factor ({params['high_freq_factor']}) must exceed "
            f"low_freq_factor ({params['low_freq_factor']})"
        )
    return {"rope_type": rope_type, **params}


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either config style (``rope_scaling`` wins, as in transformers)."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"per-layer-type rope parameters are not supported, got {sorted(params)}")
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"partial_rotary_factor ({partial}) is not supported; only full rotary embeddings are"
        )
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    return theta, (params if rope_type != "default" else None)


def _check_full_attention(hf: Mapping[str, Any], arch: str) -> None:
    """Refuse a config whose attention needs a sliding window shorter than the supported context."""
    window, max_pos = hf.get("sliding_window"), hf["max_position_embeddings"]
    if arch not in ("mistral", "qwen2", "qwen3") or window is None or window >= max_pos:
        return
    if arch == "mistral":
        slides = True
    elif hf.get("layer_types") is not None:
        slides = "sliding_attention" in hf["layer_types"]
    else:
        num_layers = hf["num_hidden_layers"]
        slides = bool(hf.get("use_sliding_window")) and hf.get("max_window_layers", num_layers) < num_layers
    if slides:
        raise ValueError(
            f"this {arch} config requires sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={max_pos}, use_sliding_window={hf.get('use_sliding_window')}); only full "
            "attention is supported. Set sliding_window to null if the model was trained with full attention."
        )


# ---------------------------------------------------------------------------------------------- FLOPs


def attention_flops_per_token(config: LLMConfig, doc_lengths: Sequence[int]) -> float:
    """Attention-score FLOPs per token (forward + backward) for a sequence packed from documents.

    Each document of length ``l`` costs ``12 * num_layers * d_attn * l`` per token (``QK^T`` and ``AV``, full
    square, as in the PaLM appendix), so the per-token average over the pack is
    ``12 * num_layers * d_attn * sum(l^2) / sum(l)``. ``d_attn = num_heads * head_dim``, which equals
    ``hidden_size`` except for models such as Qwen3 whose heads are wider.

    Args:
        config: the model's configuration.
        doc_lengths: token counts of the documents in the sequence (one entry for an unpacked sequence).
    """
    total = sum(doc_lengths)
    if total <= 0:
        raise ValueError(f"doc_lengths ({list(doc_lengths)}) must contain at least one token")
    d_attn = config.num_heads * config.head_dim
    return 12 * config.num_layers * d_attn * sum(n * n for n in doc_lengths) / total


def llm_flops_per_token(config: LLMConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N + 12 * num_layers * d_attn * seq_len`` (Kaplan et al. 2020; PaLM).

    ``N`` is every non-embedding parameter plus the output head matmul (``vocab_size * hidden_size``), which
    is computed even when the head is tied to the embedding. See :func:`attention_flops_per_token` for
    ``d_attn`` and for packed sequences.

    Args:
        config: the model's configuration.
        seq_len: tokens per (unpacked) sequence.
    """
    n = config.num_parameters(non_embedding=True) + config.vocab_size * config.hidden_size
    return 6 * n + attention_flops_per_token(config, [seq_len])


# ---------------------------------------------------------------------------------------------- presets

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_COMMON = dict(
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    bos_token_id=128000,
    eos_token_id=128001,
    architecture="llama",
    torch_dtype="bfloat16",
)
_QWEN3_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    qk_norm=True,
    bos_token_id=151643,
    eos_token_id=151645,
    architecture="qwen3",
    torch_dtype="bfloat16",
)

PRESETS: dict[str, dict[str, Any]] = {
    # Tiny Llama-style model for tests.
    "debug": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
    ),
    # Llama-style ~4.2M parameters (1.0M of them embeddings): trains on a laptop CPU.
    "quickstart": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # https://huggingface.co/meta-llama/Llama-3.2-1B
    "llama3.2-1b": dict(
        **_LLAMA3_COMMON,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
    ),
    # https://huggingface.co/meta-llama/Llama-3.2-3B
    "llama3.2-3b": dict(
        **_LLAMA3_COMMON,
        hidden_size=3072,
        intermediate_size=8192,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
    ),
    # https://huggingface.co/meta-llama/Llama-3.1-8B
    "llama3.1-8b": dict(
        **_LLAMA3_COMMON,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        tie_word_embeddings=False,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
    ),
    # https://huggingface.co/Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=True,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151643,
        architecture="qwen2",
        torch_dtype="bfloat16",
    ),
    # https://huggingface.co/Qwen/Qwen3-0.6B
    "qwen3-0.6b": dict(
        **_QWEN3_COMMON,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        tie_word_embeddings=True,
    ),
    # https://huggingface.co/Qwen/Qwen3-4B
    "qwen3-4b": dict(
        **_QWEN3_COMMON,
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        tie_word_embeddings=True,
    ),
    # https://huggingface.co/Qwen/Qwen3-8B
    "qwen3-8b": dict(
        **_QWEN3_COMMON,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        tie_word_embeddings=False,
    ),
}
"""Named configurations as :class:`LLMConfig` keyword arguments; build one with :meth:`LLMConfig.from_preset`."""

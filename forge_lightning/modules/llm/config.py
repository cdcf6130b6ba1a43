"""Decoder LM configuration, the preset table, Hugging Face ``config.json`` mapping and FLOP accounting."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_lightning.modules.layers.rope import MROPE_KEYS, ROPE_SCALING_KEYS, ROPE_TYPES

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    # The language models of Qwen2.5-VL / Qwen3-VL (their `text_config`), with multimodal RoPE.
    "qwen2_5_vl_text": "Qwen2_5_VLTextModel",
    "qwen3_vl_text": "Qwen3VLTextModel",
    "qwen3_vl_moe_text": "Qwen3VLMoeTextModel",
}
"""Supported Hugging Face ``model_type`` values and the ``architectures`` class each exports as."""

_DENSE = {"moe": None, "mla": None}


@dataclass(frozen=True)
class _Follows:
    """An architecture rule "equal to this other field"."""

    name: str


# What each architecture fixes, as transformers builds it. Llama's, Qwen3's and DeepSeek's `attention_bias` covers
# the input projections and o_proj alike. Dotted names are fields of the `moe` / `mla` sub-configs, checked when
# that sub-config is set.
_FOLLOWS_BIAS = _Follows("attention_bias")
_ARCH_RULES: dict[str, dict[str, Any]] = {
    "llama": {"o_proj_bias": _FOLLOWS_BIAS, "qk_norm": False, **_DENSE},
    "mistral": {"attention_bias": False, "o_proj_bias": False, "mlp_bias": False, "qk_norm": False, **_DENSE},
    "qwen2": {"attention_bias": True, "o_proj_bias": False, "mlp_bias": False, "qk_norm": False, **_DENSE},
    "qwen3": {"o_proj_bias": _FOLLOWS_BIAS, "mlp_bias": False, "qk_norm": True, **_DENSE},
    "qwen2_moe": {
        "o_proj_bias": False,
        "mlp_bias": False,
        "qk_norm": False,
        "mla": None,
        "moe.score_func": "softmax",
        "moe.routed_scaling_factor": 1.0,
        "moe.shared_expert_gate": True,
        "moe.first_dense_layers": 0,
    },
    "qwen3_moe": {
        "o_proj_bias": _FOLLOWS_BIAS,
        "mlp_bias": False,
        "qk_norm": True,
        "mla": None,
        "moe.score_func": "softmax",
        "moe.routed_scaling_factor": 1.0,
        "moe.shared_intermediate_size": 0,
        "moe.first_dense_layers": 0,
    },
    "deepseek_v3": {
        "o_proj_bias": _FOLLOWS_BIAS,
        "mlp_bias": False,
        "qk_norm": False,
        "moe.score_func": "sigmoid",
        "moe.shared_expert_gate": False,
        "moe.layer_step": 1,
        "moe.dense_layers": [],
    },
    "qwen2_5_vl_text": {
        "attention_bias": True,
        "o_proj_bias": False,
        "mlp_bias": False,
        "qk_norm": False,
        "mrope_interleaved": False,
        **_DENSE,
    },
    "qwen3_vl_text": {
        "o_proj_bias": _FOLLOWS_BIAS,
        "mlp_bias": False,
        "qk_norm": True,
        "mrope_interleaved": True,
        **_DENSE,
    },
    # Qwen3-VL-MoE's router always renormalises its top-k probabilities (its config has no norm_topk_prob).
    "qwen3_vl_moe_text": {
        "o_proj_bias": _FOLLOWS_BIAS,
        "mlp_bias": False,
        "qk_norm": True,
        "mrope_interleaved": True,
        "mla": None,
        "moe.score_func": "softmax",
        "moe.norm_topk_prob": True,
        "moe.routed_scaling_factor": 1.0,
        "moe.shared_intermediate_size": 0,
        "moe.first_dense_layers": 0,
    },
}
# transformers' M-RoPE split when a VL text config names none.
_DEFAULT_MROPE_SECTION = {
    "qwen2_5_vl_text": [16, 24, 24],
    "qwen3_vl_text": [24, 20, 20],
    "qwen3_vl_moe_text": [24, 20, 20],
}
_SCORE_FUNCS = ("softmax", "sigmoid")

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture-of-experts feed-forward layers (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3).

    Layer ``i`` is a MoE layer unless ``i < first_dense_layers``, ``(i + 1) % layer_step != 0`` or ``i`` is in
    ``dense_layers``; the other layers keep the dense SwiGLU MLP of width ``LLMConfig.intermediate_size``.

    Args:
        num_experts: routed experts per MoE layer.
        num_experts_per_tok: experts each token is routed to (top-k).
        intermediate_size: SwiGLU width of one routed expert.
        score_func: ``softmax`` over the router logits (Qwen) or an independent ``sigmoid`` per expert
            (DeepSeek-V3, with the ``e_score_correction_bias`` that shifts the selection but not the weights).
        norm_topk_prob: renormalise the top-k scores of a token to sum to one.
        num_groups: expert groups for group-limited routing (sigmoid only; 1 disables it).
        num_groups_per_tok: groups a token may pick its experts from (ranked by the sum of their top-2 scores).
        routed_scaling_factor: factor on the routed experts' weights (DeepSeek-V3: 2.5).
        shared_intermediate_size: SwiGLU width of the always-active shared expert(s); 0 for none.
        shared_expert_gate: scale the shared expert by ``sigmoid(Linear(hidden, 1))`` (Qwen2-MoE).
        first_dense_layers: leading layers kept dense (DeepSeek ``first_k_dense_replace``).
        layer_step: every ``layer_step``-th layer is MoE (Qwen ``decoder_sparse_step``).
        dense_layers: indices of further dense layers (Qwen ``mlp_only_layers``).
        aux_loss_coef: weight of the load-balancing loss added to the training loss.
        z_loss_coef: weight of the router z-loss added to the training loss.
        bias_update_rate: auxiliary-loss-free load balancing (Wang et al. 2024, arXiv:2408.15664; DeepSeek-V3's
            ``gamma``, 0.001 there): after every optimizer step each MoE layer's selection bias
            (``e_score_correction_bias``, sigmoid routing only) moves by this much per expert towards balance,
            ``bias += rate * sign(mean load - load)``, the loads being the tokens routed to each expert over the
            step's global batch. 0 keeps the bias as loaded. ``router_bias_update_rate`` in a ``config.json``.
    """

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    score_func: str = "softmax"
    norm_topk_prob: bool = False
    num_groups: int = 1
    num_groups_per_tok: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    first_dense_layers: int = 0
    layer_step: int = 1
    dense_layers: list[int] = field(default_factory=list)
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "intermediate_size", "num_groups", "layer_step"):
            _check_positive(f"moe.{name}", getattr(self, name))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"moe.num_experts_per_tok ({self.num_experts_per_tok}) must not exceed moe.num_experts "
                f"({self.num_experts})"
            )
        if self.score_func not in _SCORE_FUNCS:
            raise ValueError(f"moe.score_func ({self.score_func!r}) must be one of {', '.join(_SCORE_FUNCS)}")
        self._check_groups()
        for name in ("shared_intermediate_size", "first_dense_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"moe.{name} ({getattr(self, name)!r}) must be a non-negative integer")
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ValueError(
                "moe.shared_expert_gate (True) needs a shared expert: set moe.shared_intermediate_size"
            )
        if any(not isinstance(i, int) or i < 0 for i in self.dense_layers):
            raise ValueError(f"moe.dense_layers ({self.dense_layers}) must be non-negative layer indices")
        self.dense_layers = list(self.dense_layers)
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"moe.routed_scaling_factor ({self.routed_scaling_factor}) must be positive")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe.{name} ({getattr(self, name)}) must be non-negative")
        if self.bias_update_rate and self.score_func != "sigmoid":
            raise ValueError(
                f"moe.bias_update_rate ({self.bias_update_rate}) needs the selection bias of sigmoid routing "
                "(moe.score_func 'sigmoid', DeepSeek-V3); softmax routers have none"
            )

    def _check_groups(self) -> None:
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"moe.num_groups ({self.num_groups}) must divide moe.num_experts ({self.num_experts})"
            )
        if not 1 <= self.num_groups_per_tok <= self.num_groups:
            raise ValueError(
                f"moe.num_groups_per_tok ({self.num_groups_per_tok}) must be in [1, moe.num_groups "
                f"({self.num_groups})]"
            )
        if self.num_groups == 1:
            return
        per_group = self.num_experts // self.num_groups
        if self.score_func != "sigmoid":
            raise ValueError(f"moe.num_groups ({self.num_groups}) > 1 needs moe.score_func 'sigmoid'")
        if per_group < 2:  # a group is ranked by the sum of its two best scores
            raise ValueError(f"moe.num_groups ({self.num_groups}) must leave at least 2 experts per group")
        if self.num_experts_per_tok > self.num_groups_per_tok * per_group:
            raise ValueError(
                f"moe.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of "
                f"moe.num_groups_per_tok ({self.num_groups_per_tok}) groups of {per_group}"
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (from 0) holds experts rather than a dense MLP."""
        return (
            index >= self.first_dense_layers
            and (index + 1) % self.layer_step == 0
            and index not in self.dense_layers
        )


@dataclass(kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values pass through low-rank latents.

    Each head's query and key are ``[nope | rope]`` (sizes ``qk_nope_head_dim`` and ``qk_rope_head_dim``); the
    rotary part of the key is one vector shared by all heads. Values have ``v_head_dim`` per head.

    Args:
        kv_lora_rank: width of the compressed key/value latent (what a KV cache stores).
        qk_nope_head_dim: per-head query/key size without rotary embedding.
        qk_rope_head_dim: per-head query/key size with rotary embedding.
        v_head_dim: per-head value size.
        q_lora_rank: width of the compressed query latent; ``None`` projects queries directly.
        rope_interleave: the checkpoint's rotary dimensions are interleaved pairs ``(x0, x1), (x2, x3), ...``
            (DeepSeek's layout) rather than halves.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_positive(f"mla.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            _check_positive("mla.q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"mla.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for rotary embeddings"
            )


@dataclass(kw_only=True)
class LLMConfig:
    """Architecture of a decoder-only LM: dense (Llama 2/3/3.1/3.2, Qwen2/2.5, Qwen3, Mistral without sliding
    window) or mixture-of-experts (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 with multi-head latent attention).

    Args:
        vocab_size: number of token embeddings (and logits).
        hidden_size: model width.
        intermediate_size: width of the SwiGLU hidden layer.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA; 1 is MQA); ``None`` means ``num_heads``.
        head_dim: size of one head; ``None`` means ``hidden_size // num_heads`` (with ``mla``: the query/key
            head size ``qk_nope_head_dim + qk_rope_head_dim``).
        max_position_embeddings: longest sequence the model is meant for.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base wavelength.
        rope_scaling: ``None`` for plain RoPE, or ``{"rope_type": "linear" | "llama3", ...}`` with the
            Hugging Face parameters of that type (``type`` is accepted as an alias of ``rope_type``). Multimodal
            RoPE (Qwen2.5-VL / Qwen3-VL) adds ``mrope_section`` (frequencies per temporal / height / width axis,
            summing to ``head_dim // 2``) and ``mrope_interleaved`` to any type (``mrope`` is an alias of
            ``default``); the model then takes ``[3, B, S]`` position ids.
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
        moe: mixture-of-experts layers (see :class:`MoEConfig`; a dict is converted); ``None`` for a dense model.
        mla: multi-head latent attention instead of grouped-query attention (see :class:`MLAConfig`).
        num_nextn_predict_layers: DeepSeek-V3's multi-token prediction (MTP) modules the model builds (see
            ``DecoderLM.mtp``); 0 for none. Written to ``config.json`` under this name when set; :meth:`from_hf`
            does not read it back: transformers writes 1 into every DeepSeek-V3 config, with or without the
            weights, and ignores those layers itself, so MTP is chosen by the training run
            (``CausalLM(num_nextn_predict_layers=..., mtp_loss_weight=...)``), not by the checkpoint.
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
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        # Sub-configs are copied so that configs built from one preset or dict never share mutable state.
        self.moe, self.mla = _sub_config(MoEConfig, self.moe), _sub_config(MLAConfig, self.mla)
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.mla is not None:
            self._check_mla()
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
        if self.num_nextn_predict_layers < 0:
            raise ValueError(
                f"num_nextn_predict_layers ({self.num_nextn_predict_layers}) must be 0 (no multi-token prediction) "
                "or positive"
            )
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
        self._check_mrope()
        if self.num_nextn_predict_layers and self.mrope_section is not None:
            raise ValueError(
                f"num_nextn_predict_layers ({self.num_nextn_predict_layers}) cannot be combined with rope_scaling "
                "mrope_section (multimodal RoPE): multi-token prediction runs on text positions only; set it to 0"
            )
        self._check_architecture()

    def _check_mla(self) -> None:
        qk_head_dim = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        if self.head_dim is None:
            self.head_dim = qk_head_dim
        if self.head_dim != qk_head_dim:
            raise ValueError(
                f"head_dim ({self.head_dim}) must equal mla.qk_nope_head_dim + mla.qk_rope_head_dim "
                f"({qk_head_dim}) with multi-head latent attention"
            )
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must equal num_heads ({self.num_heads}) with multi-head latent "
                "attention (keys and values are expanded per head)"
            )

    def _check_mrope(self) -> None:
        if self.mrope_section is None:
            return
        if self.mla is not None:
            raise ValueError("rope_scaling mrope_section (multimodal RoPE) cannot be combined with mla")
        if sum(self.mrope_section) != self.rope_head_dim // 2:
            raise ValueError(
                f"rope_scaling mrope_section ({self.mrope_section}) must sum to head_dim // 2 "
                f"({self.rope_head_dim // 2})"
            )

    def _check_architecture(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture ({self.architecture!r}) is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.architecture == "deepseek_v3" and self.mla is None:
            raise ValueError(
                "mla (None) must be set for architecture 'deepseek_v3' (multi-head latent attention)"
            )
        for name, rule in _ARCH_RULES[self.architecture].items():
            if name.startswith("moe.") and self.moe is None:
                continue
            expected = getattr(self, rule.name) if isinstance(rule, _Follows) else rule
            if field_value(self, name) != expected:
                because = f" (it follows {rule.name})" if isinstance(rule, _Follows) else ""
                raise ValueError(
                    f"{name} ({field_value(self, name)}) must be {expected} for architecture {self.architecture!r}"
                    f"{because}"
                )

    # ---------------------------------------------------------------- derived

    @property
    def rope_head_dim(self) -> int:
        """Size of the rotary part of a query/key head (all of it, except with ``mla``)."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def mrope_section(self) -> list[int] | None:
        """Rotary frequencies per position axis of multimodal RoPE; ``None`` for 1-D RoPE."""
        return (self.rope_scaling or {}).get("mrope_section")

    @property
    def mrope_interleaved(self) -> bool:
        """Multimodal RoPE in the interleaved layout (Qwen3-VL) rather than in chunks (Qwen2.5-VL)."""
        return bool((self.rope_scaling or {}).get("mrope_interleaved", False))

    @property
    def v_head_dim(self) -> int:
        """Size of one value head."""
        return self.head_dim if self.mla is None else self.mla.v_head_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (from 0) holds experts rather than a dense MLP."""
        return self.moe is not None and self.moe.is_moe_layer(index)

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers that hold experts."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    # ---------------------------------------------------------------- sizes and FLOPs

    def num_parameters(self, non_embedding: bool = False, *, active: bool = False) -> int:
        """Parameter count of the model this config builds (tied weights counted once).

        Args:
            non_embedding: leave out the input embedding table and the output head (tied or not).
            active: count only the parameters one token uses: of each MoE layer's routed experts, the
                ``num_experts_per_tok`` it is sent to (the router and shared experts are always used).
        """
        H, V = self.hidden_size, self.vocab_size
        dense_mlp = 3 * H * self.intermediate_size + (2 * self.intermediate_size + H) * self.mlp_bias
        num_moe = self.num_moe_layers
        moe_mlp = num_moe * self._moe_parameters(active) if num_moe else 0
        mlp = (self.num_layers - num_moe) * dense_mlp + moe_mlp
        body = self.num_layers * (self._attention_parameters() + 2 * H) + mlp + H
        if non_embedding:
            return body
        return body + V * H * (1 if self.tie_word_embeddings else 2)

    def _attention_parameters(self) -> int:
        H, D, heads = self.hidden_size, self.head_dim, self.num_heads
        if self.mla is not None:
            m = self.mla
            q = (
                H * heads * D
                if m.q_lora_rank is None
                else (H + 1 + self.attention_bias + heads * D) * m.q_lora_rank
            )
            kv_a = (H + self.attention_bias) * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv_a + kv_b + heads * m.v_head_dim * H + H * self.o_proj_bias
        q_out, kv_out = heads * D, self.num_kv_heads * D
        attn = H * (q_out + 2 * kv_out) + q_out * H
        return attn + (q_out + 2 * kv_out) * self.attention_bias + H * self.o_proj_bias + 2 * D * self.qk_norm

    def _moe_parameters(self, active: bool) -> int:
        H, m = self.hidden_size, self.moe
        experts = m.num_experts_per_tok if active else m.num_experts
        shared = 3 * H * m.shared_intermediate_size + H * m.shared_expert_gate
        return H * m.num_experts + experts * 3 * H * m.intermediate_size + shared

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
        if arch in ("qwen2", "qwen2_5_vl_text"):
            attention_bias = True
        elif arch == "qwen2_moe":  # configs written before transformers 5 have no qkv_bias: always biased
            attention_bias = bool(hf.get("qkv_bias", True))
        else:
            attention_bias = bool(hf.get("attention_bias", False))
        mla = _mla_from_hf(hf) if arch == "deepseek_v3" else None
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            # MLA's head sizes come from `mla` (transformers' DeepSeek `head_dim` is the rotary size).
            num_kv_heads=None if mla else hf.get("num_key_value_heads"),
            # Qwen2.5-VL's attention derives head_dim from hidden_size whatever the config says.
            head_dim=None
            if mla or arch == "qwen2_5_vl_text"
            else hf.get("head_dim", _DEFAULT_HEAD_DIM.get(arch)),
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=attention_bias,
            o_proj_bias=attention_bias if arch in _O_PROJ_FOLLOWS_BIAS else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if arch == "llama" else False,
            qk_norm=arch in ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=hf.get("initializer_range", 0.02),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            architecture=arch,
            torch_dtype=hf.get("dtype", hf.get("torch_dtype")),
            moe=_moe_from_hf(hf, arch),
            mla=mla,
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
        if self.architecture in _O_PROJ_FOLLOWS_BIAS:
            hf["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.architecture in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen2_5_vl_text"):
            hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        if self.architecture == "mistral":
            hf["sliding_window"] = None
        if self.architecture in _MOE_ARCHITECTURES:
            hf.update(_moe_to_hf(self))
        if self.mla is not None:
            hf.update(_mla_to_hf(self))
        if self.num_nextn_predict_layers:
            hf["num_nextn_predict_layers"] = self.num_nextn_predict_layers
        return hf


_O_PROJ_FOLLOWS_BIAS = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "qwen3_vl_text", "qwen3_vl_moe_text")
_DEFAULT_HEAD_DIM = {"qwen3": 128, "qwen3_vl_text": 128}  # transformers' config defaults
_MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen3_vl_moe_text")

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


def _sub_config(cls: type, value: Any) -> Any:
    """A fresh ``cls`` from a dict or an instance (``None`` stays ``None``)."""
    if value is None:
        return None
    return cls(**(value if isinstance(value, Mapping) else dataclasses.asdict(value)))


def field_value(config: Any, name: str) -> Any:
    """The value of field ``name`` of ``config``; dotted names reach into sub-configs (``"moe.num_experts"``),
    ``None`` where a sub-config is ``None``."""
    for part in name.split("."):
        if config is None:
            return None
        config = getattr(config, part)
    return config


def _moe_from_hf(hf: Mapping[str, Any], arch: str) -> MoEConfig | None:
    """The ``moe`` sub-config of a Qwen2-MoE / Qwen3-MoE / DeepSeek-V3 / Qwen3-VL-MoE config (``None`` for other
    families)."""
    if arch not in _MOE_ARCHITECTURES:
        return None
    # transformers writes `num_experts` of Qwen3-MoE as `num_local_experts` and DeepSeek's as `n_routed_experts`.
    num_experts = hf.get("num_experts", hf.get("num_local_experts", hf.get("n_routed_experts")))
    if not num_experts:
        return None
    common = dict(
        num_experts=num_experts,
        num_experts_per_tok=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        z_loss_coef=hf.get("router_z_loss_coef", 0.0),
    )
    if arch == "deepseek_v3":
        common["bias_update_rate"] = float(hf.get("router_bias_update_rate", 0.0))
        for key, supported in (
            ("scoring_func", "sigmoid"),
            ("topk_method", "noaux_tc"),
            ("moe_layer_freq", 1),
        ):
            if hf.get(key, supported) != supported:
                raise ValueError(
                    f"{key} ({hf[key]!r}) is not supported for deepseek_v3; only {supported!r} is"
                )
        return MoEConfig(
            **common,
            score_func="sigmoid",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            num_groups=hf.get("n_group") or 1,
            num_groups_per_tok=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
            shared_intermediate_size=hf["moe_intermediate_size"] * hf.get("n_shared_experts", 1),
            first_dense_layers=hf.get("first_k_dense_replace", 0),
            # DeepSeek-V3 balances its experts with the selection bias (aux-loss-free), so no default weight.
            aux_loss_coef=hf.get("router_aux_loss_coef", 0.0),
        )
    return MoEConfig(
        **common,
        norm_topk_prob=arch == "qwen3_vl_moe_text" or bool(hf.get("norm_topk_prob", False)),
        shared_intermediate_size=hf.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0,
        shared_expert_gate=arch == "qwen2_moe",
        layer_step=hf.get("decoder_sparse_step", 1),
        dense_layers=list(hf.get("mlp_only_layers") or []),
        aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
    )


def _moe_to_hf(config: LLMConfig) -> dict[str, Any]:
    """The MoE keys of a ``config.json`` (``num_experts`` 0 for an all-dense model of a MoE family)."""
    m = config.moe
    if m is None:
        if config.architecture == "deepseek_v3":
            return {"n_routed_experts": 0, "first_k_dense_replace": config.num_layers}
        return {"num_experts": 0}
    hf: dict[str, Any] = {
        "num_experts_per_tok": m.num_experts_per_tok,
        "moe_intermediate_size": m.intermediate_size,
        "router_aux_loss_coef": m.aux_loss_coef,
        "output_router_logits": False,
    }
    if config.architecture != "qwen3_vl_moe_text":  # which always normalises, and has no such key
        hf["norm_topk_prob"] = m.norm_topk_prob
    if m.z_loss_coef:
        hf["router_z_loss_coef"] = m.z_loss_coef
    if m.bias_update_rate:
        hf["router_bias_update_rate"] = m.bias_update_rate
    if config.architecture != "deepseek_v3":
        hf.update(
            num_experts=m.num_experts, decoder_sparse_step=m.layer_step, mlp_only_layers=list(m.dense_layers)
        )
        if config.architecture == "qwen2_moe":
            hf.update(
                shared_expert_intermediate_size=m.shared_intermediate_size, qkv_bias=config.attention_bias
            )
        return hf
    if m.shared_intermediate_size % m.intermediate_size:
        raise ValueError(
            f"moe.shared_intermediate_size ({m.shared_intermediate_size}) must be a multiple of "
            f"moe.intermediate_size ({m.intermediate_size}) to export as deepseek_v3 (n_shared_experts)"
        )
    hf.update(
        n_routed_experts=m.num_experts,
        n_shared_experts=m.shared_intermediate_size // m.intermediate_size,
        n_group=m.num_groups,
        topk_group=m.num_groups_per_tok,
        routed_scaling_factor=m.routed_scaling_factor,
        first_k_dense_replace=m.first_dense_layers,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )
    return hf


def _mla_from_hf(hf: Mapping[str, Any]) -> MLAConfig:
    return MLAConfig(
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        q_lora_rank=hf.get("q_lora_rank"),
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def _mla_to_hf(config: LLMConfig) -> dict[str, Any]:
    m = config.mla
    return {
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rope_interleave": m.rope_interleave,
        "head_dim": m.qk_rope_head_dim,  # transformers' meaning: the rotary size
        "num_key_value_heads": config.num_heads,
        # The model has no multi-token-prediction layers (their checkpoint weights are skipped on load).
        "num_nextn_predict_layers": 0,
    }


def _normalise_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Validate rope scaling; return a fresh dict keyed by ``rope_type`` (``None`` for plain RoPE)."""
    if scaling is None:
        return None
    params = dict(scaling)
    mrope = _normalise_mrope({k: params.pop(k) for k in MROPE_KEYS if k in params})
    rope_type = params.pop("rope_type", None) or params.pop("type", "default")
    params.pop("type", None)
    if rope_type == "mrope":  # Qwen2-VL's legacy name of default frequencies with mrope_section
        rope_type = "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type ({rope_type!r}) is not supported; supported rope types: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return {"rope_type": rope_type, **mrope} if mrope else None
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
    return {"rope_type": rope_type, **params, **mrope}


def _normalise_mrope(mrope: dict[str, Any]) -> dict[str, Any]:
    """``{"mrope_section": [...]}`` plus ``"mrope_interleaved": True`` when set (empty without a section)."""
    if not mrope:
        return {}
    if "mrope_section" not in mrope:
        raise ValueError(
            f"rope_scaling mrope_interleaved ({mrope['mrope_interleaved']}) needs an mrope_section"
        )
    section = mrope["mrope_section"]
    if (
        not isinstance(section, Sequence)
        or not section
        or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in section)
    ):
        raise ValueError(f"rope_scaling mrope_section ({section!r}) must be a list of positive integers")
    interleaved = mrope.get("mrope_interleaved", False)
    if not isinstance(interleaved, bool):
        raise ValueError(f"rope_scaling mrope_interleaved ({interleaved!r}) must be a boolean")
    return {"mrope_section": list(section), **({"mrope_interleaved": True} if interleaved else {})}


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
    if hf.get("model_type") in _DEFAULT_MROPE_SECTION:
        params.setdefault("mrope_section", _DEFAULT_MROPE_SECTION[hf["model_type"]])
    # transformers' Qwen3-VL (-MoE) interleaves whatever the key says.
    if hf.get("model_type") in ("qwen3_vl_text", "qwen3_vl_moe_text"):
        params.setdefault("mrope_interleaved", True)
    return theta, (params if rope_type != "default" or MROPE_KEYS & set(params) else None)


def _check_full_attention(hf: Mapping[str, Any], arch: str) -> None:
    """Refuse a config whose attention needs a sliding window shorter than the supported context."""
    window, max_pos = hf.get("sliding_window"), hf["max_position_embeddings"]
    if (
        arch not in ("mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen2_5_vl_text")
        or window is None
        or window >= max_pos
    ):
        return
    if arch == "mistral":
        slides = True
    elif hf.get("layer_types") is not None:
        slides = "sliding_attention" in hf["layer_types"]
    elif arch in ("qwen2_moe", "qwen3_moe"):
        slides = bool(hf.get("use_sliding_window"))
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
    ``hidden_size`` except for models such as Qwen3 whose heads are wider. With multi-head latent attention the
    query/key and value heads differ in size, so ``d_attn = num_heads * (head_dim + v_head_dim) / 2``.

    Args:
        config: the model's configuration.
        doc_lengths: token counts of the documents in the sequence (one entry for an unpacked sequence).
    """
    total = sum(doc_lengths)
    if total <= 0:
        raise ValueError(f"doc_lengths ({list(doc_lengths)}) must contain at least one token")
    two_d_attn = config.num_heads * (config.head_dim + config.v_head_dim)
    return 6 * config.num_layers * two_d_attn * sum(n * n for n in doc_lengths) / total


def llm_flops_per_token(config: LLMConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N + 12 * num_layers * d_attn * seq_len`` (Kaplan et al. 2020; PaLM).

    ``N`` is every non-embedding parameter a token uses plus the output head matmul (``vocab_size *
    hidden_size``), which is computed even when the head is tied to the embedding. For mixture-of-experts models
    ``N`` counts the active parameters: the ``num_experts_per_tok`` routed experts, the shared experts and the
    router (see :meth:`LLMConfig.num_parameters`). See :func:`attention_flops_per_token` for ``d_attn`` and for
    packed sequences.

    Args:
        config: the model's configuration.
        seq_len: tokens per (unpacked) sequence.
    """
    n = config.num_parameters(non_embedding=True, active=True) + config.vocab_size * config.hidden_size
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
    # Tiny Qwen3-MoE-style model for tests: 8 experts, top-2, in both layers.
    "debug-moe": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        qk_norm=True,
        architecture="qwen3_moe",
        moe=dict(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            norm_topk_prob=True,
            aux_loss_coef=0.001,
        ),
    ),
    # Tiny DeepSeek-V3-style model for tests: MLA, a dense first layer, then 8 experts in 2 groups + a shared one
    # (top-2 from the best group: as DeepSeek-V3's 8 from 4 groups, 2 per chosen group, which MegatronStrategy needs).
    "debug-deepseek": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        max_position_embeddings=256,
        architecture="deepseek_v3",
        mla=dict(kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=dict(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            score_func="sigmoid",
            norm_topk_prob=True,
            num_groups=2,
            num_groups_per_tok=1,
            routed_scaling_factor=2.5,
            shared_intermediate_size=32,
            first_dense_layers=1,
        ),
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
    # https://huggingface.co/Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token.
    "qwen3-30b-a3b": dict(
        **{**_QWEN3_COMMON, "architecture": "qwen3_moe"},
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        tie_word_embeddings=False,
        moe=dict(
            num_experts=128,
            num_experts_per_tok=8,
            intermediate_size=768,
            norm_topk_prob=True,
            aux_loss_coef=0.001,
        ),
    ),
    # https://huggingface.co/deepseek-ai/DeepSeek-V3: 671B parameters, 37B active per token (the checkpoint's
    # multi-token-prediction layer is not part of the model). The published config extends the context to 160K
    # tokens with YaRN, a rope type not implemented here: this is the 4K-context configuration before extension.
    "deepseek-v3": dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=61,
        num_heads=128,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        architecture="deepseek_v3",
        torch_dtype="bfloat16",
        mla=dict(
            kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
        moe=dict(
            num_experts=256,
            num_experts_per_tok=8,
            intermediate_size=2048,
            score_func="sigmoid",
            norm_topk_prob=True,
            num_groups=8,
            num_groups_per_tok=4,
            routed_scaling_factor=2.5,
            shared_intermediate_size=2048,
            first_dense_layers=3,
        ),
    ),
}
"""Named configurations as :class:`LLMConfig` keyword arguments; build one with :meth:`LLMConfig.from_preset`."""

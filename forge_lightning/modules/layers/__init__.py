"""Shared building blocks: attention (with its KV cache), rotary embeddings, norms and feed-forward layers."""

from forge_lightning.modules.layers.attention import (
    ATTENTION_BACKENDS,
    Attention,
    DocumentMask,
    KVCache,
    attention,
)
from forge_lightning.modules.layers.mlp import GatedMLP, init_linear
from forge_lightning.modules.layers.norms import RMSNorm
from forge_lightning.modules.layers.rope import ROPE_TYPES, RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = [
    "ATTENTION_BACKENDS",
    "ROPE_TYPES",
    "Attention",
    "DocumentMask",
    "GatedMLP",
    "KVCache",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "attention",
    "init_linear",
    "rope_inv_freq",
]

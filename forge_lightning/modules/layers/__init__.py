"""Shared building blocks: attention (with its KV cache), multi-head latent attention, rotary embeddings, norms,
feed-forward layers, mixture-of-experts blocks, activations by their Hugging Face name and the strict weight
loader."""

from forge_lightning.modules.layers.activations import ACTIVATIONS, activation
from forge_lightning.modules.layers.attention import (
    ATTENTION_BACKENDS,
    Attention,
    DocumentMask,
    KVCache,
    attention,
)
from forge_lightning.modules.layers.init import OWNED_LAYERS, reset_owned_parameters
from forge_lightning.modules.layers.mla import LatentKVCache, MultiLatentAttention
from forge_lightning.modules.layers.mlp import GatedMLP, init_linear
from forge_lightning.modules.layers.moe import (
    Experts,
    GatedSharedExpertMoE,
    GroupLimitedRouter,
    MoEBlock,
    RouterLosses,
    RouterStats,
    SharedExpertsMoE,
    TopKRouter,
    router_losses,
)
from forge_lightning.modules.layers.norms import RMSNorm
from forge_lightning.modules.layers.rope import (
    MROPE_KEYS,
    ROPE_TYPES,
    AxialRotaryEmbedding,
    MultimodalRotaryEmbedding,
    RotaryEmbedding,
    apply_rotary,
    mrope_axis_of_freq,
    rope_inv_freq,
)
from forge_lightning.modules.layers.state_dict import load_exact

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_BACKENDS",
    "MROPE_KEYS",
    "ROPE_TYPES",
    "Attention",
    "AxialRotaryEmbedding",
    "DocumentMask",
    "Experts",
    "GatedMLP",
    "GatedSharedExpertMoE",
    "GroupLimitedRouter",
    "KVCache",
    "LatentKVCache",
    "MoEBlock",
    "MultiLatentAttention",
    "OWNED_LAYERS",
    "MultimodalRotaryEmbedding",
    "RMSNorm",
    "RotaryEmbedding",
    "RouterLosses",
    "RouterStats",
    "SharedExpertsMoE",
    "TopKRouter",
    "activation",
    "apply_rotary",
    "attention",
    "init_linear",
    "load_exact",
    "mrope_axis_of_freq",
    "reset_owned_parameters",
    "rope_inv_freq",
    "router_losses",
]

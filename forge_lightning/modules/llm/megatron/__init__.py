"""The decoder LM's megatron-core twin, for ``MegatronStrategy`` (through ``CausalLM.megatron_model``).

One package, one job per file; megatron-core is imported only by the files that build or run the twin::

    twin.py                DecoderTwin: the strategy's MegatronTwin contract (build, step, export, checks)
    tf_config.py           LLMConfig -> megatron's TransformerConfig; architectures it cannot express
    gpt.py                 the GPTModel chunk with the native RoPE positions and LMLoss
    layer_spec.py          the decoder layer: megatron's parallel linears / MoE, forge's norms, SDPA attention
    weights.py             the rules between Hugging Face tensors and the twin's parameters (any TP / EP rank)
    bridge.py              each rank reads its shards from safetensors; export gathers them to rank 0
    steps.py               the forward step of one micro-batch (plain, packed, composed)
    metrics.py             MoE router losses and expert load of a step

Public names are imported lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DecoderTwin": "twin",
    "check_layout": "twin",
    "check_ulysses_heads": "twin",
    "check_experts": "twin",
    "transformer_config": "tf_config",
    "check_supported": "tf_config",
    "build_gpt_model": "gpt",
    "unwrap": "gpt",
    "named_tensors": "gpt",
    "weight_rules": "weights",
    "check_all_filled": "weights",
    "load_hf_weights": "weights",
    "load_hf_checkpoint": "bridge",
    "load_state": "bridge",
    "export_hf_state": "bridge",
    "gpt_decoder_spec": "layer_spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

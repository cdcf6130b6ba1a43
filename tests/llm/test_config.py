"""LLMConfig: validation, presets, Hugging Face config.json mapping, FLOPs, and building the model from it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from forge_lightning.modules.layers import rope_inv_freq
from forge_lightning.modules.llm import (
    PRESETS,
    DecoderLM,
    LLMConfig,
    attention_flops_per_token,
    llm_flops_per_token,
)

# Published parameter totals of the models behind the presets (tied matrices counted once).
PUBLISHED_PARAMETERS = {
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
}

# config.json of meta-llama/Llama-3.2-1B (classic rope_theta + rope_scaling style).
LLAMA32_1B_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

# config.json of Qwen/Qwen2.5-0.5B: a sliding window is named but disabled (use_sliding_window false).
QWEN25_05B_JSON = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

TINY_HF = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=4096,
)


# ------------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_builds_on_meta_with_the_counted_parameters(name: str) -> None:
    config = LLMConfig.from_preset(name)
    with torch.device("meta"):
        model = DecoderLM(config)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied matrix once
    assert config.num_parameters() == total
    embedding = config.vocab_size * config.hidden_size
    head = 0 if config.tie_word_embeddings else embedding
    assert config.num_parameters(non_embedding=True) == total - embedding - head
    if name in PUBLISHED_PARAMETERS:
        assert total == PUBLISHED_PARAMETERS[name]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_round_trips_through_hf_config(name: str) -> None:
    config = LLMConfig.from_preset(name)
    hf_dict = config.to_hf()
    assert LLMConfig.from_hf(hf_dict) == config
    model_type = hf_dict["model_type"]
    hf_config = transformers.AutoConfig.for_model(
        model_type, **{k: v for k, v in hf_dict.items() if k != "model_type"}
    )
    assert hf_config.model_type == model_type
    assert LLMConfig.from_hf(hf_config.to_dict()) == config


def test_quickstart_is_a_small_tied_llama() -> None:
    config = LLMConfig.from_preset("quickstart")
    assert 3e6 <= config.num_parameters() <= 6e6
    assert (config.architecture, config.tie_word_embeddings, config.num_kv_heads) == ("llama", True, 2)


def test_real_hf_configs_give_the_presets() -> None:
    assert LLMConfig.from_hf(LLAMA32_1B_JSON) == LLMConfig.from_preset("llama3.2-1b")
    assert LLMConfig.from_hf(QWEN25_05B_JSON) == LLMConfig.from_preset("qwen2.5-0.5b")


def test_llama2_config_uses_classic_defaults() -> None:
    # config.json of meta-llama/Llama-2-7b-hf: no rope_theta, no head_dim, no rope_scaling.
    llama2 = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "use_cache": True,
        "vocab_size": 32000,
    }
    config = LLMConfig.from_hf(llama2)
    assert (config.rope_theta, config.rope_scaling, config.head_dim) == (10000.0, None, 128)
    assert config.num_parameters() == 6_738_415_616


def test_classic_and_transformers5_rope_styles_agree() -> None:
    classic = dict(LLAMA32_1B_JSON)
    modern = {k: v for k, v in classic.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    modern["rope_parameters"] = {**classic["rope_scaling"], "rope_theta": classic["rope_theta"]}
    modern["dtype"] = "bfloat16"
    assert LLMConfig.from_hf(modern) == LLMConfig.from_hf(classic)
    legacy_key = {**classic, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert LLMConfig.from_hf(legacy_key).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    default = {
        **TINY_HF,
        "model_type": "llama",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    assert (LLMConfig.from_hf(default).rope_theta, LLMConfig.from_hf(default).rope_scaling) == (1e6, None)


def test_llama3_frequencies_match_transformers() -> None:
    hf_config = transformers.LlamaConfig(**LLAMA32_1B_JSON)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    config = LLMConfig.from_preset("llama3.2-1b")
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    torch.testing.assert_close(ours, rotary.inv_freq, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------- load


def test_load_accepts_dict_file_directory_preset_and_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B_JSON))
    expected = LLMConfig.from_preset("qwen2.5-0.5b")
    assert LLMConfig.load(QWEN25_05B_JSON) == expected
    assert LLMConfig.load(tmp_path / "config.json") == expected
    assert LLMConfig.load(str(tmp_path)) == expected
    assert LLMConfig.load("qwen2.5-0.5b") == expected
    copy = LLMConfig.load(expected)
    assert copy == expected and copy is not expected
    with pytest.raises(FileNotFoundError, match=r"neither a preset \(debug, quickstart"):
        LLMConfig.load("llama-9000")


def test_presets_are_not_mutated_through_copies() -> None:
    config = LLMConfig.from_preset("llama3.1-8b", num_layers=2)
    config.rope_scaling["factor"] = 1.0
    assert PRESETS["llama3.1-8b"]["rope_scaling"]["factor"] == 8.0
    assert LLMConfig.from_preset("llama3.1-8b").num_layers == 32


def test_preset_overrides_rederive_head_dim_and_kv_heads() -> None:
    config = LLMConfig.from_preset("debug", hidden_size=128, num_heads=8, num_kv_heads=None)
    assert (config.head_dim, config.num_kv_heads) == (16, 8)


# ------------------------------------------------------------------------------------------- errors


def test_config_is_keyword_only_and_derives_heads() -> None:
    with pytest.raises(TypeError):
        LLMConfig(256, 64, 128, 2, 4)  # type: ignore[misc]
    config = LLMConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)
    assert (config.num_kv_heads, config.head_dim) == (4, 16)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_heads=8, num_kv_heads=3), r"num_kv_heads \(3\) must divide num_heads \(8\)"),
        (dict(num_layers=0), r"num_layers \(0\) must be a positive integer"),
        (
            dict(hidden_size=60, num_heads=8, num_kv_heads=8),
            r"hidden_size \(60\) must be divisible by num_heads \(8\)",
        ),
        (dict(head_dim=15), r"head_dim \(15\) must be even"),
        (dict(rope_theta=0.0), r"rope_theta \(0.0\) must be positive"),
        (
            dict(architecture="gpt2"),
            r"architecture \('gpt2'\) is not supported; supported: llama, mistral, qwen2",
        ),
        (dict(architecture="qwen2"), r"attention_bias \(False\) must be True for architecture 'qwen2'"),
        (
            dict(attention_bias=True),
            r"o_proj_bias \(False\) must be True for architecture 'llama' \(it follows",
        ),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            r"rope_type \('yarn'\) is not supported; .*",
        ),
        (dict(rope_scaling={"rope_type": "linear"}), r"takes exactly \['factor'\], got \[\]"),
        (dict(torch_dtype="float8"), r"torch_dtype \('float8'\) must be one of"),
    ],
)
def test_invalid_config_names_field_and_value(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLMConfig.from_preset("debug", **overrides)


def test_unsupported_architecture_lists_supported_ones() -> None:
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 768}
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*supported: llama, mistral, qwen2, qwen3"):
        LLMConfig.from_hf(gpt2)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type_lists_supported_ones(rope_type: str) -> None:
    hf = {**TINY_HF, "model_type": "llama", "rope_scaling": {"rope_type": rope_type, "factor": 4.0}}
    with pytest.raises(
        ValueError, match=rf"rope_type \('{rope_type}'\) .*supported rope types: default, linear, llama3"
    ):
        LLMConfig.from_hf(hf)


@pytest.mark.parametrize(
    "hf",
    [
        {**TINY_HF, "model_type": "mistral", "sliding_window": 1024},
        {
            **TINY_HF,
            "model_type": "qwen2",
            "sliding_window": 1024,
            "use_sliding_window": True,
            "max_window_layers": 1,
        },
        {
            **TINY_HF,
            "model_type": "qwen3",
            "sliding_window": 1024,
            "layer_types": ["full_attention", "sliding_attention"],
        },
    ],
    ids=["mistral", "qwen2-use-sliding-window", "qwen3-layer-types"],
)
def test_required_sliding_window_is_refused(hf: dict) -> None:
    with pytest.raises(
        ValueError, match=r"requires sliding-window attention \(sliding_window=1024 < max_position"
    ):
        LLMConfig.from_hf(hf)


@pytest.mark.parametrize(
    "hf",
    [
        {**TINY_HF, "model_type": "mistral", "sliding_window": None},
        {**TINY_HF, "model_type": "mistral", "sliding_window": 4096},  # covers the whole context
        {**TINY_HF, "model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": False},
    ],
    ids=["null", "whole-context", "disabled"],
)
def test_full_attention_configs_are_accepted(hf: dict) -> None:
    assert LLMConfig.from_hf(hf).architecture == hf["model_type"]


def test_other_unsupported_hf_features_are_refused() -> None:
    with pytest.raises(ValueError, match=r"hidden_act \('gelu'\) is not supported"):
        LLMConfig.from_hf({**TINY_HF, "model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"partial_rotary_factor \(0.5\) is not supported"):
        LLMConfig.from_hf({**TINY_HF, "model_type": "llama", "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="lacks required fields: hidden_size"):
        LLMConfig.from_hf({k: v for k, v in TINY_HF.items() if k != "hidden_size"} | {"model_type": "llama"})


# ------------------------------------------------------------------------------------------- FLOPs


def test_flops_per_token_counts_the_head_matmul_even_when_tied() -> None:
    config = LLMConfig.from_preset("quickstart")  # tied
    L, H, V, S = config.num_layers, config.hidden_size, config.vocab_size, 512
    per_layer = (
        2 * H * H + 2 * H * (H // 2) + 3 * H * config.intermediate_size + 2 * H
    )  # q,o + k,v + mlp + norms
    non_embedding = L * per_layer + H
    assert config.num_parameters(non_embedding=True) == non_embedding
    expected = 6 * (non_embedding + V * H) + 12 * L * H * S
    assert llm_flops_per_token(config, S) == config.flops_per_token(S) == expected
    untied = dataclasses.replace(config, tie_word_embeddings=False)
    assert llm_flops_per_token(untied, S) == expected


def test_packed_attention_flops_use_squared_document_lengths() -> None:
    config = LLMConfig.from_preset("debug")
    coeff = 12 * config.num_layers * config.hidden_size
    assert attention_flops_per_token(config, [1024]) == coeff * 1024
    assert attention_flops_per_token(config, [256, 768]) == coeff * (256**2 + 768**2) / 1024
    assert attention_flops_per_token(config, [256] * 4) == attention_flops_per_token(config, [256])
    qwen3 = LLMConfig.from_preset("qwen3-0.6b")  # heads are wider than the model: 16 x 128 > 1024
    assert attention_flops_per_token(qwen3, [100]) == 12 * 28 * 16 * 128 * 100
    with pytest.raises(ValueError, match="at least one token"):
        attention_flops_per_token(config, [])


# ------------------------------------------------------------------------------------------- building


def test_meta_model_materialises_with_the_configured_init() -> None:
    config = LLMConfig.from_preset(
        "debug", tie_word_embeddings=True, initializer_range=0.05, attention_bias=True, o_proj_bias=True
    )
    with torch.device("meta"):
        model = DecoderLM(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    layer = model.model.layers[0]
    for weight in (
        model.model.embed_tokens.weight,
        layer.self_attn.q_proj.weight,
        layer.mlp.down_proj.weight,
    ):
        assert abs(weight.std().item() - 0.05) < 0.005
    assert torch.all(layer.self_attn.q_proj.bias == 0) and torch.all(layer.self_attn.o_proj.bias == 0)
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(model.model.norm.weight == 1)
    torch.testing.assert_close(
        model.model.rotary_emb.inv_freq, rope_inv_freq(config.head_dim, config.rope_theta)
    )
    assert not any("inv_freq" in key for key in model.state_dict())


def test_low_precision_cast_keeps_rope_frequencies_in_fp32() -> None:
    model = DecoderLM(LLMConfig.from_preset("debug")).to(torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    torch.testing.assert_close(inv_freq, rope_inv_freq(16, 10000.0), rtol=0, atol=0)
    logits = model(torch.randint(0, 256, (1, 8)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()

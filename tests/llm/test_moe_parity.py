"""Mixture-of-experts and multi-head latent attention: parity with transformers' Qwen2-MoE, Qwen3-MoE and DeepSeek-V3
on tiny random models (fp32, CPU), checkpoint interchange, router losses, configs and a short training run."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from lightning.pytorch import Callback, Trainer
from llm_parity import assert_matches_transformers, load_forge, randomize_weights, shifted_ce
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from forge_lightning.modules.layers.moe import grouped_linear
from forge_lightning.modules.llm import (
    PRESETS,
    DecoderLM,
    LLMConfig,
    block_tp_plan,
    check_compatible,
    fuse_experts,
    llm_flops_per_token,
    load_pretrained,
    save_pretrained,
    split_experts,
)
from forge_lightning.modules.llm.module import CausalLM

VOCAB = 128
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)
_DEEPSEEK = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
)

VARIANTS = {
    # Layer 1 dense (mlp_only_layers), renormalised top-k.
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # q/k/v biases, a sigmoid-gated shared expert, top-k without renormalisation.
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=3,
            shared_expert_intermediate_size=24,
            tie_word_embeddings=True,
        ),
    ),
    # Query latent, interleaved rope, a dense first layer, 8 experts in 4 groups of which a token may use 2.
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(
            **_DEEPSEEK,
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=16,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
        ),
    ),
    # Queries projected directly, rope in halves, biases, no groups, two shared experts, unnormalised weights.
    "deepseek_v3-plain": (
        transformers.DeepseekV3Config,
        dict(
            **_DEEPSEEK,
            num_hidden_layers=2,
            num_key_value_heads=4,
            q_lora_rank=None,
            rope_interleave=False,
            attention_bias=True,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            norm_topk_prob=False,
            first_k_dense_replace=0,
        ),
    ),
}


def build_hf(variant: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A transformers model with random weights, norms, biases and selection biases (so every tensor matters)."""
    config_cls, overrides = VARIANTS[variant]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**_BASE, **overrides), attn_implementation="eager"
    )
    randomize_weights(model, 0.1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    model = build_hf(request.param)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(path)
    return request.param, model, path


def input_batch(seq: int = 20) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------- parity


def test_logits_loss_and_gradients_match_transformers(hf_checkpoint: tuple) -> None:
    variant, hf_model, path = hf_checkpoint
    model = load_forge(path)
    hf_model.zero_grad()
    input_ids = input_batch()

    assert_matches_transformers(model, hf_model, input_ids, variant)


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen2_moe"])
def test_aux_loss_and_its_gradient_match_transformers(variant: str) -> None:
    hf_model = build_hf(variant)
    model = DecoderLM(LLMConfig.from_hf(hf_model.config.to_dict()))
    model.load_state_dict(hf_model.state_dict())
    input_ids = input_batch()
    coef = 0.5  # large, so that the router gradient depends visibly on the auxiliary loss

    out = hf_model(input_ids, labels=input_ids, output_router_logits=True)
    logits = model(input_ids)
    aux = model.router_losses().aux_loss
    assert abs(aux.item() - out.aux_loss.item()) <= 1e-6 * out.aux_loss.item()

    # transformers' loss with labels: mean next-token cross-entropy + router_aux_loss_coef * aux_loss.
    (out.loss - hf_model.router_aux_loss_coef * out.aux_loss + coef * out.aux_loss).backward()
    (shifted_ce(logits, input_ids) + coef * aux).backward()
    hf_grads = dict(hf_model.named_parameters())
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            hf_grad = hf_grads[name].grad
            assert ((param.grad - hf_grad).norm() / hf_grad.norm()).item() <= 1e-4, name


_ALIASES = {
    "num_local_experts": "num_experts"
}  # transformers writes Qwen3-MoE's expert count under both names
# Keys transformers writes that do not change the computed function: derived ones, the sliding-window layout of a
# model without sliding window, and DeepSeek's multi-token-prediction depth (the export has no such layers: 0).
_DERIVED = (
    "transformers_version",
    "layer_types",
    "max_window_layers",
    "sliding_window",
    "qk_head_dim",
    "pretraining_tp",
    "num_nextn_predict_layers",
)


def test_round_trip_keeps_every_tensor_and_the_architecture(hf_checkpoint: tuple, tmp_path: Path) -> None:
    variant, hf_model, path = hf_checkpoint
    model = load_forge(path)
    out = save_pretrained(model, model.config, tmp_path / "export")

    # Per-expert tensors on disk, as transformers and the published checkpoints store them.
    assert load_file(path / "model.safetensors").keys() == load_file(out / "model.safetensors").keys()
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    expected, actual = hf_model.state_dict(), reloaded.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name

    source, exported = (json.loads((p / "config.json").read_text()) for p in (path, out))
    assert LLMConfig.from_hf(exported) == LLMConfig.from_hf(source)
    differ = [k for k, v in source.items() if exported.get(_ALIASES.get(k, k)) != v and k not in _DERIVED]
    assert differ == [], f"{variant}: {[(k, source[k], exported.get(_ALIASES.get(k, k))) for k in differ]}"


@pytest.mark.parametrize("preset", ["debug-moe", "debug-deepseek"])
def test_exported_presets_run_in_transformers(preset: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = DecoderLM(LLMConfig.from_preset(preset))
    out = save_pretrained(model, model.config, tmp_path / "export")
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    input_ids = torch.randint(0, 256, (2, 16))
    assert (model(input_ids) - hf_model(input_ids).logits).abs().max().item() <= 1e-4


def test_fused_expert_checkpoints_load_too(tmp_path: Path) -> None:
    hf_model = build_hf("qwen3_moe")
    hf_model.save_pretrained(tmp_path, save_original_format=False)  # transformers 5's in-memory layout
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "model.safetensors")
    input_ids = input_batch()
    assert (load_forge(tmp_path)(input_ids) - hf_model(input_ids).logits).abs().max().item() <= 1e-4


def test_expert_layout_conversion_is_lossless_and_names_missing_experts() -> None:
    state = DecoderLM(LLMConfig.from_preset("debug-moe")).state_dict()
    split = split_experts(state)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in split and not any("gate_up" in k for k in split)
    fused = fuse_experts(split)
    assert fused.keys() == state.keys() and all(torch.equal(fused[k], v) for k, v in state.items())
    del split["model.layers.1.mlp.experts.3.down_proj.weight"]
    with pytest.raises(
        ValueError, match=r"lacks expert tensors:\n  model\.layers\.1\.mlp\.experts\.3\.down_proj"
    ):
        fuse_experts(split)


def test_extra_layers_are_skipped_and_quantized_checkpoints_refused(tmp_path: Path) -> None:
    hf_model = build_hf("deepseek_v3")
    hf_model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    mtp = {
        k.replace("layers.2.", "layers.3."): v.clone() for k, v in state.items() if ".layers.2." in k
    }  # MTP
    save_file({**state, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_forge(tmp_path)
    input_ids = input_batch()
    assert (model(input_ids) - hf_model(input_ids).logits).abs().max().item() <= 1e-4

    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized weights \(quant_method 'fp8'\); dequantize"):
        load_pretrained(model, tmp_path)


def test_checkpoint_with_other_experts_is_named() -> None:
    model_config = LLMConfig.from_preset("debug-moe")
    other = LLMConfig.from_preset("debug-moe", moe={**PRESETS["debug-moe"]["moe"], "num_experts": 4})
    with pytest.raises(ValueError, match=r"moe\.num_experts: checkpoint 4, model 8"):
        check_compatible(model_config, other)
    coef = LLMConfig.from_preset("debug-moe", moe={**PRESETS["debug-moe"]["moe"], "aux_loss_coef": 0.1})
    check_compatible(model_config, coef)  # training options may differ


# ------------------------------------------------------------------------------------------- layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_the_loop_over_experts(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])  # an expert without tokens too
    x = torch.randn(9, 16, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(4, 8, 16, generator=gen).to(dtype).requires_grad_()
    outs, grads = [], []
    for grouped in (True, False):
        y = grouped_linear(x, w, counts, use_grouped_mm=grouped)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append((x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("preset", ["debug-moe", "debug-deepseek"])
def test_kv_cache_decoding_matches_the_full_forward(preset: str) -> None:
    torch.manual_seed(0)
    model = DecoderLM(LLMConfig.from_preset(preset)).eval()
    input_ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        full = model(input_ids)
        cache = model.init_kv_cache(2, 12)
        steps = [model(input_ids[:, :8], kv_cache=cache)]
        steps += [model(input_ids[:, i : i + 1], kv_cache=cache) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", ["debug-moe", "debug-deepseek"])
def test_packed_documents_match_separate_forwards(preset: str) -> None:
    torch.manual_seed(0)
    model = DecoderLM(LLMConfig.from_preset(preset)).eval()
    lengths = [5, 11]
    docs = [torch.randint(0, 256, (1, n)) for n in lengths]
    document_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(torch.cat(docs, dim=1), document_ids=document_ids)
        for doc, chunk in zip(docs, packed.split(lengths, dim=1)):
            torch.testing.assert_close(chunk, model(doc), rtol=1e-4, atol=1e-4)


def test_model_with_router_statistics_can_be_copied() -> None:
    model = DecoderLM(LLMConfig.from_preset("debug-moe"))
    model(
        torch.randint(0, 256, (1, 8))
    ).sum().backward()  # the blocks now hold statistics with autograd graphs
    copied = copy.deepcopy(model)  # e.g. an EMA copy
    assert copied.moe_blocks()[0].stats is None and model.moe_blocks()[0].stats is not None


def test_selection_bias_stays_fp32_when_the_model_is_cast() -> None:
    model = DecoderLM(LLMConfig.from_preset("debug-deepseek"))
    router = model.model.layers[1].mlp.gate
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(0, 1e-3, 8))
    model.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.e_score_correction_bias.dtype == torch.float32
    torch.testing.assert_close(router.e_score_correction_bias, torch.linspace(0, 1e-3, 8), rtol=0, atol=0)
    assert torch.isfinite(model(torch.randint(0, 256, (1, 8)))).all()


def test_tensor_parallel_plan_names_only_existing_modules() -> None:
    dense = DecoderLM(LLMConfig.from_preset("debug"))
    assert block_tp_plan(list(dense.model.layers)) == {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
        "input_layernorm": "sequence",
        "post_attention_layernorm": "sequence",
    }
    # The whole plan: the blocks' entries and the modules around the layers; every name exists in the model.
    plan = dense.tp_plan()
    assert {k: v for k, v in plan.items() if k.startswith("<root>.")} == {
        "<root>.model.embed_tokens": "rowwise_embedding",
        "<root>.model.norm": "sequence",
        "<root>.lm_head": "colwise_output",
    }
    for name in plan:
        if name.startswith("<root>."):
            dense.get_submodule(name.removeprefix("<root>."))
    qwen2_moe = DecoderLM(LLMConfig.from_hf(build_hf("qwen2_moe").config.to_dict()))
    expected_mlp = {"mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"}
    for model, mlp in [
        (DecoderLM(LLMConfig.from_preset("debug-moe")), set()),  # routed experts stay replicated
        (qwen2_moe, expected_mlp),
        (DecoderLM(LLMConfig.from_preset("debug-deepseek")), set()),  # dense + MoE layers share no MLP module
    ]:
        layers = list(model.model.layers)
        plan = block_tp_plan(layers)
        assert {k for k in plan if k.startswith("mlp.")} == mlp
        for layer in layers:
            for name in plan:
                layer.get_submodule(name)  # raises if a block lacks the module
    assert not any(k.startswith("self_attn.") for k in block_tp_plan(layers))  # MLA stays replicated


# ------------------------------------------------------------------------------------------- configs

# config.json of Qwen/Qwen3-30B-A3B.
QWEN3_30B_A3B_JSON = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# config.json of deepseek-ai/DeepSeek-V3 (the FP8 checkpoint; auto_map left out).
DEEPSEEK_V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_published_configs_give_the_presets() -> None:
    assert LLMConfig.from_hf(QWEN3_30B_A3B_JSON) == LLMConfig.from_preset("qwen3-30b-a3b")
    with pytest.raises(ValueError, match=r"rope_type \('yarn'\) is not supported"):
        LLMConfig.from_hf(DEEPSEEK_V3_JSON)
    short_context = {k: v for k, v in DEEPSEEK_V3_JSON.items() if k != "rope_scaling"}
    short_context["max_position_embeddings"] = 4096
    assert LLMConfig.from_hf(short_context) == LLMConfig.from_preset("deepseek-v3")


@pytest.mark.parametrize("name", ["debug-moe", "debug-deepseek", "qwen3-30b-a3b", "deepseek-v3"])
def test_moe_presets_round_trip_through_transformers_configs(name: str) -> None:
    config = LLMConfig.from_preset(name)
    hf = config.to_hf()
    assert LLMConfig.from_hf(hf) == config
    hf_config = transformers.AutoConfig.for_model(
        hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"}
    )
    assert hf_config.model_type == hf["model_type"]
    assert LLMConfig.from_hf(hf_config.to_dict()) == config


def test_active_parameters_and_flops_of_the_real_sizes() -> None:
    qwen = LLMConfig.from_preset("qwen3-30b-a3b")
    assert 30.4e9 < qwen.num_parameters() < 30.6e9 and 3.3e9 < qwen.num_parameters(active=True) < 3.4e9
    deepseek = LLMConfig.from_preset("deepseek-v3")
    assert 670e9 < deepseek.num_parameters() < 672e9 and 37e9 < deepseek.num_parameters(active=True) < 38e9
    for config in (qwen, deepseek):
        active = (
            config.num_parameters(non_embedding=True, active=True) + config.vocab_size * config.hidden_size
        )
        attention = 6 * config.num_layers * config.num_heads * (config.head_dim + config.v_head_dim) * 4096
        assert llm_flops_per_token(config, 4096) == 6 * active + attention
    m = deepseek.mla  # MLA: q/k heads of 192 = 128 + 64, value heads of 128
    assert (deepseek.head_dim, deepseek.v_head_dim) == (m.qk_nope_head_dim + m.qk_rope_head_dim, 128)


def test_moe_layer_selection() -> None:
    config = LLMConfig.from_preset(
        "debug-moe", num_layers=6, moe={**PRESETS["debug-moe"]["moe"], "layer_step": 2, "dense_layers": [3]}
    )
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    deepseek = LLMConfig.from_preset("debug-deepseek")
    assert [deepseek.is_moe_layer(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize(
    ("preset", "moe", "message"),
    [
        (
            "debug-moe",
            dict(num_experts_per_tok=9),
            r"moe\.num_experts_per_tok \(9\) must not exceed moe\.num_experts",
        ),
        ("debug-moe", dict(score_func="relu"), r"moe\.score_func \('relu'\) must be one of softmax, sigmoid"),
        ("debug-moe", dict(num_groups=2), r"moe\.num_groups \(2\) > 1 needs moe\.score_func 'sigmoid'"),
        (
            "debug-moe",
            dict(shared_expert_gate=True),
            r"moe\.shared_expert_gate \(True\) needs a shared expert",
        ),
        (
            "debug-moe",
            dict(score_func="sigmoid"),
            r"moe\.score_func \(sigmoid\) must be softmax for .*'qwen3_moe'",
        ),
        ("debug-deepseek", dict(num_groups=3), r"moe\.num_groups \(3\) must divide moe\.num_experts \(8\)"),
        (
            "debug-deepseek",
            dict(num_groups_per_tok=5),
            r"moe\.num_groups_per_tok \(5\) must be in \[1, moe\.num_",
        ),
        (
            "debug-deepseek",
            dict(num_groups=4, num_groups_per_tok=1, num_experts_per_tok=3),
            r"exceeds the experts",
        ),
    ],
)
def test_invalid_moe_config_names_field_and_value(preset: str, moe: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLMConfig.from_preset(preset, moe={**PRESETS[preset]["moe"], **moe})


def test_invalid_mla_and_family_combinations_are_refused() -> None:
    mla = PRESETS["debug-deepseek"]["mla"]
    with pytest.raises(
        ValueError, match=r"head_dim \(16\) must equal mla\.qk_nope_head_dim \+ mla\.qk_rope_head_dim"
    ):
        LLMConfig.from_preset("debug-deepseek", head_dim=16)
    with pytest.raises(ValueError, match=r"mla\.qk_rope_head_dim \(7\) must be even"):
        LLMConfig.from_preset("debug-deepseek", mla={**mla, "qk_rope_head_dim": 7})
    with pytest.raises(ValueError, match=r"mla \(None\) must be set for architecture 'deepseek_v3'"):
        LLMConfig.from_preset("debug-deepseek", mla=None)
    with pytest.raises(ValueError, match=r"moe \(.*\) must be None for architecture 'llama'"):
        LLMConfig.from_preset("debug", moe=PRESETS["debug-moe"]["moe"])
    with pytest.raises(ValueError, match=r"scoring_func \('softmax'\) is not supported for deepseek_v3"):
        LLMConfig.from_hf({**DEEPSEEK_V3_JSON, "rope_scaling": None, "scoring_func": "softmax"})


# ------------------------------------------------------------------------------------------- training


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _quiet_trainer(**kwargs: object) -> Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar or summary."""
    return Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_debug_moe_trains_on_cpu_and_logs_router_metrics() -> None:
    torch.manual_seed(0)
    model = CausalLM.from_config("debug-moe", optimizer={"lr": 3e-3})
    input_ids = torch.randint(0, 256, (4, 32))
    labels = input_ids.roll(-1, dims=1)
    batch = {"input_ids": input_ids, "labels": labels, "step_tokens": torch.tensor(labels.numel())}
    record = _Record()
    trainer = _quiet_trainer(max_steps=8, callbacks=[record])
    trainer.fit(model, train_dataloaders=DataLoader([batch] * 8, batch_size=None))
    assert record.losses[-1] < record.losses[0] - 0.5, record.losses
    metrics = trainer.logged_metrics
    assert torch.isfinite(metrics["train/router_aux_loss"]) and metrics["train/router_aux_loss"] > 0
    assert metrics["moe/expert_load_max_over_mean"] >= 1


def test_selection_bias_moves_towards_balance_after_each_step() -> None:
    """``moe.bias_update_rate``: after an optimizer step over two micro-batches, each MoE layer's selection bias
    moved by ``rate * sign(mean load - load)``, the loads being the step's routed tokens per expert (both
    micro-batches, counted with the step's weights), and the option round-trips through ``config.json``."""
    rate = 0.05
    preset = PRESETS["debug-deepseek"]
    config = LLMConfig.from_preset("debug-deepseek", moe={**preset["moe"], "bias_update_rate": rate})
    assert LLMConfig.from_hf(config.to_hf()).moe.bias_update_rate == rate
    torch.manual_seed(0)
    model = CausalLM(config=config, optimizer={"lr": 1e-3})
    batches = []
    for seed in (1, 2):
        input_ids = torch.randint(
            0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed)
        )
        labels = input_ids.roll(-1, dims=1)
        batches.append(
            {"input_ids": input_ids, "labels": labels, "step_tokens": torch.tensor(2 * labels.numel())}
        )
    blocks = model.model.moe_blocks()
    assert blocks
    with torch.no_grad():
        load_LE = 0
        for batch in batches:
            model.model(batch["input_ids"])
            load_LE = load_LE + torch.stack([block.stats.tokens_per_expert for block in blocks])
    before = [block.gate.e_score_correction_bias.clone() for block in blocks]
    trainer = _quiet_trainer(max_steps=1, accumulate_grad_batches=2)
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None))
    expected_LE = torch.sign(load_LE.mean(dim=-1, keepdim=True) - load_LE) * rate
    assert (expected_LE != 0).any()
    for block, old, step in zip(blocks, before, expected_LE):
        assert block.gate.e_score_correction_bias.dtype == torch.float32
        torch.testing.assert_close(block.gate.e_score_correction_bias, old + step, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"moe.bias_update_rate \(0.01\) needs the selection bias"):
        LLMConfig.from_preset("debug-moe", moe={**PRESETS["debug-moe"]["moe"], "bias_update_rate": 0.01})


def test_a_step_the_guard_leaves_out_leaves_the_selection_bias_as_it_was() -> None:
    """A non-finite loss at step 1: the guard leaves the step out, and the selection bias of aux-loss-free balancing
    does not move either (the bias is state of the step like the weights); the steps around it move it."""
    from forge_lightning.callbacks import NonFiniteGuard

    preset = PRESETS["debug-deepseek"]
    config = LLMConfig.from_preset("debug-deepseek", moe={**preset["moe"], "bias_update_rate": 0.05})
    torch.manual_seed(0)

    class NanAtStep1(CausalLM):
        def loss_sum(self, batch):
            loss, count = super().loss_sum(batch)
            return (loss * math.nan, count) if self.trainer.global_step == 1 else (loss, count)

    model = NanAtStep1(config=config, optimizer={"lr": 1e-3})
    biases = []

    class Record(Callback):
        def on_train_batch_end(self, *args):
            biases.append(
                torch.cat([b.gate.e_score_correction_bias.clone() for b in model.model.moe_blocks()])
            )

    input_ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": input_ids, "labels": input_ids.roll(-1, dims=1)}
    trainer = _quiet_trainer(max_steps=3, callbacks=[NonFiniteGuard(), Record()])
    with pytest.warns(UserWarning, match="step 1 not applied"):
        trainer.fit(model, train_dataloaders=DataLoader([batch] * 3, batch_size=None))
    assert not torch.equal(biases[0], torch.zeros_like(biases[0]))  # step 0 moved it
    assert torch.equal(biases[1], biases[0])  # step 1 was left out
    assert not torch.equal(biases[2], biases[1])  # step 2 moves it again

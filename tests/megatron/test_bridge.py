"""The megatron-core twin computes transformers' function, and HF -> megatron -> HF is bit-exact (one process);
dense and mixture-of-experts (Qwen3-MoE, Qwen2-MoE with a dense layer and a gated shared expert, DeepSeek-V3 with
multi-latent attention and sigmoid group-limited routing with a selection bias)."""

import pytest
import torch
from safetensors.torch import load_file

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.megatron import build_gpt_model, transformer_config
from forge_lightning.strategies.megatron.bridge import export_hf_state, load_hf_checkpoint
from forge_lightning.strategies.megatron.layer_spec import gpt_decoder_spec


def _twin(path):
    config = LLMConfig.load(path)
    tf = transformer_config(config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model = build_gpt_model(config, tf, gpt_decoder_spec(tf), pre_process=True, post_process=True).eval()
    load_hf_checkpoint([model], config, path)
    return config, model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_logits_match_transformers(megatron_world, hf_models, arch):
    path, hf = hf_models[arch]
    _, model = _twin(path)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        logits = model(ids, None, None)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_hf_round_trip_is_bit_exact(megatron_world, hf_models, arch):
    path, _ = hf_models[arch]
    config, model = _twin(path)
    exported = export_hf_state([model], config)
    original = load_file(path / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_a_parameter_no_rule_fills_is_an_error(megatron_world, hf_models):
    """The strategy builds the twin uninitialised, so every parameter must come from a weight rule."""
    from forge_lightning.modules.llm.megatron import check_all_filled, weight_rules

    path, _ = hf_models["llama"]
    config, model = _twin(path)
    filled = {rule.megatron for rule in weight_rules(model, config)}
    check_all_filled(model, filled)
    with pytest.raises(
        ValueError, match=r"without a Hugging Face weight rule: \['decoder.final_layernorm.weight'\]"
    ):
        check_all_filled(model, filled - {"decoder.final_layernorm.weight"})

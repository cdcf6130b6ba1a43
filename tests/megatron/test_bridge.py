"""The megatron-core twin computes transformers' function, and HF -> megatron -> HF is bit-exact (one process);
dense and mixture-of-experts (Qwen3-MoE, Qwen2-MoE with a dense layer and a gated shared expert, DeepSeek-V3 with
multi-latent attention and sigmoid group-limited routing with a selection bias)."""

import pytest
import torch
from safetensors.torch import load_file

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.megatron import (
    build_gpt_model,
    export_hf_state,
    gpt_decoder_spec,
    load_hf_checkpoint,
    steps,
    transformer_config,
)


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


def test_packed_rows_and_z_loss_match_the_native_model(megatron_world, hf_models):
    """A packed batch (``document_ids``): the twin attends within each document with positions restarting per
    document (llama3-scaled RoPE, grouped key/value heads), giving the native model's logits; with ``z_loss`` its
    per-token loss (the schedule's forward step) sums to the native ``loss_sum``."""
    from forge_lightning.modules.llm import CausalLM

    path, _ = hf_models["llama"]
    _, model = _twin(path)
    native = CausalLM(config=str(path), pretrained=str(path), z_loss=1e-2).eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    document_ids = torch.tensor([[0] * 7 + [1] * 5 + [2] * 12, [0] * 10 + [1] * 14])
    labels = ids.roll(-1, dims=1).masked_fill(
        torch.rand(2, 24, generator=torch.Generator().manual_seed(3)) < 0.3, -100
    )
    batch = {"input_ids": ids, "labels": labels, "document_ids": document_ids}
    position_ids, documents = steps.packed_inputs(batch, model)
    with torch.no_grad():
        expected = native(ids, document_ids=document_ids)
        torch.testing.assert_close(model(ids, position_ids, documents), expected, atol=1e-5, rtol=0)
        assert (model(ids, None, None) - expected).abs().max() > 1e-2  # the document mask matters
        # RoPE scores depend on position differences only, so within a document positions restarting there equal
        # 0..S-1 up to rounding; positions that are not a shift per document (given by the batch) are followed.
        shifted = position_ids + torch.arange(24) // 5
        rotated = native(ids, position_ids=shifted, document_ids=document_ids)
        torch.testing.assert_close(model(ids, shifted, documents), rotated, atol=1e-5, rtol=0)
        assert (rotated - expected).abs().max() > 1e-3

    model.loss = LMLoss(z_loss=native.z_loss)
    output, loss_func = steps.forward_step(batch, model, model.loss)
    loss_sum, tokens, _ = loss_func(output)
    expected_sum, expected_tokens = native.loss_sum(batch)
    assert int(tokens) == int(expected_tokens)
    torch.testing.assert_close(loss_sum, expected_sum.float(), atol=0, rtol=1e-5)
    # Gradients through the z-loss's logsumexp and the document mask: the output layer's and the embedding's.
    loss_sum.backward()
    expected_sum.backward()
    for twin_name, native_param in (
        ("output_layer.weight", native.model.lm_head.weight),
        ("embedding.word_embeddings.weight", native.model.model.embed_tokens.weight),
    ):
        grad = model.get_parameter(twin_name).grad
        torch.testing.assert_close(grad, native_param.grad, atol=1e-5 * native_param.grad.abs().max(), rtol=0)
    model.loss = LMLoss()
    with torch.no_grad():
        plain_sum = model.loss.reduce(
            model(ids, position_ids, documents, labels=labels.clamp_min(0)), labels
        )[0]
    assert (loss_sum - plain_sum) > 1e-3  # the z-loss is in the sum


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied and tied output weights
def test_fused_loss_equals_megatrons_output_layer_and_cross_entropy(megatron_world, hf_models, arch):
    """At TP = 1 the twin's per-token loss comes from forge's fused linear + cross-entropy (chunks of tokens, no
    [s, b, vocab] logits): the same losses, z-loss included, and gradients as megatron's output layer + its
    cross-entropy; without labels the twin still returns the logits."""
    path, _ = hf_models[arch]
    _, megatrons = _twin(path)
    config, fused = _twin(path)
    fused.fused_loss = True
    assert not megatrons.fused_loss
    logits_built = []
    fused.output_layer.register_forward_hook(lambda *_: logits_built.append(True))
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(4))
    labels = ids.roll(-1, dims=1).masked_fill(
        torch.rand(3, 20, generator=torch.Generator().manual_seed(5)) < 0.2, -100
    )
    batch = {"input_ids": ids, "labels": labels}
    sums = []
    for model in (megatrons, fused):
        model.loss = LMLoss(z_loss=1e-2, backend="torch")
        model.train()
        output, loss_func = steps.forward_step(batch, model, model.loss)
        assert output.shape == (3, 20) and output.dtype == torch.float32
        loss_sum, tokens, _ = loss_func(output)
        loss_sum.backward()
        sums.append((output.detach(), loss_sum.detach()))
    torch.testing.assert_close(sums[1][0], sums[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums[1][1], sums[0][1], atol=0, rtol=1e-6)
    assert not logits_built  # the fused path never ran the output layer
    for (name, expected), actual in zip(megatrons.named_parameters(), fused.parameters(), strict=True):
        scale = expected.grad.abs().max()
        torch.testing.assert_close(actual.grad, expected.grad, atol=1e-5 * scale, rtol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, None, None), megatrons(ids, None, None), atol=0, rtol=0)
    assert config.tie_word_embeddings == (arch == "qwen3")


def test_fused_activation_keeps_the_twins_function(megatron_world, hf_models):
    """megatron's compiled SiLU-and-multiply (``bias_activation_fusion``, on by default on CUDA) gives the twin the
    same losses and gradients as the plain activation."""

    path, _ = hf_models["llama"]
    config = LLMConfig.load(path)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    batch = {"input_ids": ids, "labels": ids.roll(-1, dims=1)}
    results = []
    for fused_activation in (False, True):
        tf = transformer_config(
            config,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            bias_activation_fusion=fused_activation,
        )
        model = build_gpt_model(config, tf, gpt_decoder_spec(tf), pre_process=True, post_process=True)
        load_hf_checkpoint([model], config, path)
        output, loss_func = steps.forward_step(batch, model, model.loss)
        loss_sum = loss_func(output)[0]
        loss_sum.backward()
        results.append((loss_sum.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=0, rtol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-6 * grad.abs().max(), rtol=0, msg=name)


def test_rope_in_the_core_attention_equals_megatrons_rope(megatron_world, hf_models):
    """The twin's attention rotates queries and keys inside SDPACoreAttention (forge's fused RoPE kernel), at the
    positions megatron's rotary embedding gives, also per-token positions of packed rows: the same logits and
    gradients as megatron's own rotate-half in its SelfAttention."""
    from megatron.core.transformer.attention import SelfAttention

    from forge_lightning.modules.llm.megatron.layer_spec import FusedRopeSelfAttention

    path, _ = hf_models["llama"]
    _, fused = _twin(path)
    _, plain = _twin(path)
    rotated = []
    for layer in fused.decoder.layers:
        assert type(layer.self_attention) is FusedRopeSelfAttention
        core = layer.self_attention.core_attention
        core.register_forward_pre_hook(lambda module, _: rotated.append(module.rotary_freqs is not None))
    for layer in plain.decoder.layers:
        layer.self_attention.__class__ = SelfAttention  # megatron's RoPE, before the core attention
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))
    document_ids = torch.tensor([[0] * 9 + [1] * 15, [0] * 24])
    batch = {"input_ids": ids, "labels": ids.roll(-1, dims=1), "document_ids": document_ids}
    results = []
    for model in (plain, fused):
        position_ids, documents = steps.packed_inputs(batch, model)
        logits = model(ids, position_ids, documents)
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert rotated == [True] * len(fused.decoder.layers)
    assert all(layer.self_attention.core_attention.rotary_freqs is None for layer in fused.decoder.layers)
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-5 * grad.abs().max(), rtol=0, msg=name)

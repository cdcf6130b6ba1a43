"""The ``performance`` section: validation, ``auto`` resolution, and each transform against the plain model."""

import copy

import pytest
import torch
from tiny import TINY_LLM
from torch.utils._python_dispatch import TorchDispatchMode

from forge_lightning.contracts import Component, ParallelPlan
from forge_lightning.kernels import triton_available
from forge_lightning.modules.layers.fused import FusedGatedMLP, FusedRMSNorm, FusedRopeAttention
from forge_lightning.modules.llm import CausalLM, DecoderLM, LLMConfig
from forge_lightning.performance import (
    PerformanceConfig,
    apply_activation_checkpointing,
    apply_compile,
    apply_fp8,
    apply_kernels,
    resolve,
)


def _model(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(LLMConfig.load(TINY_LLM))


def _plan(model: DecoderLM) -> ParallelPlan:
    return ParallelPlan(components=[Component(name="llm", module=model, blocks=list(model.model.layers))])


def _loss_and_grads(model: DecoderLM, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"kernels": {"rms_norm": "cuda"}}, r"performance.kernels.rms_norm \('cuda'\) must be one of"),
        ({"attention": {"sdpa": ["flash", "fast"]}}, r"performance.attention.sdpa entries \('fast'\)"),
        ({"attention": {"packed": "ring"}}, r"performance.attention.packed \('ring'\)"),
        ({"activation_checkpointing": "some"}, r"performance.activation_checkpointing \('some'\)"),
        ({"optimizer": "fast"}, r"performance.optimizer \('fast'\)"),
        ({"fp8": {"recipe": "blockwise"}}, r"performance.fp8.recipe \('blockwise'\)"),
        ({"fp8": {"recipe": "rowwise", "fsdp_all_gather": True}}, "needs recipe 'tensorwise'"),
    ],
)
def test_bad_values_name_the_option(overrides, match):
    with pytest.raises(ValueError, match=match):
        PerformanceConfig(**overrides)


def test_auto_is_plain_torch_on_cpu_and_fastest_on_cuda():
    cpu = resolve(PerformanceConfig(), "cpu")
    assert cpu.kernels == dict.fromkeys(("rms_norm", "rope", "swiglu", "cross_entropy"), "torch")
    assert (cpu.sdpa, cpu.compile, cpu.optimizer, cpu.activation_checkpointing) == (
        None,
        False,
        "foreach",
        "none",
    )
    cuda = resolve(PerformanceConfig(), "cuda")
    assert cuda.compile and cuda.optimizer == "fused" and cuda.sdpa == ["cudnn", "flash", "efficient", "math"]
    # Compiled blocks fuse norm / RoPE / SwiGLU themselves; the loss outside the blocks stays a Triton kernel.
    assert cuda.kernels == {
        "rms_norm": "torch",
        "rope": "torch",
        "swiglu": "torch",
        "cross_entropy": "triton",
    }
    eager = resolve(PerformanceConfig(compile=False), "cuda")
    assert set(eager.kernels.values()) == {"triton"}
    forced = resolve(
        PerformanceConfig(kernels={"rope": "torch"}, compile=False, optimizer="for_loop"), "cuda"
    )
    assert forced.kernels["rope"] == "torch" and forced.optimizer == "for_loop"


def test_triton_kernel_layers_match_the_plain_model(monkeypatch):
    if not triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors run the kernels in Triton's interpreter
    plain, fused = _model(), _model()
    apply_kernels(_plan(fused), {"rms_norm": "triton", "rope": "triton", "swiglu": "triton"})
    layer = fused.model.layers[0]
    assert type(layer.input_layernorm) is FusedRMSNorm and type(fused.model.norm) is FusedRMSNorm
    assert type(layer.mlp) is FusedGatedMLP and type(layer.self_attn) is FusedRopeAttention
    assert fused.state_dict().keys() == plain.state_dict().keys()
    tokens = torch.randint(0, TINY_LLM["vocab_size"], (2, 13))
    loss, grads = _loss_and_grads(plain, tokens)
    fused_loss, fused_grads = _loss_and_grads(fused, tokens)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(model: DecoderLM, tokens: torch.Tensor) -> tuple[int, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens).float().logsumexp(-1).mean()
    with _CountMatmuls() as counter:
        loss.backward()
    return counter.count, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_recomputes_what_its_mode_says_and_keeps_gradients():
    tokens = torch.randint(0, TINY_LLM["vocab_size"], (2, 9))
    models = {mode: _model() for mode in ("none", "full", "selective")}
    for mode, model in models.items():
        apply_activation_checkpointing(
            _plan(model), mode, resolve(PerformanceConfig(), "cpu").selective_save_ops
        )
    counts = {mode: _backward_matmuls(model, tokens) for mode, model in models.items()}
    base_count, base_loss, base_grads = counts["none"]
    # Full recomputes each of the 2 blocks up to the last tensor backward needs: 6 of its 7 projections (the
    # output of the MLP's down projection is not needed). Selective keeps matmul outputs: no matmul again.
    assert counts["full"][0] == base_count + 2 * 6
    assert counts["selective"][0] == base_count
    for mode in ("full", "selective"):
        assert torch.equal(counts[mode][1], base_loss)
        for name, grad in base_grads.items():
            torch.testing.assert_close(counts[mode][2][name], grad, rtol=0, atol=0, msg=f"{mode} {name}")


def test_a_component_overrides_the_runs_checkpointing_and_compile_for_its_blocks():
    """Two components of one model (each decoder's layers): the first keeps the run's settings, the second says
    its own; only its blocks are recomputed (full: its matmuls again in backward) and only the first's compiled."""
    tokens = torch.randint(0, TINY_LLM["vocab_size"], (2, 9))
    base_count, base_loss, base_grads = _backward_matmuls(_model(), tokens)
    model = _model()
    layers = list(model.model.layers)
    plan = ParallelPlan(
        components=[
            Component(name="first", module=layers[0], blocks=[layers[0]]),
            Component(
                name="second",
                module=layers[1],
                blocks=[layers[1]],
                activation_checkpointing="full",
                compile=False,
            ),
        ]
    )
    apply_activation_checkpointing(plan, "none")
    assert not hasattr(layers[0].forward, "__wrapped__") and hasattr(layers[1].forward, "__wrapped__")
    count, loss, grads = _backward_matmuls(model, tokens)
    assert count == base_count + 6  # one block recomputed (6 of its 7 projections, see above)
    assert torch.equal(loss, base_loss)
    for name, grad in base_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    apply_compile(plan, enabled=True)
    assert layers[0]._compiled_call_impl is not None and layers[1]._compiled_call_impl is None
    bad = ParallelPlan(
        components=[Component(name="vision", module=layers[0], activation_checkpointing="most")]
    )
    with pytest.raises(
        ValueError, match=r"component 'vision': activation_checkpointing \('most'\) must be one of"
    ):
        apply_activation_checkpointing(bad, "none")


def test_selective_save_ops_must_be_aten_names():
    with pytest.raises(ValueError, match="must look like 'aten.<op>.<overload>'"):
        apply_activation_checkpointing(_plan(_model()), "selective", ("mm",))


def test_fp8_converts_the_block_linears_but_not_the_head_and_trains_close_to_fp32():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    config = dict(TINY_LLM, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = DecoderLM(LLMConfig.load(config))
    model = copy.deepcopy(reference)
    apply_fp8(_plan(model), PerformanceConfig(fp8={"recipe": "tensorwise"}).fp8)
    fp8_layers = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(fp8_layers) == 2 * 7 and not any("lm_head" in n for n in fp8_layers)
    assert type(model.lm_head) is torch.nn.Linear
    assert model.state_dict().keys() == reference.state_dict().keys()
    tokens = torch.randint(0, config["vocab_size"], (2, 17))
    loss, grads = _loss_and_grads(reference, tokens)
    fp8_loss, fp8_grads = _loss_and_grads(model, tokens)
    assert abs(fp8_loss - loss) / loss < 1e-2  # e4m3 forward, e5m2 gradients: ~3% per-element rounding
    for name, grad in grads.items():
        rel = (fp8_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert rel < 0.15, (name, rel)


def test_causal_lm_takes_performance_and_keeps_it_in_hyperparameters():
    module = CausalLM(config=TINY_LLM, performance={"attention": {"packed": "sdpa"}, "optimizer": "for_loop"})
    assert module.model.model.attention_backend == "sdpa"
    assert module.hparams["performance"]["optimizer"] == "for_loop"
    with pytest.raises(ValueError, match="performance.attention.packed"):
        CausalLM(config=TINY_LLM, performance={"attention": {"packed": "ring"}})


def test_fp8_options_reach_torchao_the_attention_layers_and_the_loss():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from forge_lightning.kernels.fp8_attention import FP8AttentionScales

    fp8 = {"recipe": "tensorwise", "attention": True, "fast_accum": True, "lm_head": True}
    model = _model()
    apply_fp8(_plan(model), PerformanceConfig(fp8=fp8).fp8, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert linears and all(m.config.gemm_config_grad_input.use_fast_accum for m in linears)
    assert all(m.config.gemm_config_grad_weight.use_fast_accum for m in linears)
    layers = [m.self_attn for m in model.model.layers]
    assert all(isinstance(a.fp8_scales, FP8AttentionScales) for a in layers)
    # The module's loss runs the output head's GEMMs in FP8 (emulated on CPU): close to, not equal to, bf16's.
    torch.manual_seed(0)
    plain = CausalLM(config=TINY_LLM, performance={"compile": False})
    fp8_module = CausalLM(config=TINY_LLM, performance={"compile": False, "fp8": {"lm_head": True}})
    fp8_module.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, TINY_LLM["vocab_size"], (2, 33))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    (loss, _), (fp8_loss, _) = plain.loss_sum(batch), fp8_module.loss_sum(batch)
    assert 0 < abs(fp8_loss - loss) / loss < 1e-2


def test_fp8_attention_trains_close_to_exact_attention_and_skips_other_cases():
    from forge_lightning.modules.layers.attention import attention
    from forge_lightning.performance.transforms import _enable_fp8_attention

    model = _model()
    reference = copy.deepcopy(model)
    _enable_fp8_attention(_plan(model), torch.device("cpu"))  # the torch emulation on CPU
    tokens = torch.randint(0, TINY_LLM["vocab_size"], (2, 33))
    loss, grads = _loss_and_grads(reference, tokens)
    fp8_loss, fp8_grads = _loss_and_grads(model, tokens)
    assert 0 < abs(fp8_loss - loss) / loss < 1e-2
    for name, grad in grads.items():
        assert (fp8_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12) < 0.1, name
    # Queries shorter than keys (decoding over a KV cache) stay in high precision: exactly the plain kernel.
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 9, 16)
    scales = model.model.layers[0].self_attn.fp8_scales
    torch.testing.assert_close(attention(q, k, k, causal=True, fp8=scales), attention(q, k, k, causal=True))


def test_fp8_attention_refuses_a_model_without_gqa_attention_layers():
    from forge_lightning.modules.layers.mla import MultiLatentAttention
    from forge_lightning.performance.transforms import _enable_fp8_attention

    torch.manual_seed(0)
    model = DecoderLM(LLMConfig.from_preset("debug-deepseek"))
    with pytest.raises(ValueError, match="no grouped-query Attention layer"):
        _enable_fp8_attention(_plan(model), torch.device("cpu"))
    mla = [m for m in model.modules() if isinstance(m, MultiLatentAttention)]
    assert mla and all(m.fp8_scales is None for m in mla)

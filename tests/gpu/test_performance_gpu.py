"""The CUDA defaults of the ``performance`` section against the plain model (run on a GPU machine: ``-m gpu``).

cuDNN attention with native grouped-query heads, the Triton layer kernels, compiled blocks and torchao FP8 each
train the same model as plain eager torch, within the stated bf16 / FP8 tolerances.
"""

import copy

import pytest
import torch

from forge_lightning.contracts import Component, ParallelPlan
from forge_lightning.modules.llm import DecoderLM, LLMConfig
from forge_lightning.performance import PerformanceConfig, apply_performance

pytestmark = pytest.mark.gpu

CONFIG = {
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


@pytest.fixture
def models():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    plain = DecoderLM(LLMConfig.load(CONFIG)).to("cuda", torch.bfloat16)
    return plain, copy.deepcopy(plain)


def _step(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1]).float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def _plan(model):
    return ParallelPlan(components=[Component(name="llm", module=model, blocks=list(model.model.layers))])


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize(
    ("overrides", "grad_tol"),
    [
        ({"compile": False}, 0.03),  # eager: Triton RMSNorm / RoPE / SwiGLU + cuDNN attention
        ({}, 0.03),  # the CUDA default: compiled blocks + cuDNN attention
        ({"fp8": {"recipe": "tensorwise"}}, 0.2),  # e4m3 activations, e5m2 output gradients
        ({"fp8": {"recipe": "rowwise"}}, 0.2),
        ({"fp8": {"recipe": "tensorwise", "fast_accum": True, "lm_head": True}}, 0.2),
    ],
)
def test_cuda_performance_settings_match_plain_eager(models, overrides, grad_tol):
    plain, fast = models
    apply_performance(_plan(fast), PerformanceConfig(**overrides), "cuda")
    tokens = torch.randint(0, CONFIG["vocab_size"], (4, 257), device="cuda")
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        loss, grads = _step(plain, tokens)
    fast_loss, fast_grads = _step(fast, tokens)
    assert abs(fast_loss - loss) / loss < (0.02 if "fp8" in overrides else 5e-3)
    for name, grad in grads.items():
        assert _rel(fast_grads[name], grad) < grad_tol, name

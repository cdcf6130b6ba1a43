"""The megatron twin's CUDA-only paths against megatron-core's own, on one GPU.

On CUDA the twin runs forge's Triton kernels where the CPU tests run their torch references: the fused linear +
cross-entropy loss, RMSNorm and RoPE (inside ``SDPACoreAttention``), plus megatron's compiled SiLU-and-multiply
(``bias_activation_fusion``) and torch's fused AdamW. Each must give the per-token losses and gradients of
megatron's plain path (its output layer + vocab-parallel cross-entropy, its eager rotate-half RoPE, its eager
activation) from the same weights; AdamW's fused kernel the foreach implementation's update.

Tolerances are max |actual - expected| / max |expected| per tensor, see ``TOL``.
"""

import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from forge_lightning.modules.llm import LLMConfig
from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.megatron import build_gpt_model, gpt_decoder_spec, steps, transformer_config
from forge_lightning.strategies.megatron.optimizer import _choose_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Allowed relative error: per-token losses / parameter gradients.
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 5e-2)}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max().clamp_min(1e-30)
    return ((actual.double() - expected.double()).abs().max() / scale).item()


@pytest.fixture(scope="module")
def megatron_cuda_world():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()


def assert_same_step(
    *, expected: torch.nn.Module, actual: torch.nn.Module, batch: dict, dtype: torch.dtype
) -> None:
    """One forward step (the schedule's per-token loss) and backward of each twin on ``batch``: the per-token losses
    and every parameter's gradient agree within ``TOL[dtype]``."""
    results = []
    for model in (expected, actual):
        output, loss_func = steps.forward_step(batch, model, model.loss)
        loss_func(output)[0].backward()
        results.append((output.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    loss_tol, grad_tol = TOL[dtype]
    assert rel_err(results[1][0], results[0][0]) < loss_tol
    for name, grad in results[0][1].items():
        assert rel_err(results[1][1][name], grad) < grad_tol, name


def _twin(config: LLMConfig, dtype: torch.dtype, *, fused: bool) -> torch.nn.Module:
    from megatron.core.transformer.attention import SelfAttention

    tf = transformer_config(
        config,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        bias_activation_fusion=fused,
        use_cpu_initialization=False,
    )
    model = build_gpt_model(
        config,
        tf,
        gpt_decoder_spec(tf),
        pre_process=True,
        post_process=True,
        loss=LMLoss(backend="triton"),
        fused_loss=fused,
    )
    if not fused:
        for layer in model.decoder.layers:
            layer.self_attention.__class__ = SelfAttention  # megatron's own RoPE
    return model.to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_twin_matches_megatrons_plain_path(megatron_cuda_world, dtype, tied):
    config = LLMConfig.from_preset("debug", tie_word_embeddings=tied, vocab_size=1000)
    torch.manual_seed(0)
    plain = _twin(config, dtype, fused=False)
    fused = _twin(config, dtype, fused=True)
    fused.load_state_dict(plain.state_dict())
    ids = torch.randint(0, config.vocab_size, (3, 256), device="cuda")
    labels = ids.roll(-1, dims=1).masked_fill(torch.rand(3, 256, device="cuda") < 0.1, -100)
    batch = {"input_ids": ids, "labels": labels}
    assert_same_step(expected=plain, actual=fused, batch=batch, dtype=dtype)


def test_fused_adamw_matches_foreach_on_cuda():
    def stepped(implementation: str) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        param = torch.nn.Parameter(torch.linspace(-1, 1, 4096, device="cuda"))
        optimizer = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1)
        _choose_kernels(optimizer, implementation)
        for step in range(5):
            param.grad = (param.detach() * (step + 1)).sin()
            optimizer.step()
        return optimizer, param.detach()

    auto, expected = stepped("auto")[0], stepped("foreach")[1]
    assert auto.param_groups[0]["fused"] is True
    assert rel_err(stepped("fused")[1], expected) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_experts_match_megatrons_loop_on_cuda(megatron_cuda_world, dtype):
    """MoE experts as grouped GEMMs (``torch._grouped_mm`` in bf16 on Hopper, the loop in fp32) against megatron's
    ``SequentialMLP`` loop from the same weights: per-token losses and every gradient."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = LLMConfig.from_preset("debug-moe", vocab_size=1000)
    torch.manual_seed(0)
    grouped = _twin(config, dtype, fused=True)
    loop = _twin(config, dtype, fused=True)
    loop.load_state_dict(grouped.state_dict())
    for layer in loop.decoder.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.__class__ = SequentialMLP
    ids = torch.randint(0, config.vocab_size, (2, 256), device="cuda")
    batch = {"input_ids": ids, "labels": ids.roll(-1, dims=1)}
    assert_same_step(expected=loop, actual=grouped, batch=batch, dtype=dtype)

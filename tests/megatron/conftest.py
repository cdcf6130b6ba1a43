"""megatron-core tests: the CPU shim, a one-process gloo world and tiny random Hugging Face models."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_shim

# The shim maps megatron-core's hard-coded CUDA calls to the CPU for these gloo tests. On a CUDA machine it would
# also move every other test of the session to the CPU, so it is installed only where there is no GPU.
_NEEDS_SHIM = not torch.cuda.is_available()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The shim is active while this folder's tests run (these hooks apply to its tests only)."""
    if _NEEDS_SHIM:
        cuda_shim.install()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Tests outside this folder see the real torch.cuda again."""
    if nextitem is None or Path(__file__).parent not in Path(nextitem.path).parents:
        cuda_shim.uninstall()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, *args: object, nproc: int = 2, timeout: float = 300) -> None:
    """Run ``script`` under ``torch.distributed.run`` on ``nproc`` gloo processes; fail with its output's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), str(script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="session")
def megatron_world():
    """A one-process gloo world with megatron's parallel state at TP = PP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        # No MASTER_PORT in os.environ: the subprocess runs of other tests would inherit it and meet this store.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture(scope="session")
def _fit_plan_runs(request, tiny_corpus, tmp_path_factory):
    """The ``forge fit`` runs of every test module of the session that uses ``fit_runs``, together: one worker
    launch per process count (see fit_plan.py). Each module lists its runs in ``fit_plan(tiny_corpus, root)``
    (``root``: a folder of its own for its inputs; run names are unique across the modules). Returns the runs and,
    per module whose ``fit_plan`` raised, that error (its tests fail with it, the other modules' run)."""
    import traceback

    from fit_plan import run_plan

    root = tmp_path_factory.mktemp("fit_plan")
    modules = {
        i.path: i.module for i in request.session.items if "fit_runs" in getattr(i, "fixturenames", ())
    }
    steps, errors = [], {}
    for path, module in modules.items():
        try:
            (root / path.stem).mkdir()
            steps += module.fit_plan(tiny_corpus, root / path.stem)
        except Exception:
            errors[path] = traceback.format_exc()
    return run_plan(root, steps), errors


@pytest.fixture(scope="module")
def fit_runs(request, _fit_plan_runs):
    """This module's ``forge fit`` runs (a :class:`fit_plan.PlanRuns`): read each with ``rows(name)`` or, for a run
    that must fail, ``error(name)``; the folder its ``fit_plan`` wrote its inputs to is ``root / <module file stem>``."""
    runs, errors = _fit_plan_runs
    if request.path in errors:
        pytest.fail(f"{request.path.name}: fit_plan raised\n{errors[request.path]}", pytrace=False)
    return runs


HF_TINY = {
    "llama": dict(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    "qwen2_moe": dict(  # layer 0 dense (mlp_only_layers), layer 1 MoE with the gated shared expert
        model_type="qwen2_moe",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
    # Multi-latent attention (query latent, interleaved rotary dims, value heads narrower than query/key heads);
    # layer 0 dense, layer 1 with 8 sigmoid-routed experts in 2 groups of which a token uses 1, top-2, the selection
    # bias (randomised below), routed_scaling_factor 2.5 and an ungated shared expert.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
}


def make_hf_model(arch: str, out: Path):
    """A tiny random transformers model of ``arch`` saved (fp32 safetensors) to ``out``; returns the model."""
    import transformers

    kwargs = dict(HF_TINY[arch])
    config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # make norms and biases non-trivial so their mapping is tested
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.mul_(25.0)  # MoE routers: logits of std ~3, so no token sits near a routing tie
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection bias
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: (root / arch, make_hf_model(arch, root / arch)) for arch in HF_TINY}

"""Context parallelism under MegatronStrategy: the twin at CP = 2 (Ulysses or ring attention, megatron's
load-balanced sequence split) and at CP = 4 (hybrid: Ulysses over 2 ranks x a ring of 2) gives the native model's
loss and gradients on one process; unsupported layouts are refused.

Same weights, same micro-batches (2 of 2 x 16 tokens), fp32: the 2-process worker (``context_parallel_worker.py``)
runs the twin at TP = PP = 1, CP = 2 (dense, MoE and DeepSeek-V3's multi-latent attention; Ulysses, and ring
attention with ``cp_comm_type: p2p``; the MoE twins also with EP = 2 over the CP ranks) through the strategy's
schedule and megatron's gradient finalisation; every gradient is gathered under its Hugging Face name and compared
with the native ``DecoderLM`` under the one batch rule. A 4-process run does the same for ``a2a+p2p`` (dense GQA,
MQA and MLA). ``forge fit`` at CP = 2 against the default strategy is in test_strategy.py.
"""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import torchrun
from context_parallel_worker import DENSE_CONFIGS, cp_config
from moe_reference import micro_batches, native_model, native_reference

from forge_lightning.contracts import MegatronDims
from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.megatron import check_ulysses_heads, steps

HERE = Path(__file__).resolve().parent
MOE_NAMES = ["qwen3_moe", "qwen2_moe", "deepseek_v3"]
NAMES = [*DENSE_CONFIGS, *MOE_NAMES]
LM_TOL = 1e-5  # |twin at CP = 2 - native| LM loss
GRAD_RTOL = 1e-5  # max |twin - native| per gradient tensor / its max |native|


def _dense_reference(model, batches) -> dict:
    """Native LM loss (token mean over all micro-batches) and its gradients."""
    model.zero_grad()
    total = sum(b["labels"].numel() for b in batches)
    lm_sum = 0.0
    for b in batches:
        ce = F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), reduction="sum")
        (ce / total).backward()
        lm_sum += ce.item()
    return {"lm_loss": lm_sum / total, "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}


def test_context_parallel_twin_matches_native(tmp_path):
    out = tmp_path / "runs.pt"
    torchrun(HERE / "context_parallel_worker.py", out, "cp2,cp2_p2p,cp2_ep2", *NAMES)
    runs = torch.load(out, weights_only=False)
    expected = [(layout, n) for layout in ("cp2", "cp2_p2p") for n in NAMES] + [
        ("cp2_ep2", n) for n in MOE_NAMES
    ]
    assert sorted(runs) == sorted(expected)
    _assert_match_native(runs)


def test_hybrid_context_parallel_twin_matches_native(tmp_path):
    """cp_comm_type a2a+p2p, hierarchical_context_parallel_sizes [2, 2] on 4 processes: megatron's hierarchical
    groups, Ulysses inside each pair of ranks, ring attention between the pairs."""
    out = tmp_path / "runs.pt"
    names = ["llama_gqa", "qwen3_mqa", "deepseek_v3"]
    torchrun(HERE / "context_parallel_worker.py", out, "cp4_a2a_p2p", *names, nproc=4)
    runs = torch.load(out, weights_only=False)
    assert sorted(runs) == sorted(("cp4_a2a_p2p", n) for n in names)
    _assert_match_native(runs)


def _assert_match_native(runs: dict) -> None:
    references = {}
    for (layout, name), run in runs.items():
        config = cp_config(name)
        if name not in references:
            model, batches = native_model(config), micro_batches(config, 2)
            references[name] = (
                native_reference(model, batches) if config.moe else _dense_reference(model, batches)
            )
        ref = references[name]
        loss = (run["sums"][0] / run["sums"][1]).item()
        assert run["sums"][1].item() == 2 * 2 * 16, name  # every token counted once over the CP ranks
        assert abs(loss - ref["lm_loss"]) <= LM_TOL, (layout, name, loss, ref["lm_loss"])
        assert sorted(run["grads"]) == sorted(ref["grads"]), name
        rel = {
            k: ((g - ref["grads"][k]).abs().max() / ref["grads"][k].abs().max()).item()
            for k, g in run["grads"].items()
        }
        worst = max(rel, key=rel.get)
        assert rel[worst] <= GRAD_RTOL, (layout, name, worst, rel[worst])


_DEGREES = dict(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    context_parallel_size=2,
    expert_model_parallel_size=1,
    sequence_parallel=False,
    overlap_param_gather=False,
    use_distributed_optimizer=False,
)


def validate_degrees(world_size: int, degrees: dict) -> int:
    return MegatronDims(**degrees).validate(world_size)


def test_context_parallel_degrees():
    assert validate_degrees(2, _DEGREES) == 1
    assert validate_degrees(8, {**_DEGREES, "tensor_model_parallel_size": 2}) == 2  # DP = 8 / (TP 2 x CP 2)
    with pytest.raises(ValueError, match="context parallel size must divide the world size"):
        validate_degrees(3, _DEGREES)
    with pytest.raises(ValueError, match="must be at least 1"):
        validate_degrees(2, {**_DEGREES, "context_parallel_size": 0})
    # Expert parallelism is laid over DP x CP, as megatron-core does.
    assert validate_degrees(2, {**_DEGREES, "expert_model_parallel_size": 2}) == 1


def test_context_parallel_comm_types_are_checked():
    p2p = {**_DEGREES, "cp_comm_type": "p2p"}
    assert validate_degrees(2, p2p) == 1
    hybrid = {**_DEGREES, "context_parallel_size": 4, "cp_comm_type": "a2a+p2p"}
    assert validate_degrees(4, {**hybrid, "hierarchical_context_parallel_sizes": [2, 2]}) == 1
    with pytest.raises(ValueError, match=r"cp_comm_type \('ring'\) must be one of a2a, p2p, a2a\+p2p"):
        validate_degrees(2, {**_DEGREES, "cp_comm_type": "ring"})
    with pytest.raises(ValueError, match=r"product is context_parallel_size \(4\), got \[2, 4\]"):
        validate_degrees(4, {**hybrid, "hierarchical_context_parallel_sizes": [2, 4]})
    with pytest.raises(ValueError, match=r"needs hierarchical_context_parallel_sizes \[a2a, p2p\]"):
        validate_degrees(4, hybrid)
    with pytest.raises(ValueError, match="only read with cp_comm_type 'a2a\\+p2p', got 'p2p'"):
        validate_degrees(2, {**p2p, "hierarchical_context_parallel_sizes": [1, 2]})


def test_heads_must_split_over_context_parallel_ranks():
    config = LLMConfig.from_preset("debug")  # 4 query heads, 2 key/value heads
    check_ulysses_heads(config, tp=1, cp=4)
    check_ulysses_heads(LLMConfig.from_preset("debug", num_kv_heads=1), tp=1, cp=2)  # MQA: repeated
    with pytest.raises(ValueError, match=r"context_parallel_size \(3\) must divide .* num_heads \(4\)"):
        check_ulysses_heads(config, tp=1, cp=3)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size \(2\) = 2"):
        check_ulysses_heads(config, tp=2, cp=4)
    with pytest.raises(ValueError, match=r"hierarchical_context_parallel_sizes\[0\] \(3\) must divide"):
        check_ulysses_heads(config, tp=1, cp=3, option="hierarchical_context_parallel_sizes[0]")


def test_sequence_length_is_refused(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    batch = {
        "input_ids": torch.zeros(2, 30, dtype=torch.long),
        "labels": torch.zeros(2, 30, dtype=torch.long),
    }
    with pytest.raises(ValueError, match=r"sequence length \(30\) must be divisible by 4"):
        steps.shard_on_context_parallel_rank(batch)


@pytest.mark.parametrize("comm_type", ["p2p", "a2a+p2p"])
def test_packed_batches_with_ring_attention_are_refused(comm_type):
    """Ring attention has no document mask (Ulysses has: packed rows at CP = 2 are in test_strategy.py)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from forge_lightning.modules.llm.megatron.layer_spec import SDPACoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    core = SDPACoreAttention(config, 1, AttnMaskType.causal)
    core.cp = SimpleNamespace(comm_type=comm_type)  # only its algorithm is read before the refusal
    q_SBHD = torch.zeros(16, 1, 2, 4)
    with pytest.raises(NotImplementedError, match=f"packed batches .* cp_comm_type '{re.escape(comm_type)}'"):
        core(q_SBHD, q_SBHD, q_SBHD, torch.zeros(1, 16, dtype=torch.long))


def test_packed_batches_with_multi_latent_attention_are_refused():
    model = SimpleNamespace(decoder=None, config=SimpleNamespace(multi_latent_attention=True))
    batch = {
        "input_ids": torch.zeros(1, 8, dtype=torch.long),
        "document_ids": torch.zeros(1, 8, dtype=torch.long),
    }
    with pytest.raises(NotImplementedError, match="packed batches .* multi-latent attention"):
        steps.packed_inputs(batch, model)

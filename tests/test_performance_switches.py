"""Every ``performance`` switch is applied or refused under every strategy, never silently ignored.

For each switch (a field of ``PerformanceConfig``) the test sets a value other than the default and sets the tiny
LLM up under each strategy (one worker process, ``performance_switches_worker.py``): the run must either set up
(the strategy, the module or MegatronStrategy's twin named the switch as applied; anything else is refused at setup
by ``check_applied``) or refuse with a message naming ``performance.<switch>``. The expected outcome of each pair
is listed: a change of what a strategy applies shows up here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_lightning.performance import PerformanceConfig, changed_switches, check_applied, switch_names

HERE = Path(__file__).resolve().parent
NATIVE = ("single_device", "ddp", "zero1", "fsdp2")
STRATEGIES = (*NATIVE, "megatron")

# A value other than the default for every switch (on a CPU, where `auto` is plain torch).
ALTERNATIVES = {
    "kernels.rms_norm": {"kernels": {"rms_norm": "torch"}},
    "kernels.rope": {"kernels": {"rope": "torch"}},
    "kernels.swiglu": {"kernels": {"swiglu": "torch"}},
    "kernels.cross_entropy": {"kernels": {"cross_entropy": "torch"}},
    "attention.kernel": {"attention": {"kernel": "sdpa"}},
    "attention.sdpa": {"attention": {"sdpa": ["math"]}},
    "attention.packed": {"attention": {"packed": "sdpa"}},
    "compile": {"compile": False},
    "activation_checkpointing": {"activation_checkpointing": "full"},
    "selective_save_ops": {
        "activation_checkpointing": "selective",
        "selective_save_ops": ["aten.mm.default"],
    },
    "fp8": {"fp8": {}},
    "fp8.recipe": {"fp8": {"recipe": "rowwise"}},
    "fp8.exclude": {"fp8": {"exclude": ["lm_head", "*.down_proj"]}},
    "fp8.fsdp_all_gather": {"fp8": {"fsdp_all_gather": True}},
    "fp8.attention": {"fp8": {"attention": True}},
    "fp8.fast_accum": {"fp8": {"fast_accum": True}},
    "fp8.lm_head": {"fp8": {"lm_head": True}},
    "optimizer": {"optimizer": "for_loop"},
}

# The refused (strategy, switch) pairs; every other pair applies.
REFUSED = {
    *(
        (s, "fp8.fsdp_all_gather") for s in ("single_device", "ddp", "zero1")
    ),  # no FSDP all-gather to run in FP8
    # megatron-core's FP8 needs TransformerEngine; megatron's selective recompute keeps other tensors than ours.
    *(("megatron", s) for s in ALTERNATIVES if s.startswith("fp8")),
    ("megatron", "selective_save_ops"),
}


def test_every_switch_has_an_alternative_value():
    assert sorted(ALTERNATIVES) == sorted(switch_names())
    for switch, value in ALTERNATIVES.items():
        assert switch in changed_switches(PerformanceConfig(**value)), switch


def test_a_switch_nobody_applies_is_refused_with_its_name():
    perf = PerformanceConfig(compile=False, kernels={"rope": "torch"})
    check_applied(perf, {"compile", "kernels.rope"}, "SomeStrategy")
    with pytest.raises(ValueError, match=r"performance.kernels.rope is not applied under SomeStrategy"):
        check_applied(perf, {"compile"}, "SomeStrategy")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[tuple[str, str], dict]:
    root = tmp_path_factory.mktemp("switches")
    cases = [
        {"strategy": s, "switch": k, "performance": v} for s in STRATEGIES for k, v in ALTERNATIVES.items()
    ]
    (root / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        str(HERE / "performance_switches_worker.py"),
        str(root / "cases.json"),
        str(root / "out.json"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {(r["strategy"], r["switch"]): r for r in json.loads((root / "out.json").read_text())}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_switch_is_applied_or_refused_by_name(outcomes, strategy):
    for switch, value in ALTERNATIVES.items():
        result = outcomes[strategy, switch]
        expected = "refused" if (strategy, switch) in REFUSED else "applied"
        assert result["outcome"] == expected, (strategy, switch, result.get("message"))
        if expected == "refused":
            named = [f"performance.{s}" for s in changed_switches(PerformanceConfig(**value))]
            assert any(name in result["message"] for name in named), (strategy, switch, result["message"])


def test_a_triton_kernel_with_no_layer_to_replace_is_refused():
    """``triton`` asked for a layer the model lacks (here: no RMSNorm) would switch nothing: refused by name."""
    from torch import nn

    from forge_lightning.contracts import Component, ParallelPlan
    from forge_lightning.performance import apply_performance

    plan = ParallelPlan(components=[Component(name="mlp", module=nn.Sequential(nn.Linear(4, 4)))])
    perf = PerformanceConfig(kernels={"rms_norm": "triton"}, compile=False)
    with pytest.raises(
        ValueError, match=r"performance.kernels.rms_norm \('triton'\) is not applied: .* no RMSNorm"
    ):
        apply_performance(plan, perf, "cpu")
    assert "kernels.rms_norm" in apply_performance(
        plan, PerformanceConfig(kernels={"rms_norm": "torch"}), "cpu"
    )

"""Every parallel degree of every strategy is checked against the world size and the model before any work starts,
with a message that names the degree, its value and the size it does not fit.

The checks are called directly, with the world size a launch would have, on the tiny models' real plans and
configs; one 2-process ``forge fit`` shows that a refused degree stops the real run before its first step.

DDP and ZeRO-1 have no degree of their own (every process is a data-parallel rank, and ZeRO-1 shards the optimizer
state by parameter size at any world size), so they have no row here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from forge_lightning.contracts import Component, MegatronBuild, MegatronDims, ParallelPlan
from forge_lightning.modules.embodied import Pi05Policy
from forge_lightning.modules.llm import CausalLM
from forge_lightning.modules.llm.config import PRESETS, LLMConfig
from forge_lightning.modules.llm.megatron.twin import check_layout
from forge_lightning.strategies import FSDP2Strategy
from forge_lightning.strategies.fsdp2 import FSDPDims
from forge_lightning.strategies.megatron.components import parse_components
from forge_lightning.strategies.megatron.strategy import check_model_layout
from forge_lightning.strategies.parallelize import check_tensor_parallel_plan

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"
STRATEGY = "forge_lightning.strategies.megatron.MegatronStrategy"
# tests/configs/tiny_llm.yaml's model in LLMConfig's names: 4 query heads, 2 key/value heads, 2 layers.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


def _llm(preset: str | None = None, **fields: Any) -> CausalLM:
    config = LLMConfig.from_preset(preset, **fields) if preset else LLMConfig(**{**TINY, **fields})
    return CausalLM(config=config.to_hf())


def _moe(**moe: Any) -> dict[str, Any]:
    return {"moe": {**PRESETS["debug-moe"]["moe"], **moe}}


# ---------------------------------------------------------------------------------------- FSDP2 / HSDP, world

FSDP_WORLD = [
    # (world, degrees, message)
    (
        4,
        dict(tensor_parallel_size=3),
        r"data_parallel_size x context_parallel_size x tensor_parallel_size must equal the world size: "
        r"data_parallel_size=auto \(resolved 1\), .*tensor_parallel_size=3, expert_parallel_size=1, world size=4",
    ),
    (
        2,
        dict(data_parallel_size=2, context_parallel_size=2),
        r"x context_parallel_size x .* must equal the world size: .*context_parallel_size=2 \(ulysses\), .*world size=2",
    ),
    (
        2,
        dict(context_parallel_size=2, context_parallel_type="stripe"),
        r"context_parallel_type \('stripe'\) must be one of ulysses, ring, hybrid",
    ),
    (
        4,
        dict(context_parallel_size=4, context_parallel_type="hybrid"),
        r"'hybrid' needs context_parallel_ulysses_size.*one of \[2\]\): .*context_parallel_size=4 \(hybrid\)",
    ),
    (
        2,
        dict(context_parallel_size=2, context_parallel_ulysses_size=2),
        r"context_parallel_ulysses_size is for context_parallel_type 'hybrid': .*ulysses size 2",
    ),
    (
        8,
        dict(data_parallel_size=4, tensor_parallel_size=2, data_parallel_replicate_size=3),
        r"data_parallel_replicate_size must divide data_parallel_size: .*data_parallel_replicate_size=3",
    ),
    (
        2,
        dict(tensor_parallel_size=2, sequence_parallel=True),
        r"sequence_parallel is not supported by FSDP2Strategy yet: .*MegatronStrategy\(sequence_parallel=true\)",
    ),
    (
        2,
        dict(reshard_after_forward=3),
        r"reshard_after_forward \(3\) must divide the shard size, data_parallel_size / "
        r"data_parallel_replicate_size = 2: .*; use one of \[1, 2\], true or false",
    ),
    (
        8,
        dict(data_parallel_replicate_size=2, reshard_after_forward=8),
        r"reshard_after_forward \(8\) must divide the shard size, .* = 4: .*use one of \[1, 2, 4\]",
    ),
]


@pytest.mark.parametrize(("world", "degrees", "message"), FSDP_WORLD)
def test_fsdp2_degrees_against_the_world(world, degrees, message):
    with pytest.raises(ValueError, match=message):
        FSDPDims(**degrees).validate(world)


def test_fsdp2_degrees_that_fit_resolve():
    assert FSDPDims(tensor_parallel_size=2).validate(4) == 2
    assert FSDPDims(data_parallel_replicate_size=2, reshard_after_forward=2).validate(8) == 8
    assert FSDPDims(reshard_after_forward=False).validate(3) == 3
    assert FSDPDims(context_parallel_size=2, tensor_parallel_size=2).validate(8) == 2  # dp excludes cp and tp
    hybrid = FSDPDims(
        context_parallel_size=4, context_parallel_type="hybrid", context_parallel_ulysses_size=2
    )
    assert hybrid.validate(8) == 2


# ---------------------------------------------------------------------------------------- FSDP2 TP, model

FSDP_MODEL = [
    # (model, tensor_parallel_size, message): only the sizes TP does not divide are named
    (
        dict(hidden_size=48, num_heads=3, num_kv_heads=1),
        2,
        r"tensor_parallel_size \(2\) must divide the model's llm.num_heads \(3\), llm.num_kv_heads \(1\): .*"
        r"set tensor_parallel_size to one of \[1\]",
    ),
    (
        dict(),
        4,
        r"tensor_parallel_size \(4\) must divide the model's llm.num_kv_heads \(2\): .*one of \[1, 2\]",
    ),
    (
        dict(vocab_size=514, num_heads=8, num_kv_heads=4),
        4,
        r"tensor_parallel_size \(4\) must divide the model's llm.vocab_size \(514\): .*one of \[1, 2\]",
    ),
    (
        dict(intermediate_size=130, num_kv_heads=4),
        4,
        r"must divide the model's llm.intermediate_size \(130\): .*one of \[1, 2\]",
    ),
    (
        dict(
            preset="debug-moe",
            architecture="qwen2_moe",
            qk_norm=False,
            **_moe(shared_intermediate_size=31, shared_expert_gate=True),
        ),
        2,
        r"must divide the model's llm.moe.shared_intermediate_size \(31\): .*one of \[1\]",
    ),
]


@pytest.mark.parametrize(("model", "tp", "message"), FSDP_MODEL)
def test_fsdp2_tensor_parallel_against_the_model(model, tp, message):
    plan = _llm(**model).parallel_plan()
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel_plan(plan, tp)
    check_tensor_parallel_plan(plan, 1)


def test_fsdp2_tensor_parallel_must_split_a_component():
    """A model whose plan declares no TP styles (Pi0.5: Gemma's single key/value head), or whose only split
    component is kept out of TP, would run the same computation on every TP rank."""
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size \(2\) splits no component of the model: none of the components it would split "
        r"\(vision, llm, action_expert\) declares tensor-parallel styles .* set tensor_parallel_size: 1",
    ):
        FSDP2Strategy(tensor_parallel_size=2).check_plan(Pi05Policy("debug").parallel_plan())
    plan = _llm().parallel_plan()
    with pytest.raises(
        ValueError,
        match=r"splits no component .*: every component is kept out of it \(unsharded or replicated: llm\)",
    ):
        FSDP2Strategy(tensor_parallel_size=2, replicated_components=["llm"]).check_plan(plan)
    FSDP2Strategy(tensor_parallel_size=2).check_plan(plan)


# ---------------------------------------------------------------------------------------- megatron, world

MEGATRON_WORLD = [
    # (world, degrees, message): every message names every degree
    (
        4,
        dict(tensor_model_parallel_size=3),
        r"tensor x pipeline .* must divide the world size: .*world size=4",
    ),
    (
        4,
        dict(pipeline_model_parallel_size=3),
        r"must divide the world size: .*pipeline_model_parallel_size=3",
    ),
    (6, dict(context_parallel_size=4), r"must divide the world size: .*context_parallel_size=4"),
    (
        4,
        dict(virtual_pipeline_model_parallel_size=2),
        r"virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1",
    ),
    (2, dict(sequence_parallel=True), r"sequence_parallel needs tensor_model_parallel_size > 1"),
    (
        4,
        dict(tensor_model_parallel_size=2, expert_model_parallel_size=4),
        r"expert_model_parallel_size \(4\) x expert_tensor_parallel_size \(2\) must divide the ranks of a "
        r"pipeline stage, .* = 4",
    ),
    (
        4,
        dict(pipeline_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1),
        r"expert_model_parallel_size \(4\) x expert_tensor_parallel_size \(1\) must divide .* = 2",
    ),
    (
        4,
        dict(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 4]),
        r"product is context_parallel_size \(4\), got \[2, 4\]",
    ),
    (2, dict(tensor_model_parallel_size=0), r"every parallel degree must be at least 1"),
]


@pytest.mark.parametrize(("world", "degrees", "message"), MEGATRON_WORLD)
def test_megatron_degrees_against_the_world(world, degrees, message):
    with pytest.raises(ValueError, match=message):
        MegatronDims(**degrees).validate(world)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"llm": {"tensor_model_parallel_size": 3}},
            r"components.llm.tensor_model_parallel_size \(3\) must divide the strategy's "
            r"tensor_model_parallel_size \(2\)",
        ),
        ({"llm": {"tensor_model_parallel_size": 0}}, r"must be a positive integer, got 0"),
    ],
)
def test_megatron_component_degrees(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_components(raw, 2)


# ---------------------------------------------------------------------------------------- megatron, model

MEGATRON_MODEL = [
    # (model, degrees, seq_length, message)
    (
        dict(hidden_size=48, num_heads=3, num_kv_heads=1),
        dict(tensor_model_parallel_size=2),
        None,
        r"tensor_model_parallel_size \(2\) must divide the model's llm.num_heads \(3\), llm.num_kv_heads \(1\)",
    ),
    (
        dict(vocab_size=514, num_heads=8, num_kv_heads=4),
        dict(tensor_model_parallel_size=4),
        None,
        r"tensor_model_parallel_size \(4\) must divide the model's llm.vocab_size \(514\)",
    ),
    (
        dict(),
        dict(context_parallel_size=2),
        30,
        r"context_parallel_size \(2\) splits each sequence into 2 x 2 = 4 equal chunks .*: data.seq_length \(30\) "
        r"must be divisible by 4",
    ),
    (
        dict(),
        dict(context_parallel_size=2, cp_comm_type="p2p"),
        30,
        r"context_parallel_size \(2\) .* data.seq_length \(30\) must be divisible by 4",
    ),
    (
        dict(),
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
        33,
        r"sequence_parallel: data.seq_length \(33\) must be divisible by tensor_model_parallel_size \(2\): .*"
        r"multiple of 2 tokens",
    ),
    (
        dict(num_kv_heads=4),
        dict(tensor_model_parallel_size=4, sequence_parallel=True, context_parallel_size=2),
        36,
        r"sequence_parallel: data.seq_length \(36\) / context_parallel_size \(2\) = 18 must be divisible by "
        r"tensor_model_parallel_size \(4\): .*multiple of 8 tokens",
    ),
]


@pytest.mark.parametrize(("model", "degrees", "seq_length", "message"), MEGATRON_MODEL)
def test_megatron_layout_against_the_model_and_data(model, degrees, seq_length, message):
    plan = _llm(**model).parallel_plan()
    with pytest.raises(ValueError, match=message):
        check_model_layout(plan, MegatronDims(**degrees), decoder="llm", seq_length=seq_length)


TWIN = [
    # (model, degrees, message): the twin's checks, when the module makes it (before any weight is built)
    (
        dict(num_layers=3),
        dict(pipeline_model_parallel_size=2),
        r"pipeline_model_parallel_size \(2\) x virtual_pipeline_model_parallel_size \(1\) = 2 must divide the "
        r"model's num_layers \(3\): .*one of \[1, 3\]",
    ),
    (
        dict(num_layers=4),
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
        r"= 8 must divide the model's num_layers \(4\): .*one of \[1, 2, 4\]",
    ),
    (
        dict(preset="debug-moe", **_moe(num_experts=6)),
        dict(expert_model_parallel_size=4),
        r"expert_model_parallel_size \(4\) must divide moe.num_experts \(6\): .*one of \[1, 2, 3, 6\]",
    ),
    (
        dict(preset="debug-moe", **_moe(intermediate_size=36)),
        dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=8),
        r"expert_tensor_parallel_size \(8\) must divide moe.intermediate_size \(36\): .*one of \[1, 2, 3, 4, 6, "
        r"9, 12, 18, 36\]",
    ),
    (
        dict(preset="debug-moe", **_moe(intermediate_size=33)),
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
        r"tensor_model_parallel_size \(2\) must divide the model's moe.intermediate_size \(33\): "
        r"expert_tensor_parallel_size is unset, .*set expert_tensor_parallel_size to one of \[1, 3, 11, 33\]",
    ),
    (
        dict(),
        dict(expert_model_parallel_size=2),
        r"expert_model_parallel_size \(2\) needs a mixture-of-experts model",
    ),
    (
        dict(),
        dict(context_parallel_size=3),
        r"context_parallel_size \(3\) must divide the query heads of each tensor-parallel rank, num_heads \(4\) / "
        r"tensor_model_parallel_size \(1\) = 4: .*use one of \[1, 2, 4\]",
    ),
    (
        dict(),
        dict(tensor_model_parallel_size=2, context_parallel_size=4),
        r"context_parallel_size \(4\) must divide .* num_heads \(4\) / tensor_model_parallel_size \(2\) = 2: .*"
        r"use one of \[1, 2\], or cp_comm_type 'p2p'",
    ),
    (
        dict(),
        dict(context_parallel_size=6, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[3, 2]),
        r"hierarchical_context_parallel_sizes\[0\] \(3\) must divide the query heads",
    ),
]


@pytest.mark.parametrize(("model", "degrees", "message"), TWIN)
def test_megatron_twin_layout_against_the_model(model, degrees, message):
    module = _llm(**model)
    dims = MegatronDims(**degrees)
    build = MegatronBuild(dims=dims, device=torch.device("cpu"), bf16=False, use_transformer_engine=False)
    with pytest.raises(ValueError, match=message):
        module.megatron_model(build)  # DecoderTwin: checks the layout, builds nothing yet
    with pytest.raises(ValueError, match=message):
        check_layout(module.config, dims, use_transformer_engine=False)


def test_megatron_layouts_that_fit_pass():
    check_layout(LLMConfig(**TINY), MegatronDims(context_parallel_size=2, cp_comm_type="p2p"), False)
    moe = LLMConfig.from_preset("debug-moe")  # moe.intermediate_size 32
    check_layout(moe, MegatronDims(tensor_model_parallel_size=2, expert_model_parallel_size=2), False)
    odd = LLMConfig.from_preset("debug-moe", **_moe(intermediate_size=33))
    check_layout(odd, MegatronDims(tensor_model_parallel_size=2, expert_tensor_parallel_size=1), False)
    plan = _llm().parallel_plan()
    dims = MegatronDims(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2)
    check_model_layout(plan, dims, decoder="llm", seq_length=32)


def test_megatron_batches_of_another_length_are_refused_before_the_forward():
    """Variable-length batches (the data's ``seq_length`` is only an upper bound) are checked per micro-batch."""
    dims = MegatronDims(tensor_model_parallel_size=2, sequence_parallel=True)
    build = MegatronBuild(dims=dims, device=torch.device("cpu"), bf16=False, use_transformer_engine=False)
    twin = _llm().megatron_model(build)
    batch = {
        "input_ids": torch.zeros(2, 31, dtype=torch.long),
        "labels": torch.zeros(2, 31, dtype=torch.long),
    }
    with pytest.raises(
        ValueError, match=r"sequence_parallel: the batch's sequence length \(31\) must be divisible"
    ):
        twin.forward_step(batch, chunk=None)


def test_plan_with_components_names_each_size():
    plan = ParallelPlan(
        components=[
            Component(
                name="vision", module=nn.Linear(2, 2), tp_plan={"x": "colwise"}, tp_dims={"num_heads": 6}
            ),
            Component(name="llm", module=nn.Linear(2, 2), tp_plan={"x": "colwise"}, tp_dims={"num_heads": 8}),
        ]
    )
    with pytest.raises(
        ValueError, match=r"\(4\) must divide the model's vision.num_heads \(6\): .*one of \[1, 2\]"
    ):
        check_tensor_parallel_plan(plan, 4)
    check_tensor_parallel_plan(plan, 4, skip=["vision"])


# ---------------------------------------------------------------------------------------- the real path


def test_a_refused_degree_stops_a_real_run_before_its_first_step(tiny_corpus, tmp_path):
    """2 processes on gloo: MegatronStrategy with TP = 2 and sequence parallelism over 33-token sequences stops in
    the strategy's setup, on every rank, with the message (megatron-core's own assertion came in the first
    forward); the twin was never made."""
    pytest.importorskip("megatron.core")
    entry = REPO / "tests" / "megatron" / "forge_entry.py"  # the forge CLI with the test-only CUDA shim
    data = [
        "--data.data_prefix",
        str(tiny_corpus["prefix"]),
        "--data.tokenizer",
        str(tiny_corpus["tokenizer"]),
    ]
    trainer = [
        "--trainer.devices",
        "2",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.strategy",
        STRATEGY,
    ]
    layout = [
        "--trainer.strategy.tensor_model_parallel_size",
        "2",
        "--trainer.strategy.sequence_parallel",
        "true",
    ]
    cmd = [sys.executable, str(entry), "fit", "--config", str(TINY_YAML), "--data.seq_length", "33"]
    cmd += [*data, *trainer, *layout]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env |= {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    message = "sequence_parallel: data.seq_length (33) must be divisible by tensor_model_parallel_size (2)"
    for rank in (0, 1):
        assert f"[rank{rank}]: ValueError: {message}" in out, out[-6000:]
    assert re.search(r"strategy.py\", line \d+, in setup\n", out), out[-6000:]
    assert "megatron_model" not in out and "training_step" not in out, out[-6000:]

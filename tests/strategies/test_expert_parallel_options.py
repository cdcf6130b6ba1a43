"""FSDP2Strategy's expert_parallel_size is validated up front: degrees, the plan's expert stacks, options it cannot
combine with yet (no processes)."""

import pytest
from torch import nn

from forge_lightning.contracts import Component, ExpertStack, ParallelPlan
from forge_lightning.modules.layers.moe import Experts
from forge_lightning.strategies import FSDP2Strategy
from forge_lightning.strategies.expert_parallel import check_expert_parallel
from forge_lightning.strategies.fsdp2 import FSDPDims


def _plan(*num_experts: int, name: str = "llm") -> ParallelPlan:
    stacks = [Experts(n, 8, 4) for n in num_experts]
    return ParallelPlan(components=[Component(name=name, module=nn.ModuleList(stacks), experts=stacks)])


def test_expert_parallel_size_carves_the_shard_dimension():
    assert FSDPDims(expert_parallel_size=2).validate(4) == 4
    assert FSDPDims(data_parallel_replicate_size=2, expert_parallel_size=2).validate(4) == 4


@pytest.mark.parametrize(
    ("dims", "world", "match"),
    [
        (dict(expert_parallel_size=3), 4, r"expert_parallel_size \(3\) must divide the shard size.* = 4.*\[1, 2, 4\]"),
        (dict(data_parallel_replicate_size=2, expert_parallel_size=4), 4, r"must divide the shard size.* = 2"),
        (dict(expert_parallel_size=0), 4, "expert_parallel_size must be at least 1"),
        (dict(expert_parallel_size=2, tensor_parallel_size=2), 4, "does not combine with tensor_parallel_size"),
        (dict(expert_parallel_size=2, context_parallel_size=2), 4, "or context_parallel_size > 1"),
    ],
)  # fmt: skip
def test_bad_expert_parallel_degrees_are_refused(dims, world, match):
    with pytest.raises(ValueError, match=match):
        FSDPDims(**dims).validate(world)


def test_plan_checks():
    check_expert_parallel(_plan(8, 8), 4, skip=[])
    check_expert_parallel(ParallelPlan(components=[Component(name="dense", module=nn.Linear(2, 2))]), 1, [])
    with pytest.raises(ValueError, match=r"must divide every MoE layer's num_experts, got \[6\]"):
        check_expert_parallel(_plan(8, 6), 4, skip=[])
    with pytest.raises(ValueError, match="declares no expert stacks"):
        check_expert_parallel(ParallelPlan(components=[Component(name="d", module=nn.Linear(2, 2))]), 2, [])
    with pytest.raises(ValueError, match=r"components \['llm'\] hold expert stacks .* keep them whole"):
        check_expert_parallel(_plan(8), 2, skip=["llm"])


def test_experts_are_expert_stacks_and_others_are_refused():
    assert isinstance(Experts(4, 8, 4), ExpertStack)
    with pytest.raises(ValueError, match=r"experts must implement ExpertStack .* got \['Linear'\]"):
        Component(name="llm", module=nn.Linear(2, 2), experts=[nn.Linear(2, 2)])


def test_compressed_collectives_with_expert_parallelism_are_refused():
    with pytest.raises(ValueError, match="needs param_all_gather: exact and gradient_reduce: exact"):
        FSDP2Strategy(expert_parallel_size=2, gradient_reduce="fp8")

"""Expert parallelism under FSDP2: the plan's expert stacks sharded over an ``ep`` mesh dimension.

The expert-parallel ranks are carved out of the shard dimension (as torchtitan does)::

    dp_replicate x dp_shard                  every non-expert parameter: FSDP over all of it (as without EP)
    dp_replicate x ep_shard x ep             dp_shard = ep_shard x ep, ep innermost (consecutive ranks, one node)
        experts: each ep rank holds E / ep of them; FSDP shards those over ep_shard (HSDP with dp_replicate)

Each expert's gradient arrives summed over its ep group's tokens (the all-to-all's backward brings them home), so
the expert units divide their reduced gradients by the whole data-parallel size, as every other unit does, not by
their own mesh's size: training is that of plain data parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from forge_lightning.contracts import ParallelPlan
from forge_lightning.distributed.expert_parallel import ExpertParallel

EP_MESH_DIMS = ("ep_replicate", "ep_shard", "ep")


def expert_mesh(mesh: Any, ep: int) -> Any:
    """The ``ep_replicate x ep_shard x ep`` mesh over the ranks of a ``dp_replicate x dp_shard x cp x tp`` mesh
    (cp = tp = 1). Collective: every rank builds every group."""
    from torch.distributed.device_mesh import DeviceMesh

    R, S, C, T = mesh.mesh.shape
    if C * T != 1:
        raise ValueError(f"expert parallelism needs cp = tp = 1, got cp={C}, tp={T}")
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(R, S // ep, ep), mesh_dim_names=EP_MESH_DIMS)


def expert_fsdp_mesh(ep_mesh: Any) -> Any:
    """The mesh FSDP shards the experts over: ``ep_shard``, with ``ep_replicate`` as HSDP replicas when > 1."""
    return ep_mesh["ep_replicate", "ep_shard"] if ep_mesh["ep_replicate"].size() > 1 else ep_mesh["ep_shard"]


def check_expert_parallel(plan: ParallelPlan, ep: int, skip: Iterable[str]) -> None:
    """Check ``expert_parallel_size`` against the plan before anything is built.

    Raises:
        ValueError: no expert stacks to shard, expert stacks in a component kept whole (``skip``), or a stack whose
            ``num_experts`` the size does not divide.
    """
    if ep == 1:
        return
    skipped = set(skip)
    held = [c.name for c in plan if c.experts and c.name in skipped]
    if held:
        raise ValueError(
            f"expert_parallel_size={ep}, but components {held} hold expert stacks and are listed in "
            "unsharded_components / replicated_components, which keep them whole: shard them (remove them from "
            "those lists) or set expert_parallel_size: 1"
        )
    stacks = [s for c in plan if c.name not in skipped for s in c.experts]
    if not stacks:
        raise ValueError(
            f"expert_parallel_size={ep}, but the module's parallel plan declares no expert stacks "
            "(Component.experts): a dense model has no experts to spread; set expert_parallel_size: 1"
        )
    bad = sorted({s.num_experts for s in stacks if s.num_experts % ep})
    if bad:
        raise ValueError(
            f"expert_parallel_size ({ep}) must divide every MoE layer's num_experts, got {bad}: each "
            "expert-parallel rank holds an equal share of the experts"
        )


def apply_expert_parallel(plan: ParallelPlan, ep: ExpertParallel, skip: Iterable[str]) -> list[nn.Module]:
    """Keep this rank's experts in every expert stack of the plan's sharded components; return the stacks."""
    skipped = set(skip)
    stacks = [s for c in plan if c.name not in skipped for s in c.experts]
    for stack in stacks:
        stack.enable_expert_parallel(ep)
    rank_zero_info(
        f"expert parallelism: {len(stacks)} expert stacks over {ep.size} ranks "
        f"(overlapped dispatch {'on' if ep.overlap else 'off'})"
    )
    return stacks


def shard_experts(
    stacks: list[nn.Module], kwargs: dict[str, Any], divide_factor: int, *, force_sum: bool, reshard: bool
) -> None:
    """``fully_shard`` each expert stack as its own unit with ``kwargs`` (mesh: :func:`expert_fsdp_mesh`), its
    gradients divided by ``divide_factor`` (the data-parallel size) after the reduction.

    Args:
        stacks: the expert stacks (after :func:`apply_expert_parallel`).
        kwargs: ``fully_shard`` keyword arguments (mesh, mixed precision, offload).
        divide_factor: what the summed gradients are divided by.
        force_sum: reduce with a sum and divide afterwards (gloo has no pre-multiplied sum).
        reshard: free the gathered experts after forward.
    """
    from torch.distributed.fsdp import fully_shard

    for stack in stacks:
        fully_shard(stack, reshard_after_forward=reshard, **kwargs)
        stack.set_gradient_divide_factor(float(divide_factor))
        stack.set_force_sum_reduction_for_comms(force_sum)

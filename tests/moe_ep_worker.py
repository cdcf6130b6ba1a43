"""One rank of the expert-parallel checks (run on 2 and 4 gloo processes by tests/test_expert_parallel.py).

Every rank builds the same MoE block (fp32), routes its own share of one global batch through an expert-parallel
copy of it, and compares with the whole block on the whole batch on one process: the outputs of its tokens, the
gradients of its tokens' inputs, the router's and shared expert's gradients summed over all ranks, and its experts'
gradients summed over the ranks that hold the same experts.
"""

import copy
import sys

import torch
import torch.distributed as dist
from worker_exit import finish_worker

from forge_lightning.distributed.expert_parallel import ExpertParallel
from forge_lightning.modules.layers.moe import GatedSharedExpertMoE, MoEBlock, TopKRouter

E, K, D, W, T = 8, 2, 16, 8, 12  # experts, per token, width, expert width, tokens per rank


def _block(shared: bool) -> MoEBlock:
    torch.manual_seed(0)
    router = TopKRouter(D, E, K, norm_topk_prob=True)
    if shared:
        return GatedSharedExpertMoE(D, router, E, W, 24, init_std=0.1).float()
    return MoEBlock(D, router, E, W, init_std=0.1).float()


def _groups(world: int, ep_size: int) -> tuple:
    """Expert-parallel groups of consecutive ranks, and the groups of ranks holding the same experts."""
    rank, mine = dist.get_rank(), {}
    for name, groups in (
        ("ep", [list(range(g, g + ep_size)) for g in range(0, world, ep_size)]),
        ("same", [list(range(i, world, ep_size)) for i in range(ep_size)]),
    ):
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = group
    return mine["ep"], mine["same"]


def _case(ep_size: int, groups: tuple, *, overlap: bool, shared: bool, skew: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(world * T, D, generator=gen, dtype=torch.float32)
    grad_all = torch.randn(world * T, D, generator=gen, dtype=torch.float32)
    reference = _block(shared)
    if skew:  # every token prefers experts 0 and 1: the other ranks receive nothing
        x_all[:, 0] = x_all[:, 0].abs() + 2
        with torch.no_grad():
            reference.gate.weight[:, 0] = torch.tensor([3.0, 3.0] + [-3.0] * (E - 2))
    block = copy.deepcopy(reference)
    full = x_all.clone().requires_grad_()
    (reference(full) * grad_all).sum().backward()

    ep_group, same_group = groups
    block.experts.enable_expert_parallel(ExpertParallel(ep_group, overlap=overlap))
    mine = slice(rank * T, (rank + 1) * T)
    x = x_all[mine].clone().requires_grad_()
    out = block(x)
    (out * grad_all[mine]).sum().backward()
    errors = {"output": (out - reference(x_all)[mine]).abs().max().item()}
    errors["input_grad"] = (x.grad - full.grad[mine]).abs().max().item()
    local = block.experts.expert_parallel.local_experts(E)
    worst = 0.0
    for name, p in block.named_parameters():
        grad = p.grad.clone()
        ref = dict(reference.named_parameters())[name].grad
        if name.startswith("experts."):
            dist.all_reduce(grad, group=same_group)
            ref = ref[local.start : local.stop]
        else:
            dist.all_reduce(grad)
        worst = max(worst, (grad - ref).abs().max().item())
    errors["param_grad"] = worst
    counts = block.stats.tokens_per_expert.clone()
    dist.all_reduce(counts)
    errors["counts"] = (counts - reference.stats.tokens_per_expert).abs().max().item()
    to_last = float(
        counts[E - E // ep_size :].sum()
    )  # assignments to the last expert-parallel rank's experts
    return {
        "max_error": max(errors.values()),
        **errors,
        "local_experts": [local.start, local.stop],
        "to_last_rank": to_last,
    }


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for ep_size in sorted({2, world}):
        groups = _groups(world, ep_size)
        for overlap in (False, True):
            for shared in (False, True):
                results[f"ep{ep_size}_overlap{overlap}_shared{shared}"] = _case(
                    ep_size, groups, overlap=overlap, shared=shared
                )
        results[f"ep{ep_size}_skewed"] = _case(ep_size, groups, overlap=True, shared=True, skew=True)
    try:
        ExpertParallel(dist.group.WORLD).local_experts(world + 1)  # 5 experts over 4 ranks
    except ValueError as err:
        results["error"] = str(err)
    finish_worker(out, rank, results)


if __name__ == "__main__":
    main()

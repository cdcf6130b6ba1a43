"""Training with replicated experts equals training without (fp32), the token split is by index, and a re-plan
carries weights and optimizer state."""

import copy

import numpy as np
import pytest
import torch

from forge_lightning.distributed.expert_placement import Placement, plan_replicas
from forge_lightning.modules.layers.moe import MoEBlock, TopKRouter
from forge_lightning.modules.layers.moe_replicas import ReplicatedExperts, split_by_index


def _placement(holders, shares, ep_size=4, slots_per_rank=3):
    return Placement(
        ep_size=ep_size, ranks_per_node=2, slots_per_rank=slots_per_rank, holders=holders, shares=shares
    )


def test_split_by_index_gives_each_holder_its_share_in_token_order():
    experts_N = torch.tensor([0, 1, 0, 0, 1, 0, 2, 0])
    holders = torch.tensor([[0, 5, 6], [1, -1, -1], [2, -1, -1]])
    bounds = torch.tensor([[0, 0.4, 0.8, 1.0], [0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.float64)
    slots = split_by_index(experts_N, holders, bounds)
    # expert 0 has 5 assignments: floor(0.4 * 5) = 2 to the primary, floor(0.8 * 5) - 2 = 2 to slot 5, 1 to 6
    assert slots.tolist() == [0, 1, 0, 5, 1, 5, 2, 6]


def _block(num_experts=8):
    torch.manual_seed(0)
    return MoEBlock(16, TopKRouter(16, num_experts, 2), num_experts, 8, init_std=0.2).double().float()


def _train(block, batches, placements=None):
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2, weight_decay=0.1)
    for step, x in enumerate(batches):
        if placements and step in placements:
            block.experts.set_placement(placements[step], opt)
        opt.zero_grad()
        block(x).square().mean().backward()
        if placements:
            block.experts.sum_replica_grads()
        opt.step()
    return block


def test_training_with_replicas_equals_training_without():
    torch.manual_seed(1)
    batches = [torch.randn(2, 12, 16) for _ in range(5)]
    reference = _train(_block(), batches)
    block = _block()
    loads = np.array([40.0, 3, 2, 1, 30, 1, 1, 2])
    first = plan_replicas(loads, ep_size=4, ranks_per_node=2, slots_per_rank=3)
    second = plan_replicas(loads[::-1].copy(), ep_size=4, ranks_per_node=2, slots_per_rank=3)
    assert first.num_replicas > 0 and first.replica_pairs() != second.replica_pairs()
    block.experts = ReplicatedExperts(block.experts, first)
    _train(block, batches, placements={0: first, 3: second})  # a re-plan mid-training
    ref = dict(reference.named_parameters())
    for name, param in block.named_parameters():
        if "spare" not in name:
            torch.testing.assert_close(param, ref[name], rtol=1e-5, atol=1e-6)
    experts = block.experts
    used = torch.nonzero(experts.slot_expert >= 0).flatten()
    torch.testing.assert_close(
        experts.spare_gate_up_proj[used], experts.gate_up_proj[experts.slot_expert[used]]
    )
    assert torch.count_nonzero(experts.spare_down_proj[experts.slot_expert < 0]) == 0


def test_replicated_experts_refuses_a_placement_that_overfills_a_rank():
    block = _block()
    holders = ((0, 1, 1),) + tuple((e // 2,) for e in range(1, 8))
    bad = _placement(holders, ((0.4, 0.3, 0.3),) + ((1.0,),) * 7, slots_per_rank=3)
    with pytest.raises(ValueError, match="more than 1 replicas on rank 1"):
        ReplicatedExperts(copy.deepcopy(block.experts), bad)

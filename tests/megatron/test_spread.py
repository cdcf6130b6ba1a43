"""The spread encoder side's hand-over (strategies/megatron/spread.py) on a one-process gloo world: the features the
first stage assembles and the gradients it sends back. The layouts of several ranks are tested in test_vlm.py."""

import pytest
import torch
import torch.distributed as dist

from forge_lightning.strategies.megatron.spread import (
    StageGroups,
    backward_spread,
    encode_spread,
    step_shares,
)


@pytest.mark.parametrize(
    ("sizes", "size", "expected"),
    [
        ([3, 3, 3], 2, [[(0, [0, 1, 2]), (1, [0])], [(1, [1, 2]), (2, [0, 1, 2])]]),
        ([1, 1, 1, 1], 4, [[(0, [0])], [(1, [0])], [(2, [0])], [(3, [0])]]),  # one sample per micro-batch
        ([2], 4, [[], [(0, [0])], [], [(0, [1])]]),  # fewer samples than ranks: some encode none
        ([4, 1], 2, [[(0, [0, 1])], [(0, [2, 3]), (1, [0])]]),
    ],
)
def test_step_shares_cover_the_step_once(sizes, size, expected):
    shares = [[(m, rows.tolist()) for m, rows in step_shares(sizes, r, size)] for r in range(size)]
    assert shares == expected
    flat = [(m, i) for share in shares for m, rows in share for i in rows]
    assert flat == [(m, i) for m, count in enumerate(sizes) for i in range(count)]


def test_features_and_gradients_travel_whole(megatron_world):
    """Micro-batches of 2 and 3 samples, the first encoded in bf16 (as under autocast), the second to fp32 zeros
    without encoder work (a VLM's samples without images): the leaves hold the encodings in the wider dtype, and the
    leaves' gradients reach the encoder's weight through the bf16 cast."""
    world = dist.group.WORLD
    groups = StageGroups(tp=world, pp=world, first=0)
    weight = torch.randn(4, requires_grad=True)
    inputs = torch.randn(2, 3, 4)

    def encode_rows(m, rows):
        if m == 1:
            return torch.zeros(len(rows), 3, 4)
        return (inputs[rows] * weight).to(torch.bfloat16)

    step = encode_spread([2, 3], encode_rows, groups, device=torch.device("cpu"), requires_grad=True)
    assert [leaf.dtype for leaf in step.leaves] == [torch.float32] * 2
    assert all(leaf.requires_grad and leaf.grad_fn is None for leaf in step.leaves)
    torch.testing.assert_close(step.leaves[0], (inputs * weight).to(torch.bfloat16).float(), rtol=0, atol=0)
    assert torch.equal(step.leaves[1], torch.zeros(3, 3, 4))
    grad_BNH = torch.randn(2, 3, 4)
    step.leaves[0].grad = grad_BNH
    # the second leaf gets no gradient (as a micro-batch the schedule does not reach it with): zeros are sent
    backward_spread(step, groups)
    expected = (inputs * grad_BNH.to(torch.bfloat16).float()).sum((0, 1))
    torch.testing.assert_close(weight.grad, expected, rtol=1e-5, atol=1e-5)

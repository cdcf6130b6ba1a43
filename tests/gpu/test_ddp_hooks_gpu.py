"""The DDP compression hooks on CUDA, where they run on a side stream (run on a GPU machine: ``-m gpu``).

One NCCL process: the all-reduce of one rank is the identity, so the averaged gradients must equal the local ones
exactly for the exact parts and within FP8 / bf16 rounding for the compressed ones. A reducer that read a bucket
before the side stream finished would see stale or zero gradients, which these bounds catch.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from forge_lightning.strategies.comm.hooks import CommHookState, exact_parameters, make_comm_hook

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_group(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("hook", "rel"), [("bf16", 2.0**-8), ("fp8", 2.0**-3)])
def test_hook_gradients_match_local_gradients(nccl_group, hook, rel):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 256), *[nn.Linear(256, 256) for _ in range(8)]).cuda()
    reference = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    state = CommHookState(exact_params=exact_parameters(model), min_compress_numel=0)
    ddp.register_comm_hook(state, make_comm_hook(hook))
    tokens = torch.randint(0, 512, (64, 32), device="cuda")
    for _ in range(3):  # the bucket layout is rebuilt after the first step
        ddp.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        ddp(tokens).square().mean().backward()
        reference(tokens).square().mean().backward()
        torch.cuda.synchronize()
        for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
            exact = id(got) in state.exact_params
            tol = 0.0 if exact else rel * want.grad.abs().max().item()
            assert (got.grad - want.grad).abs().max().item() <= tol, name
    assert state.compressed_numel > 0 and state.exact_numel > 0

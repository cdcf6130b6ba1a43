"""One rank of the 2-process checks in test_comm.py: ``python _dist_worker.py RANK WORLD STORE_FILE OUT_DIR``."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from worker_exit import exit_worker


def _count_bytes(sent: dict[str, int]) -> None:
    """Wrap the collectives the FP8 path uses to count the bytes this rank sends to other ranks."""
    world = dist.get_world_size()
    a2a, gather = dist.all_to_all_single, dist.all_gather_into_tensor

    def all_to_all_single(output, input, *args, **kwargs):
        sent["bytes"] += input.numel() * input.element_size() * (world - 1) // world
        return a2a(output, input, *args, **kwargs)

    def all_gather_into_tensor(output, input, *args, **kwargs):
        sent["bytes"] += input.numel() * input.element_size() * (world - 1)
        return gather(output, input, *args, **kwargs)

    dist.all_to_all_single, dist.all_gather_into_tensor = all_to_all_single, all_gather_into_tensor


def fp8_check(rank: int, world: int) -> dict:
    from forge_lightning.strategies.comm import fp8_all_reduce_, fp8_all_reduce_bytes

    n = 10_000  # not a multiple of world x 256: exercises the padding
    gen = torch.Generator().manual_seed(rank)
    # Gradient-like values spanning six orders of magnitude across blocks.
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 0, n)[torch.randperm(n, generator=gen)]
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    exact = torch.stack(everyone).mean(0)
    sent = {"bytes": 0}
    _count_bytes(sent)
    approx = fp8_all_reduce_(x.clone())
    # e4m3 rounds to 3 mantissa bits (relative error <= 2^-4) twice: on each rank's values, then on the mean;
    # values below the block's subnormal range add at most scale * 2^-10.
    bound = (torch.stack(everyone).abs().mean(0) + exact.abs()) / 16 + x.abs().max() / 448 / 512
    err = (approx - exact).abs()
    return {
        "within_bound": bool((err <= bound).all()),
        "max_err_over_bound": float((err / bound).max()),
        "rel_l2": float(err.norm() / exact.norm()),
        "bytes_counted": sent["bytes"],
        "bytes_formula": fp8_all_reduce_bytes(n, world),
        "bf16_ring_bytes": 2 * (world - 1) * n * 2 // world,
    }


def export_check(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from forge_lightning.strategies.distributed_checkpoint import full_model_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Sequential(nn.Linear(33, 8), nn.LayerNorm(8)))
    reference = {k: v.clone() for k, v in model[2].state_dict().items()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = type(model[2][0].weight).__name__
    full = full_model_state_dict(model, model[2])
    same = sorted(full) == sorted(reference) and all(torch.equal(full[k], reference[k]) for k in reference)
    return {
        "sharded_type": sharded,
        "keys": sorted(full),
        "equal": same,
        "device": str(next(iter(full.values())).device) if full else "",
    }


def main() -> None:
    rank, world, store_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    result = {"export": export_check(rank, world), "fp8": fp8_check(rank, world)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    exit_worker()


if __name__ == "__main__":
    main()

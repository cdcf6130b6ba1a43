"""One rank of the Wan DiT's context-parallel checks (run on 2 and 4 gloo processes by
tests/diffusion/test_context_parallel_dit.py).

Every case runs the same tiny perturbed DiT on the same inputs twice on each rank: whole (the one-process reference)
and split over the ranks (a ``SplitSequence`` layout), each followed by the backward of ``(out * g).sum()`` for one
fixed ``g``. It writes the largest difference between the two outputs (the split one gathered on every rank), relative to the
reference's largest magnitude, and between every parameter's gradient (the split one summed over the ranks and
divided by their count, as FSDP's mean over ``dp_shard x cp`` does), relative to the largest gradient of any
parameter (some, e.g. key biases, have gradients near 0 by symmetry: relative to their own, rounding would look
large).
"""

import copy
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from worker_exit import finish_worker

from forge_lightning.contracts import Component, ParallelPlan
from forge_lightning.distributed.context_parallel import ContextParallel
from forge_lightning.distributed.split_sequence import SplitSequence
from forge_lightning.modules.diffusion import WanDiT, preset
from forge_lightning.performance.transforms import apply_activation_checkpointing
from forge_lightning.strategies.fsdp2 import context_parallel_of

T2V = preset("debug", in_channels=4, out_channels=4)
I2V = preset("debug", in_channels=8, out_channels=4, image_dim=20, added_kv_proj_dim=24)
# Latent sizes (frames, height, width) with patch (1, 2, 2): 2 x 2 x 4 = 16 tokens split evenly over 2 and 4 ranks;
# 3 x 3 x 3 = 27 padded to 28.
EVEN, ODD = (2, 4, 8), (3, 6, 6)
PACKED = [((3, 6, 8), 7), ((1, 4, 4), 3), ((2, 2, 6), 5)]  # 36 + 4 + 6 = 46 tokens: padded to 48


def _model(config, dtype: torch.dtype) -> WanDiT:
    torch.manual_seed(0)
    model = WanDiT(config).to(dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the initialisation (a zero output projection would hide everything)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=dtype))
    return model


def _batch(
    size: tuple[int, int, int], dtype: torch.dtype, per_token: bool
) -> Callable[[WanDiT], torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    video = torch.randn(2, 4, *size, generator=gen, dtype=dtype)
    tokens = size[0] * (size[1] // 2) * (size[2] // 2)
    timestep = torch.rand(2, tokens, generator=gen) * 1000 if per_token else torch.tensor([10.0, 700.0])
    text = torch.randn(2, 6, 16, generator=gen, dtype=dtype)
    return lambda model: model(video, timestep, text)


def _packed(dtype: torch.dtype) -> Callable[[WanDiT], torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    videos = [torch.randn(8, *size, generator=gen, dtype=dtype) for size, _ in PACKED]
    timesteps = [torch.tensor(100.0 * i + 5) for i in range(len(PACKED))]
    texts = [torch.randn(n, 16, generator=gen, dtype=dtype) for _, n in PACKED]
    images = [torch.randn(5, 20, generator=gen, dtype=dtype) for _ in PACKED]

    def run(model: WanDiT) -> torch.Tensor:
        outs = model.forward_packed(videos, timesteps, texts, images)
        return torch.cat([o.flatten() for o in outs])

    return run


def _case(
    cp: ContextParallel,
    config,
    run: Callable[[WanDiT], torch.Tensor],
    dtype: torch.dtype,
    checkpointed: bool = False,
) -> dict:
    whole = _model(config, dtype)
    split = copy.deepcopy(whole)
    split.set_sequence_layout(SplitSequence(cp))
    if (
        checkpointed
    ):  # after the layout, as FSDP2Strategy orders them: blocks recomputed (attention too) in backward
        plan = ParallelPlan(components=[Component(name="dit", module=split, blocks=split.repeated_blocks())])
        apply_activation_checkpointing(plan, "full")
    reference = run(whole)
    grad_out = torch.randn(reference.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    (reference * grad_out).sum().backward()
    out = run(split)
    (out * grad_out).sum().backward()
    errors = {"output": ((out - reference).abs().max() / reference.abs().max()).item()}
    by_name, scale = {}, max(p.grad.abs().max().item() for p in whole.parameters())
    for (name, p), q in zip(whole.named_parameters(), split.parameters(), strict=True):
        grad = q.grad.clone()
        dist.all_reduce(grad, group=cp.group)
        by_name[name] = (grad / cp.size - p.grad).abs().max().item() / scale
    errors["worst_gradient"] = max(by_name, key=by_name.get)
    errors["gradients"] = by_name[errors["worst_gradient"]]
    return errors


def _cases(name: str, cp: ContextParallel) -> dict:
    f64, f32 = torch.float64, torch.float32
    return {
        f"{name}_even": _case(cp, T2V, _batch(EVEN, f64, False), f64),
        f"{name}_padded": _case(cp, T2V, _batch(ODD, f64, False), f64),
        f"{name}_per_token_timesteps": _case(cp, T2V, _batch(ODD, f64, True), f64),
        f"{name}_packed": _case(cp, I2V, _packed(f64), f64),
        f"{name}_fp32": _case(cp, T2V, _batch(ODD, f32, False), f32),
    }


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ring = ContextParallel(dist.group.WORLD, comm_type="p2p")
    results = _cases("ring", ring)
    if world == 2:
        results |= _cases("ulysses", ContextParallel(dist.group.WORLD, comm_type="a2a"))
        # Each rank holding two chunks, not in sequence order: split and gather follow the chunk order.
        chunked = ContextParallel(dist.group.WORLD, (0, 3, 1, 2), comm_type="p2p")
        results["ring_chunk_order_packed"] = _case(chunked, I2V, _packed(torch.float64), torch.float64)
        results["ring_checkpointed_packed"] = _case(ring, I2V, _packed(torch.float64), torch.float64, True)
    if world == 4:
        # FSDP2Strategy's groups on its mesh (1 x 1 x cp 4 x 1): Ulysses pairs {0, 1}, {2, 3}, rings {0, 2}, {1, 3}.
        mesh = init_device_mesh(
            "cpu", (1, 1, world, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp")
        )
        results |= _cases("hybrid", context_parallel_of(mesh, "hybrid", ulysses=2))
        try:  # the debug DiT's 2 heads over 4 Ulysses ranks
            _case(ContextParallel(dist.group.WORLD), T2V, _batch(EVEN, torch.float64, False), torch.float64)
        except ValueError as err:
            results["error"] = str(err)
    finish_worker(out, rank, results)


if __name__ == "__main__":
    main()

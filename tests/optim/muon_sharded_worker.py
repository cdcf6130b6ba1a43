"""One rank of ``ShardedExchange``'s checks (run on 2 and 4 gloo processes by tests/optim/test_muon_sharded.py).

Every case builds DTensor parameters on a CPU mesh (``distribute_tensor``, or real ``fully_shard`` /
``parallelize_module`` parameters), then on every rank: gathers their local pieces, compares each full matrix an
owner receives with ``full_tensor()``, publishes ``full * 2 + index`` and reassembles each rank's pieces into a
DTensor whose ``full_tensor()`` must equal that function of the parameter, and publishes the gathered matrices
back unchanged (the round trip must give every rank exactly its local pieces). It writes, per case, the exactness
of each step, the owners, this rank's rank in each parameter's group, the group sizes, the costs and the number of
``all_to_all_single`` calls one gather + publish made. The ``muon_*`` cases step ``Muon`` on DTensor params beside
one process and write the largest difference of the params.
"""

import math
import sys
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from worker_exit import finish_worker

from forge_lightning.optim.muon import Muon, SplitRows
from forge_lightning.optim.muon_exchange import LocalExchange, newton_schulz_flops
from forge_lightning.optim.muon_sharded import ShardedExchange, default_exchange


def _tensors(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def _distribute(shapes, mesh, placements, seed: int = 0) -> list[DTensor]:
    return [distribute_tensor(t, mesh, placements) for t in _tensors(shapes, seed)]


def _cost(shape) -> float:
    return newton_schulz_flops(shape) if len(shape) >= 2 else float(math.prod(shape))


def _group_size(p: DTensor) -> int:
    return math.prod(p.device_mesh.size(d) for d, pl in enumerate(p.placements) if not pl.is_replicate())


def _promoted(dtypes) -> torch.dtype:
    dtype = dtypes[0]
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    return dtype


def _check(
    params: list[DTensor], wire_dtype: torch.dtype | None = None, local_dtype: torch.dtype | None = None
) -> dict:
    """``local_dtype``: the local tensors are cast to it before the gather (as Muon casts to ``ns_dtype``)."""
    costs = [_cost(p.shape) for p in params]
    exchange = ShardedExchange(params, costs, wire_dtype=wire_dtype)
    local = [p.to_local().to(local_dtype or p.dtype) for p in params]
    gathered = wire_dtype or _promoted([t.dtype for t in local])
    published = wire_dtype or _promoted([p.dtype for p in params])
    refs = [p.full_tensor().to(gathered) for p in params]  # collectives: every rank, same order
    with mock.patch.object(dist, "all_to_all_single", wraps=dist.all_to_all_single) as a2a:
        full = exchange.gather(local)
        outs = exchange.publish({i: full[i] * 2 + i for i in full})
    round_trip = exchange.publish(exchange.gather(local))
    publish = []
    for i, (p, out) in enumerate(zip(params, outs, strict=True)):
        back = DTensor.from_local(out, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        expected = (refs[i] * 2 + i).to(published)
        publish.append(
            out.shape == local[i].shape
            and out.dtype == published
            and torch.equal(back.full_tensor(), expected)
        )
    return {
        "owners": exchange.owners,
        "ranks": exchange.ranks,
        "owned": sorted(full),
        "is_owner": [exchange.is_owner(i) for i in range(len(params))],
        "gather": all(torch.equal(full[i], refs[i]) and full[i].dtype == gathered for i in full),
        "publish": publish,
        "round_trip": [
            torch.equal(a, b.to(gathered).to(published)) and a.dtype == published
            for a, b in zip(round_trip, local, strict=True)
        ],
        "group_sizes": [_group_size(p) for p in params],
        "costs": costs,
        "buckets": len(exchange.groups),
        "comm_buckets": sum(g is not None for g in exchange.groups),
        "all_to_all": a2a.call_count,
        "local_shapes": [list(t.shape) for t in local],
    }


UNEVEN = [(5, 3), (3, 7), (1, 4), (6, 8), (3, 4, 5)]  # 3 x 4 x 5: a stack of 3 experts, split unevenly


def _many() -> list[tuple[int, ...]]:
    return [(3 + i % 5, 2 + (i * 7) % 9) if i % 4 else (2 + i % 3, 3, 4) for i in range(20)]


def _fsdp2(mesh) -> list[DTensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7, bias=False), nn.Embedding(3, 4))
    fully_shard(model, mesh=mesh)
    return list(model.parameters())


def _fsdp2_tp(tp_mesh, dp_mesh) -> list[DTensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 7))
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=dp_mesh)
    return list(model.parameters())


def _strategy_mesh(shape: tuple[int, int, int, int]):
    """``FSDP2Strategy``'s mesh and its flattened dims."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


MUON_SHAPES = [(16, 16), (24, 8), (8, 24), (3, 10, 6), (16, 8), (10,), (6, 5)]  # five matrices, then AdamW's


def _muon(params: list[nn.Parameter]) -> Muon:
    opt = Muon(
        [
            {"params": params[:5], "use_muon": True},
            {"params": params[5:], "use_muon": False, "lr": 3e-3, "weight_decay": 0.05},
        ],
        lr=0.02,
    )
    opt.set_matrix_split(params[4], SplitRows([8, 8]))
    return opt


def _muon_steps(mesh, matrix: list, vector: list, wire_dtype: torch.dtype | None = None) -> dict:
    """Muon for 3 steps on DTensors placed by ``matrix`` / ``vector`` (its default exchange, or a
    ``ShardedExchange`` with ``wire_dtype``) against the same on whole tensors in one process: the largest
    difference of the params, and the all_to_all calls made."""
    whole = [nn.Parameter(t) for t in _tensors(MUON_SHAPES, 20)]
    sharded = [
        nn.Parameter(distribute_tensor(t.detach().clone(), mesh, matrix if t.ndim >= 2 else vector))
        for t in whole
    ]
    reference, opt = _muon(whole), _muon(sharded)
    reference.set_exchange_builder(lambda ps, costs: LocalExchange(len(ps)))
    if wire_dtype is not None:
        opt.set_exchange_builder(lambda ps, costs: ShardedExchange(ps, costs, wire_dtype=wire_dtype))
    with mock.patch.object(dist, "all_to_all_single", wraps=dist.all_to_all_single) as a2a:
        for step in range(3):
            for w, p, g in zip(whole, sharded, _tensors(MUON_SHAPES, 100 + step), strict=True):
                w.grad = g
                p.grad = distribute_tensor(g, mesh, p.placements)
            reference.step()
            opt.step()
    difference = max((p.full_tensor() - w).abs().max().item() for p, w in zip(sharded, whole, strict=True))
    return {"difference": difference, "all_to_all": a2a.call_count}


def _errors(mesh) -> dict:
    errors = {}
    sharded = _distribute([(4, 4)], mesh, [Shard(0)])
    try:
        default_exchange([*sharded, torch.zeros(2, 2)], [1.0, 1.0])
    except ValueError as err:
        errors["mixed"] = str(err)
    partial = [DTensor.from_local(torch.zeros(2, 2), mesh, [Partial()])]
    try:
        ShardedExchange(partial, [1.0])
    except ValueError as err:
        errors["partial"] = str(err)
    exchange = ShardedExchange(sharded, [1.0])
    try:
        exchange.gather([torch.zeros(3, 4)])
    except ValueError as err:
        errors["gather_shape"] = str(err)
    try:
        exchange.publish({} if exchange.is_owner(0) else {0: torch.zeros(4, 4)})
    except ValueError as err:
        errors["publish_keys"] = str(err)
    errors["default_dtensor"] = type(default_exchange(sharded, [1.0])).__name__
    errors["default_plain"] = type(default_exchange([torch.zeros(2, 2)], [1.0])).__name__
    return errors


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    results = {
        "shard_1d": _check(_distribute(UNEVEN, flat, [Shard(0)])),
        "shard_dim1": _check(_distribute([(5, 3), (2, 9), (4, 1)], flat, [Shard(1)], seed=1)),
        "many": _check(_distribute(_many(), flat, [Shard(0)], seed=2)),
        "replicated": _check(
            _distribute([(4, 3)], flat, [Replicate()], seed=3)
            + _distribute([(5, 2)], flat, [Shard(0)], seed=4)
        ),
        "fsdp2": _check(_fsdp2(flat)),
        "wire_bf16": _check(_distribute(UNEVEN, flat, [Shard(0)], seed=10), wire_dtype=torch.bfloat16),
        "mixed_dtypes": _check(
            [p.to(torch.bfloat16) for p in _distribute([(5, 3), (2, 2)], flat, [Shard(0)], seed=11)]
            + _distribute([(3, 7)], flat, [Shard(0)], seed=12)
        ),
        "bf16_locals": _check(_distribute(UNEVEN, flat, [Shard(0)], seed=13), local_dtype=torch.bfloat16),
        "errors": _errors(flat),
        "muon_shard": _muon_steps(flat, [Shard(0)], [Shard(0)]),
        "muon_shard_bf16_wire": _muon_steps(flat, [Shard(0)], [Shard(0)], wire_dtype=torch.bfloat16),
    }
    if world == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        unnamed = init_device_mesh("cpu", (2, 2))
        shapes = [(5, 3), (3, 7), (1, 4), (6, 2), (3, 4, 5)]
        results |= {
            "hsdp": _check(_distribute(shapes, hsdp, [Replicate(), Shard(0)], seed=5)),
            "dp_tp": _check(_distribute(shapes, dp_tp, [Shard(0), Shard(1)], seed=6)),
            "dp_tp_unnamed": _check(_distribute(shapes, unnamed, [Shard(0), Shard(1)], seed=7)),
            "mixed_meshes": _check(
                _distribute(shapes[:3], hsdp, [Replicate(), Shard(0)], seed=8)
                + _distribute(shapes[2:], dp_tp, [Shard(0), Shard(1)], seed=9)
            ),
            "fsdp2_hsdp": _check(_fsdp2(hsdp)),
        }
        results["muon_hsdp"] = _muon_steps(hsdp, [Replicate(), Shard(0)], [Replicate(), Shard(0)])
        results["muon_dp_tp"] = _muon_steps(dp_tp, [Shard(0), Shard(1)], [Shard(0), Replicate()])
        tp_params = _fsdp2_tp(dp_tp["tp"], dp_tp["dp"])
        results["fsdp2_tp"] = _check(tp_params) | {"placements": [str(p.placements) for p in tp_params]}
        # The strategy's FSDP over its flattened dp_shard x cp dims, on top of TP: sharded on (dp_shard_cp, tp).
        strategy = _strategy_mesh((1, 1, 2, 2))
        results["fsdp2_cp_tp"] = _check(_fsdp2_tp(strategy["tp"], strategy["dp_shard_cp"]))
    finish_worker(out, rank, results)


if __name__ == "__main__":
    main()

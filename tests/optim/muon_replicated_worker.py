"""One rank of Muon's replicated-exchange checks (run on 2 gloo processes by tests/optim/test_muon_replicated.py).

Every rank holds the same params and the same grads (as after DDP's all-reduce) and steps a ``Muon`` whose
exchange is a ``ReplicatedExchange`` (with and without ``shard_adamw_state``), beside the same optimizer in one
process (``LocalExchange``). It writes the largest difference between the two runs' params, which params' state
each rank keeps, how rank 0's consolidated state dict differs from the one-process one, and how runs resumed from
a full state dict (one process -> 2 ranks, 2 ranks -> one process) differ from uninterrupted ones; then the same
for DTensor params sharded by rows under a plain all-gather exchange.
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from worker_exit import finish_worker

from forge_lightning.optim.muon import Muon, SplitRows
from forge_lightning.optim.muon_exchange import LocalExchange, ReplicatedExchange, assign_owners

SHAPES = [(16, 16), (24, 8), (8, 24), (16, 16), (3, 10, 6), (16, 8), (10,), (6, 5)]
MUON = 6  # the first six are matrices; then a norm and an embedding for AdamW
FIRST, THEN = 3, 2


EVEN_SHAPES = [(4, 10, 6) if len(s) == 3 else s for s in SHAPES]  # rows that split evenly over 2 ranks


def _params(shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in shapes]


def _optimizer(params: list[torch.Tensor], distributed: bool, shard_adamw_state: bool) -> Muon:
    opt = Muon(
        [
            {"params": params[:MUON], "use_muon": True},
            {"params": params[MUON:], "use_muon": False, "lr": 3e-3, "weight_decay": 0.05},
        ],
        lr=0.02,
        shard_adamw_state=shard_adamw_state,
    )
    opt.set_matrix_split(params[5], SplitRows([8, 8]))
    if distributed:
        opt.set_exchange_builder(lambda ps, costs: ReplicatedExchange(ps, costs))
    else:
        opt.set_exchange_builder(lambda ps, costs: LocalExchange(len(ps)))
    return opt


def _run(opt: Muon, params: list[torch.Tensor], first: int, steps: int) -> None:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _state_diff(got: dict, want: dict) -> float | str:
    if sorted(got["state"]) != sorted(want["state"]):
        return f"state keys {sorted(got['state'])} != {sorted(want['state'])}"
    worst = 0.0
    for k, want_state in want["state"].items():
        if sorted(got["state"][k]) != sorted(want_state):
            return f"param {k}: {sorted(got['state'][k])} != {sorted(want_state)}"
        for name, value in want_state.items():
            worst = max(worst, (got["state"][k][name].float() - value.float()).abs().max().item())
    if got["param_groups"] != want["param_groups"]:
        return "param_groups differ"
    return worst


def _case(shard_adamw_state: bool) -> dict:
    reference = _params()
    one = _optimizer(reference, False, shard_adamw_state)
    _run(one, reference, 0, FIRST)
    one_state = copy.deepcopy(one.state_dict())  # loading shares tensors: keep one's own state apart

    params = _params()
    opt = _optimizer(params, True, shard_adamw_state)
    _run(opt, params, 0, FIRST)
    result = {
        "params": _max_diff(params, reference),
        "owners_muon": opt._muon_exchange.owners,
        "kept": sorted(i for i, p in enumerate(params) if p in opt.state),
    }
    opt.consolidate_state_dict()
    full = copy.deepcopy(opt.state_dict())
    result["consolidated"] = _state_diff(full, one_state) if dist.get_rank() == 0 else len(full["state"])

    # The full one-process dict on every rank, stepped on: equals the one process stepping on.
    resumed = [p.clone() for p in reference]
    opt2 = _optimizer(resumed, True, shard_adamw_state)
    opt2.load_state_dict(one_state)
    _run(opt2, resumed, FIRST, THEN)
    _run(one, reference, FIRST, THEN)
    result["one_to_two"] = _max_diff(resumed, reference)
    result["kept_after_load"] = sorted(i for i, p in enumerate(resumed) if p in opt2.state)

    # Rank 0's consolidated dict (broadcast to every rank) into one process, stepped on: equals the 2 ranks.
    shared = [full]
    dist.broadcast_object_list(shared, src=0)
    alone = [p.clone() for p in params]
    opt3 = _optimizer(alone, False, shard_adamw_state)
    opt3.load_state_dict(shared[0])
    _run(opt3, alone, FIRST, THEN)
    _run(opt, params, FIRST, THEN)
    result["two_to_one"] = _max_diff(alone, params)
    return result


class _RowShardExchange:
    """A plain exchange of DTensors sharded by rows over the group (even shards): owners all-gather each matrix,
    publish broadcasts each result whole and every rank keeps its rows. It checks Muon's DTensor handling; the
    project's FSDP2 exchange is tested on its own."""

    replicated = False

    def __init__(self, params, costs) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.owners = assign_owners(costs, self.world)
        self._shapes = [p.shape for p in params]
        self._dtypes = [p.dtype for p in params]

    def is_owner(self, index: int) -> bool:
        return self.owners[index] == self.rank

    def gather(self, local):
        full = {}
        for i, t in enumerate(local):
            shards = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(shards, t.contiguous())
            if self.is_owner(i):
                full[i] = torch.cat(shards)
        return full

    def publish(self, results):
        out = []
        for i, shape in enumerate(self._shapes):
            whole = results[i] if self.is_owner(i) else torch.empty(shape, dtype=self._dtypes[i])
            dist.broadcast(whole, src=self.owners[i])
            out.append(whole.chunk(self.world)[self.rank])
        return out


def _dtensor_case() -> dict:
    """Row-sharded DTensor params (every shape's rows split evenly over 2 ranks) equal one process."""
    reference = _params(EVEN_SHAPES)
    one = _optimizer(reference, False, False)
    _run(one, reference, 0, FIRST + THEN)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = [distribute_tensor(p, mesh, [Shard(0)]) for p in _params(EVEN_SHAPES)]
    opt = _optimizer(params, False, False)
    opt.set_exchange_builder(lambda ps, costs: _RowShardExchange(ps, costs))
    for step in range(FIRST + THEN):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, [Shard(0)])
        opt.step()
    states = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.ndim > 0]
    return {
        "params": _max_diff([p.full_tensor() for p in params], reference),
        "state_is_dtensor": all(isinstance(v, DTensor) for v in states) and len(states) == MUON + 4,
    }


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {"replicated": _case(False), "shard_adamw_state": _case(True)}
    params = _params()
    default = Muon([{"params": params[:MUON], "use_muon": True}])
    _run(default, params, 0, 1)
    results["default_exchange"] = type(default._muon_exchange).__name__
    results["dtensor"] = _dtensor_case()
    finish_worker(out, rank, results)


if __name__ == "__main__":
    main()

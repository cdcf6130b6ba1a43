"""``ShardedExchange`` on DTensors: ``muon_sharded_worker.py`` on 2 and 4 gloo processes (one set of processes per
world size for every case).

Cases on 2 and 4 ranks: a 1-D ``Shard(0)`` mesh with uneven shapes (5 x 3, 3 x 7), fewer rows than ranks (1 x 4:
empty shards) and a 3-D expert stack (3 x 4 x 5); ``Shard(1)``; 20 parameters in one call; a replicated parameter
beside a sharded one; real ``fully_shard`` parameters; a bf16 wire for fp32 parameters; bf16 and fp32 parameters
in one bucket (exchanged in fp32); fp32 parameters gathered from bf16 local tensors (in bf16) and published in
fp32. On 4 ranks also: HSDP (2 x 2: Replicate, Shard(0)); dp x tp (2 x 2: Shard(0), Shard(1)) on a named and an
unnamed mesh; parameters of both meshes in one exchange; ``fully_shard`` on the HSDP mesh; ``fully_shard`` over
``parallelize_module``'s TP (strided shards) on a dp x tp mesh and on ``FSDP2Strategy``'s mesh layout (FSDP over
its flattened ``dp_shard_cp`` dim).

In each, the owners' gathered matrices must equal ``full_tensor()`` exactly, each rank's published piece of
``full * 2 + index`` must reassemble into exactly that tensor, and publishing the gathered matrices must give back
every local piece exactly. ``Muon`` itself on DTensor params (1-D, HSDP, dp x tp), with its default exchange and
with a bf16 wire, must equal one process exactly after 3 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from procs import run_workers

from forge_lightning.optim.muon_exchange import LocalExchange, assign_owners
from forge_lightning.optim.muon_sharded import ShardedExchange, default_exchange

WORKER = Path(__file__).with_name("muon_sharded_worker.py")
CASES2 = ["shard_1d", "shard_dim1", "many", "replicated", "fsdp2", "wire_bf16", "mixed_dtypes", "bf16_locals"]
CASES4 = [*CASES2, "hsdp", "dp_tp", "dp_tp_unnamed", "mixed_meshes", "fsdp2_hsdp", "fsdp2_tp", "fsdp2_cp_tp"]


@pytest.fixture(scope="module")
def results2(tmp_path_factory) -> list[dict]:
    return run_workers(WORKER, 2, tmp_path_factory.mktemp("muon_sharded2"))


@pytest.fixture(scope="module")
def results4(tmp_path_factory) -> list[dict]:
    return run_workers(WORKER, 4, tmp_path_factory.mktemp("muon_sharded4"))


def _check(results: list[dict], name: str) -> None:
    cases = [r[name] for r in results]
    for rank, case in enumerate(cases):
        assert case["gather"], (rank, name)
        assert all(case["publish"]), (rank, case["publish"])
        assert all(case["round_trip"]), (rank, case["round_trip"])
        assert case["owned"] == [i for i, mine in enumerate(case["is_owner"]) if mine]
        assert case["owners"] == cases[0]["owners"]
        # One all_to_all_single per gather and one per publish in each group that communicates.
        assert case["all_to_all"] == 2 * case["comm_buckets"], case
    for i, size in enumerate(cases[0]["group_sizes"]):  # one owner in each replica of the parameter's group
        assert sum(case["is_owner"][i] for case in cases) == len(results) // size, (i, size)


@pytest.mark.parametrize("name", CASES2)
def test_two_ranks_gather_and_publish_exactly(results2, name):
    _check(results2, name)


@pytest.mark.parametrize("name", CASES4)
def test_four_ranks_gather_and_publish_exactly(results4, name):
    _check(results4, name)


def test_empty_shards_are_exchanged(results4):
    # 5, 3, 1 and 6 rows and 3 experts over 4 ranks: rank 3 holds no row of any of them, rank 1 none of 1 x 4.
    assert results4[3]["shard_1d"]["local_shapes"] == [[0, 3], [0, 7], [0, 4], [0, 8], [0, 4, 5]]
    assert results4[1]["shard_1d"]["local_shapes"][2] == [0, 4]
    assert results4[1]["shard_dim1"]["local_shapes"][2] == [4, 0]


@pytest.mark.parametrize("world", [2, 4])
def test_owners_balance_the_newton_schulz_flops(results2, results4, world):
    case = (results2 if world == 2 else results4)[0]["many"]
    assert case["owners"] == assign_owners(case["costs"], world)
    loads = [
        sum(c for c, o in zip(case["costs"], case["owners"], strict=True) if o == r) for r in range(world)
    ]
    assert max(loads) - min(loads) <= max(case["costs"])
    assert case["all_to_all"] == 2  # 20 parameters, one gather and one publish


def test_hsdp_replicas_own_the_same_parameters(results4):
    # Mesh (dp_replicate 2, dp_shard 2): ranks 0 / 2 and 1 / 3 are the same shard in the two replicas.
    for name in ("hsdp", "fsdp2_hsdp"):
        owned = [r[name]["owned"] for r in results4]
        assert owned[0] == owned[2] and owned[1] == owned[3], owned
        assert [r[name]["ranks"][0] for r in results4] == [0, 1, 0, 1]


def test_each_mesh_layout_exchanges_in_its_own_group(results4):
    mixed = results4[0]["mixed_meshes"]  # 3 HSDP parameters (group dp_shard), 3 dp x tp (the world)
    assert mixed["comm_buckets"] == 2 and mixed["all_to_all"] == 4
    assert [r["mixed_meshes"]["ranks"] for r in results4][2] == [0, 0, 0, 2, 2, 2]


def test_fsdp2_over_tensor_parallel_gives_strided_shards(results4):
    placements = results4[0]["fsdp2_tp"]["placements"]
    assert placements[0] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # colwise weight, FSDP on the TP dim
    assert placements[2] == "(Shard(dim=0), Shard(dim=1))"  # rowwise weight
    assert placements[3] == "(Shard(dim=0), Replicate())"  # rowwise bias: sharded on dp only, its own group


def test_a_replicated_parameter_is_owned_by_every_rank(results2):
    case = results2[0]["replicated"]
    assert [r["replicated"]["is_owner"][0] for r in results2] == [True, True]
    assert case["buckets"] == 2 and case["comm_buckets"] == 1


MUON_CASES = [
    (2, "muon_shard"),
    (2, "muon_shard_bf16_wire"),
    (4, "muon_shard"),
    (4, "muon_hsdp"),
    (4, "muon_dp_tp"),
]


@pytest.mark.parametrize(("world", "name"), MUON_CASES)
def test_muon_on_dtensors_equals_one_process(results2, results4, world, name):
    # Each rank's full params after 3 steps. The updates travel to their owners in bf16 (Muon casts them to
    # ns_dtype first) and come back in fp32, or in bf16 with the bf16 wire: exact either way.
    for case in (r[name] for r in (results2 if world == 2 else results4)):
        assert case["difference"] == 0.0, case
        assert case["all_to_all"] == 2 * 3  # the Muon matrices share one group: a gather and a publish a step


def test_bad_input_is_refused_by_name(results2):
    errors = results2[0]["errors"]
    assert "parameter 1 (shape (2, 2)) is a plain tensor while others are DTensors" in errors["mixed"]
    assert "has placement P(sum) on mesh dim 0" in errors["partial"]
    assert "local tensor 0 has shape (3, 4), expected this rank's piece (2, 4)" in errors["gather_shape"]
    assert "publish got results for parameters" in errors["publish_keys"]


def test_default_exchange_picks_by_tensor_kind(results2):
    errors = results2[0]["errors"]
    assert errors["default_dtensor"] == "ShardedExchange"
    assert errors["default_plain"] == "ReplicatedExchange"
    exchange = default_exchange([torch.zeros(2, 2)], [1.0])  # no process group here
    assert isinstance(exchange, LocalExchange) and exchange.owners == [0]


def test_plain_tensors_and_missing_costs_are_refused():
    with pytest.raises(
        ValueError, match=r"parameter 0 \(shape \(2, 2\)\) is a plain tensor: ShardedExchange"
    ):
        ShardedExchange([torch.zeros(2, 2)], [1.0])
    with pytest.raises(ValueError, match="got 1 parameters but 2 costs"):
        ShardedExchange([torch.zeros(2, 2)], [1.0, 2.0])

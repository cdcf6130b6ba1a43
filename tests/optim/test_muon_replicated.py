"""Muon over a ReplicatedExchange (DDP / ZeRO-1) equals one process: ``muon_replicated_worker.py`` on 2 gloo
processes with identical params and grads, with and without ``shard_adamw_state``.

Each rank keeps the state of the params it owns only; after ``consolidate_state_dict`` rank 0's state dict equals
the one-process one; a one-process state dict loaded on 2 ranks, and rank 0's consolidated one loaded in one
process, continue exactly as the uninterrupted runs. A plain row-sharded exchange of DTensor params (the worker's
own, not the FSDP2 one) checks that Muon steps DTensors on their local tensors and keeps DTensor state.
"""

from pathlib import Path

import pytest
from procs import run_workers

WORKER = Path(__file__).with_name("muon_replicated_worker.py")
CASES = ["replicated", "shard_adamw_state"]
MUON = 6  # worker's params: 6 Muon matrices, then 2 AdamW params


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_workers(WORKER, 2, tmp_path_factory.mktemp("muon_replicated"))


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process(results, case):
    for rank in results:
        assert rank[case]["params"] == 0.0, rank[case]


@pytest.mark.parametrize("case", CASES)
def test_each_rank_keeps_the_state_it_owns(results, case):
    owners = results[0][case]["owners_muon"]
    assert set(owners) == {0, 1}
    kept = [set(rank[case]["kept"]) for rank in results]
    for r in (0, 1):
        assert {i for i in kept[r] if i < MUON} == {i for i, o in enumerate(owners) if o == r}
        assert kept[r] == set(results[r][case]["kept_after_load"])
    adamw = [{i for i in k if i >= MUON} for k in kept]
    if case == "shard_adamw_state":
        assert adamw[0] | adamw[1] == {MUON, MUON + 1} and not adamw[0] & adamw[1]
    else:
        assert adamw[0] == adamw[1] == {MUON, MUON + 1}


@pytest.mark.parametrize("case", CASES)
def test_consolidated_state_dict_equals_one_process(results, case):
    assert results[0][case]["consolidated"] == 0.0
    assert results[1][case]["consolidated"] == len(results[1][case]["kept"])  # rank 1 keeps its own only


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direction", ["one_to_two", "two_to_one"])
def test_full_state_dict_resumes_exactly_at_another_world_size(results, case, direction):
    for rank in results:
        assert rank[case][direction] == 0.0, rank[case]


def test_default_exchange_of_plain_params_is_replicated(results):
    assert all(rank["default_exchange"] == "ReplicatedExchange" for rank in results)


def test_row_sharded_dtensors_equal_one_process(results):
    for rank in results:
        assert rank["dtensor"]["params"] == 0.0, rank["dtensor"]
        assert rank["dtensor"]["state_is_dtensor"]

"""Expert parallelism (forge_lightning.distributed.expert_parallel) equals the whole MoE block on one process.

``moe_ep_worker.py`` on 4 gloo processes (ep = 2: two groups of 2; ep = 4): with and without the
overlapped two-half schedule, with and without a shared expert, and with routing so skewed that one rank receives
no tokens. Each rank's outputs and input gradients, the router's / shared expert's gradients summed over the ranks
and each expert's gradient summed over the ranks holding it match one process at fp32 (1e-6).
"""

from pathlib import Path

import pytest
from procs import run_workers

WORKER = Path(__file__).with_name("moe_ep_worker.py")
CASES = [f"overlap{o}_shared{s}" for o in (False, True) for s in (False, True)] + ["skewed"]


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return run_workers(WORKER, 4, tmp_path_factory.mktemp("ep4"))


def _check(results: list[dict], ep: int, case: str) -> None:
    for rank, result in enumerate(results):
        got = result[f"ep{ep}_{case}"]
        assert got["max_error"] < 1e-6, got
        per = 8 // ep
        assert got["local_experts"] == [rank % ep * per, (rank % ep + 1) * per]
        if case == "skewed":
            assert got["to_last_rank"] == 0  # the last rank of each group received nothing


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_on_4_ranks_matches_one_process(results4, ep, case):
    _check(results4, ep, case)


def test_experts_not_divisible_by_the_group_are_refused(results4):
    assert "num_experts (5) must be divisible by the expert-parallel size (4)" in results4[0]["error"]

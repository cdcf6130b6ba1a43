"""Ulysses context parallelism on 2 gloo processes equals full-sequence attention (fp64, forward and backward)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("cp_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(out / "store"), str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("case", ["contiguous", "load_balanced", "packed_documents"])
def test_ulysses_matches_full_attention_outputs_and_gradients(results, case):
    for rank in results:
        assert rank[case]["shape"] == [2, 4, 8, 8]  # [B, H, S/P, D]: this rank's positions, all heads
        assert rank[case]["max_error"] < 1e-12, rank[case]


def test_heads_not_divisible_by_the_group_are_refused(results):
    assert "head count (3) divisible by the context-parallel size (2)" in results[0]["error"]

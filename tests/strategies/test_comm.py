"""FP8 gradient all-reduce against the exact mean (error bound, bytes on the wire) and HF-style full-state export
from FSDP2 shards, in one pair of gloo processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_dist_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    store = out / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(store), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=480)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_fp8_all_reduce_within_error_bound_of_exact_mean(results):
    for rank in results:
        fp8 = rank["fp8"]
        assert fp8["within_bound"], fp8["max_err_over_bound"]
        assert fp8["rel_l2"] < 0.05  # two roundings of ~3.6% RMS relative error each, partly cancelling


def test_fp8_all_reduce_bytes_match_formula_and_halve_bf16(results):
    for rank in results:
        fp8 = rank["fp8"]
        # 10,000 elements padded to 10,240 = 2 x 20 blocks of 256: each rank sends 5,120 payload bytes + 80
        # scale bytes in the all-to-all and the same again in the all-gather.
        assert fp8["bytes_counted"] == fp8["bytes_formula"] == 2 * (5120 + 20 * 4)
        assert fp8["bytes_counted"] / fp8["bf16_ring_bytes"] == pytest.approx(0.52, abs=0.005)


def test_full_state_dict_export_from_fsdp2_shards(results):
    exported = results[0]["export"]
    assert exported["sharded_type"] == "DTensor"
    assert exported["keys"] == ["0.bias", "0.weight", "1.bias", "1.weight"] and exported["equal"]
    assert exported["device"] == "cpu"
    assert results[1]["export"]["keys"] == []  # only rank 0 receives the full tensors

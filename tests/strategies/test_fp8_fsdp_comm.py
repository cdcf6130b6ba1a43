"""FSDP2 compressed collectives on 2 gloo processes: the delta-FP8 parameter all-gather (resharded and
ZeRO-2-like modes) and the FP8 / bf16 gradient reduce-scatter with error feedback, against FSDP2's exact
collectives. Bytes are counted on the collectives themselves. All checks share one pair of processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from forge_lightning.strategies.comm import (
    apply_fsdp_comm_options,
    check_fsdp_comm_options,
    enable_delta_fp8_all_gather,
    enable_fp8_reduce_scatter,
)

WORKER = Path(__file__).with_name("_fp8_fsdp_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(out / "store"), str(out)],
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


# ----- delta-FP8 all-gather ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("run", ["delta", "delta_resync", "zero2"])
def test_delta_all_gather_ranks_bit_identical_and_within_bound(results, run):
    for rank in results:
        r = rank[run]
        assert all(r["identical"])  # every rank, the shard owners included, computes with the same bits
        assert r["err"][0] == 0.0  # the first gather is exact
        assert all(r["bound_ok"]), r["err"]  # |error| <= |delta| / 16 + 2^-8 |x| per element, every step
        assert max(r["err"]) < r["update"][0] / 8  # far below one step's parameter change
        assert r["repeat_identical"]  # forwards without an optimizer step see the same parameters


def test_delta_all_gather_error_does_not_grow_with_steps(results):
    for rank in results:
        err = rank["delta"]["err"]  # 16 steps, never re-synced
        assert max(err[8:]) <= max(err[1:8])
        assert max(err) < 3e-4  # measured: 1.2e-4 .. 2.4e-4 (one or two bf16 ulps) for updates of ~3.4e-3


@pytest.mark.parametrize("run", ["delta_resync", "zero2"])
def test_delta_all_gather_resync_makes_the_error_zero(results, run):
    for rank in results:
        err = rank[run]["err"]  # re-sync every 4th gather / step: gathers 0, 4, 8 are exact
        assert err[0] == err[4] == err[8] == 0.0
        assert all(e > 0 for i, e in enumerate(err) if i % 4)


@pytest.mark.parametrize("run", ["delta", "zero2"])
def test_delta_all_gather_requested_resync_is_exact(results, run):
    for rank in results:
        assert rank[run]["err"][-1] > 0 and rank[run]["err_after_request"] == 0.0


def test_delta_all_gather_bytes_match_formula(results):
    for rank in results:
        r = rank["delta"]
        # 3 units (two blocks, the root): each delta gather sends payload + scales; the first is exact bf16.
        assert r["forward"][0] == r["bytes_formula_bf16"] == 8274
        assert all(b == r["bytes_formula_delta"] == 4209 for b in r["forward"][1:])
        assert r["bytes_formula_delta"] / r["bytes_formula_bf16"] == pytest.approx(0.509, abs=0.001)
        # Backward re-gathers reuse the reconstruction: backward sends only FSDP2's fp32 reduce-scatter.
        assert all(b == r["bytes_formula_fp32_reduce_scatter"] for b in r["backward"])
        assert r["stats"]["replays"] == 2 * 16  # both blocks, every backward
        resync = rank["delta_resync"]["forward"]
        assert [b == 8274 for b in resync] == [i % 4 == 0 for i in range(10)]


def test_zero2_delta_keeps_reconstruction_in_unsharded_parameters(results):
    for rank in results:
        r = rank["zero2"]
        assert r["forward"][1:] == [0] * 9  # parameters stay unsharded: no forward gathers after the first
        assert [b == r["bytes_formula_delta"] for b in r["step"]] == [i % 4 != 3 for i in range(10)]
        assert [b == r["bytes_formula_bf16"] for b in r["step"]] == [i % 4 == 3 for i in range(10)]
        assert r["stats"]["reconstruction_bytes"] == 0
        assert rank["delta"]["stats"]["reconstruction_bytes"] > 0


# ----- compressed reduce-scatter ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_reduce_scatter_within_error_bound_of_exact_mean(results, dtype):
    for rank in results:
        r = rank["reduce_scatter"][dtype]
        # fp8: |err| <= mean_r(|x_r| / 16 + amax_r / 448 / 1024); bf16: |err| <= mean_r(2^-8 |x_r|); fp32 sum.
        assert r["max_err_over_bound"] <= 1.0
        assert r["rel_l2"] < (0.03 if dtype == "fp8" else 0.003)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_reduce_scatter_bytes_match_formula(results, dtype):
    for rank in results:
        r = rank["reduce_scatter"][dtype]
        # 5,000 elements per rank: fp8 sends 5,000 payload bytes + 20 scales (the last block partial).
        assert r["bytes_counted"] == r["bytes_formula"] == (5000 + 20 * 4 if dtype == "fp8" else 10000)
        fsdp = rank["fsdp_reduce_scatter"]
        assert fsdp[dtype]["bytes_counted"] == fsdp[dtype]["bytes_formula"]
        assert fsdp["exact_bytes_counted"] == fsdp["exact_bytes_fp32_formula"]


def test_fsdp_sharded_gradients_close_to_exact_reduce_scatter(results):
    for rank in results:
        fsdp = rank["fsdp_reduce_scatter"]
        assert fsdp["fp8"]["rel_l2"] < 0.03
        # bf16 compute makes bf16 gradients: sending them as bf16 loses nothing, and the sum is fp32.
        assert fsdp["bf16"]["rel_l2"] < 1e-6


def test_error_feedback_keeps_the_sum_of_applied_gradients_on_track(results):
    for rank in results:
        ef = rank["reduce_scatter"]["error_feedback"]  # relative error of the 16-step sum
        assert ef["with"] * 4 < ef["without"]


# ----- training ---------------------------------------------------------------------------------------------------
def test_tiny_llm_losses_with_compressed_collectives(results):
    training = results[0]["training"]
    assert training["exact_options"] == training["plain"]  # the exact options install nothing
    for run in ("delta_fp8_rs", "zero2_delta_bf16_rs"):
        got, ref = torch.tensor(training[run]), torch.tensor(training["plain"])
        assert ((got - ref).abs() / ref).max() < 0.01
        assert got[0] == ref[0]  # the first step gathers exactly and reduces the same loss


# ----- options ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"param_all_gather": "fp8"}, "param_all_gather"),
        ({"gradient_reduce": "e5m2"}, "gradient_reduce"),
        ({"delta_resync_every": -1}, "delta_resync_every"),
        ({"delta_resync_every": 1.5}, "delta_resync_every"),
        ({"fp8_block": 0}, "fp8_block"),
        ({"delta_keep_unsharded": True}, "delta_keep_unsharded"),
    ],
)
def test_bad_options_raise_naming_the_option(kwargs, match):
    options = {"param_all_gather": "exact", "gradient_reduce": "exact", "delta_resync_every": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        check_fsdp_comm_options(**options)
    with pytest.raises(ValueError, match=match):
        apply_fsdp_comm_options(nn.Linear(2, 2), **options)


def test_enable_functions_validate_arguments_and_need_fully_shard():
    with pytest.raises(ValueError, match="block"):
        enable_delta_fp8_all_gather(nn.Linear(2, 2), block=0)
    with pytest.raises(ValueError, match="resync_every"):
        enable_delta_fp8_all_gather(nn.Linear(2, 2), resync_every=-2)
    with pytest.raises(ValueError, match="dtype"):
        enable_fp8_reduce_scatter(nn.Linear(2, 2), dtype="e4m3")
    with pytest.raises(ValueError, match="fully_shard"):
        enable_fp8_reduce_scatter(nn.Linear(2, 2))

"""The Wan DiT under context parallelism equals one process: ``cp_dit_worker.py`` on 2 gloo processes (Ulysses, ring,
ring with a permuted chunk order, ring with activation-checkpointed blocks) and 4 (ring, hybrid 2 x 2 on the groups
``FSDP2Strategy`` builds from its device mesh).

Cases: a sequence that splits evenly (16 tokens), one padded to a multiple of the ranks (27 -> 28), per-token
timesteps (Wan 2.2 TI2V) on it, and a packed I2V batch of 3 videos with their own texts and image tokens (46 tokens
-> 48: the document mask under Ulysses, segment channels under ring / hybrid). The output on every rank must equal
the one-process output to 1e-12 of its largest magnitude in fp64 (1e-6 in fp32), every parameter's gradient, summed
over the ranks and divided by their count, to 1e-7 of the largest gradient (fp32: 1e-6; measured at most 3e-8 and
2.4e-7): the DiT keeps its modulation and norms in fp32 even in an fp64 model (Wan's design), so its gradients carry
fp32 rounding whatever the summation order. The refusal of a module without ``enable_context_parallel`` is checked
here too (the degrees in ``tests/strategies/test_parallel_degrees.py``); ``tests/diffusion/test_module.py`` trains
under FSDP2 with ``context_parallel_size: 2``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import run_workers
from torch import nn

from forge_lightning.strategies.fsdp2 import _check_context_parallel

WORKER = Path(__file__).with_name("cp_dit_worker.py")
CASES = ["even", "padded", "per_token_timesteps", "packed", "fp32"]


@pytest.fixture(scope="module")
def results2(tmp_path_factory) -> list[dict]:
    return run_workers(WORKER, 2, tmp_path_factory.mktemp("cp_dit2"))


@pytest.fixture(scope="module")
def results4(tmp_path_factory) -> list[dict]:
    return run_workers(WORKER, 4, tmp_path_factory.mktemp("cp_dit4"))


def _check(results: list[dict], name: str) -> None:
    output, gradients = (1e-6, 1e-6) if name.endswith("fp32") else (1e-12, 1e-7)
    for rank, errors in enumerate(results):
        assert errors[name]["output"] < output, (rank, errors[name])
        assert errors[name]["gradients"] < gradients, (rank, errors[name])


@pytest.mark.parametrize("name", [f"{kind}_{case}" for kind in ("ulysses", "ring") for case in CASES])
def test_two_ranks_equal_one_process(results2, name):
    _check(results2, name)


def test_split_and_gather_follow_the_chunk_order(results2):
    _check(results2, "ring_chunk_order_packed")


def test_activation_checkpointing_recomputes_the_ring(results2):
    _check(results2, "ring_checkpointed_packed")


@pytest.mark.parametrize("name", [f"{kind}_{case}" for kind in ("ring", "hybrid") for case in CASES])
def test_four_ranks_equal_one_process(results4, name):
    _check(results4, name)


def test_ulysses_refuses_heads_that_do_not_split(results4):
    assert "head count (2) divisible by the context-parallel size (4)" in results4[0]["error"]


def test_a_module_without_the_contract_is_refused_by_name():
    _check_context_parallel(nn.Linear(2, 2), 1)  # no context parallelism: nothing asked
    with pytest.raises(
        TypeError, match=r"context_parallel_size=2, but Linear does not implement enable_context"
    ):
        _check_context_parallel(nn.Linear(2, 2), 2)

"""Data-parallel load balancing of ``VLMDataModule``: the balanced split's largest per-rank cost against the mean on
a skewed length distribution (printed), the loader's splits keep each global micro-batch's samples, and a real
2-process gloo step gives the global loss and gradients of the unbalanced run and of one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import assert_clean_exit
from vlm_pack_case import write_data

from forge_lightning.datamodules.loader import StepLoader
from forge_lightning.datamodules.vlm.balance import BalancedStepLoader, CostModel, balanced_partition

WORKER = Path(__file__).parent.parent / "vlm_balance_worker.py"
TOL = 1e-5


def _imbalance(costs: np.ndarray, parts: list[list[int]]) -> float:
    loads = np.array([costs[p].sum() for p in parts])
    return float(loads.max() / loads.mean())


def test_balanced_partition_evens_out_a_skewed_distribution() -> None:
    rng = np.random.default_rng(0)
    world, batch, steps = 8, 4, 50
    model = CostModel()
    before, after, bound = [], [], []
    for _ in range(steps):
        tokens = np.minimum(rng.lognormal(6.0, 1.0, world * batch).astype(int) + 16, 8192)  # long tail
        images = [list(rng.integers(64, 4096, rng.integers(0, 4))) for _ in tokens]  # 0-3 images
        costs = np.array([model.cost([int(n)], [int(p) for p in im]) for n, im in zip(tokens, images)])
        before.append(_imbalance(costs, [list(range(r * batch, (r + 1) * batch)) for r in range(world)]))
        parts = balanced_partition(costs.tolist(), world, batch)
        assert sorted(i for p in parts for i in p) == list(range(world * batch))
        assert all(len(p) == batch for p in parts)
        after.append(_imbalance(costs, parts))
        bound.append(max(1.0, costs.max() / (costs.sum() / world)))  # no split beats the costliest sample
    print(
        f"max / mean cost per rank over {steps} global batches of {world} x {batch}: contiguous "
        f"{np.mean(before):.2f}, balanced {np.mean(after):.2f} (lower bound {np.mean(bound):.2f})"
    )
    assert np.mean(before) > 1.5 and np.mean(after) < 1.15 and np.mean(after) < 1.05 * np.mean(bound)


def test_balanced_loader_splits_the_same_global_micro_batches() -> None:
    dataset = list(range(48))
    costs = [float((i * 37) % 11) ** 2 for i in dataset]
    options = dict(batch_size=3, num_replicas=4, accumulate=2, seed=5)
    plain = [StepLoader(dataset, rank=r, **options)._batch_indices(0, 0) for r in range(4)]
    balanced = [
        BalancedStepLoader(dataset, costs=costs, rank=r, **options)._batch_indices(0, 0) for r in range(4)
    ]
    for j in range(len(plain[0])):
        assert sorted(i for r in range(4) for i in balanced[r][j]) == sorted(
            i for r in range(4) for i in plain[r][j]
        )
        assert all(len(balanced[r][j]) == 3 for r in range(4))
    assert balanced != plain
    with pytest.raises(ValueError, match="3 costs for 48 items"):
        BalancedStepLoader(dataset, costs=[1.0, 2.0, 3.0], **options)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("vlm_balance")
    write_data(root)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(WORKER.parent), *sys.path]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(root / "store"), str(root), str(root)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert_clean_exit(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_two_rank_balanced_step_equals_unbalanced_and_one_process(ranks) -> None:
    single = ranks[0]["single"]
    for mode in ("unbalanced", "balanced"):
        for rank in ranks:
            torch.testing.assert_close(rank[mode]["loss"], single["loss"], atol=0, rtol=TOL, msg=mode)
            assert rank[mode]["grads"].keys() == single["grads"].keys()
            for name, grad in rank[mode]["grads"].items():
                error = (grad - single["grads"][name]).norm() / single["grads"][name].norm().clamp_min(1e-12)
                assert error < TOL, (mode, name, float(error))
    for j in range(
        2
    ):  # the micro-batches of the step: the same samples, split otherwise, the slower rank faster
        plain = [r["unbalanced"]["indices"][j] for r in ranks]
        balanced = [r["balanced"]["indices"][j] for r in ranks]
        assert sorted(plain[0] + plain[1]) == sorted(balanced[0] + balanced[1])
        worst = [max(r[mode]["cost"][j] for r in ranks) for mode in ("unbalanced", "balanced")]
        assert worst[1] <= worst[0]
    assert any(r["balanced"]["indices"] != r["unbalanced"]["indices"] for r in ranks)

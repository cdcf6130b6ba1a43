"""The router-load recorder on a tiny MoE run, and the placement simulator on a small trace."""

import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from forge_lightning.callbacks.router_load import RouterLoadRecorder, load_trace, save_trace
from forge_lightning.distributed.placement_sim import Layout, replay, synthetic_trace
from forge_lightning.modules.llm.module import CausalLM
from forge_lightning.tools.moe_placement import main as moe_placement


class _CountingBlocks(pl.Callback):
    """What the routers counted in each micro-batch, read independently of the recorder."""

    def __init__(self):
        self.counts = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counts.append(torch.stack([b.stats.tokens_per_expert for b in pl_module.model.moe_blocks()]))


def test_recorder_sums_micro_batches_per_step_and_writes_the_trace(tmp_path):
    torch.manual_seed(0)
    module = CausalLM(config="debug-moe", optimizer={"lr": 1e-3}, performance={"compile": False})
    tokens = torch.randint(0, 256, (6, 2, 17))
    data = DataLoader([{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens], batch_size=None)
    recorder = RouterLoadRecorder(tmp_path / "trace.npz", ep_size=4, description="tiny")
    counting = _CountingBlocks()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        accumulate_grad_batches=2,
        logger=CSVLogger(tmp_path, name="log"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, counting],
    )
    trainer.fit(module, data)
    loads, steps, meta = load_trace(tmp_path / "trace.npz")
    assert loads.shape == (3, 2, 8) and steps.tolist() == [1, 2, 3]
    expected = torch.stack(counting.counts).view(3, 2, 2, 8).sum(dim=1)  # two micro-batches per step
    np.testing.assert_array_equal(loads, expected.numpy())
    assert loads.sum(axis=-1).tolist() == [[2 * 2 * 16 * 2] * 2] * 3  # micro-batches x tokens x top-2
    assert meta["description"] == "tiny" and meta["num_experts"] == 8 and meta["top_k"] == 2
    header = (Path(trainer.log_dir) / "metrics.csv").read_text().splitlines()[0]
    assert "moe/load_max_over_mean" in header and "moe/ep_rank_load_max_over_mean" in header


def test_recorder_refuses_a_model_without_experts():
    module = CausalLM(config="debug", optimizer={"lr": 1e-3}, performance={"compile": False})
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="needs a model with MoE layers"):
        RouterLoadRecorder().on_train_start(trainer, module)


def test_recorder_refuses_blocks_that_ran_no_forward():
    module = CausalLM(config="debug-moe", optimizer={"lr": 1e-3}, performance={"compile": False})
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="MoE blocks ran no forward"):
        RouterLoadRecorder().on_train_batch_end(trainer, module, None, None, 0)


def test_replay_orders_the_methods_on_a_skewed_trace():
    loads = synthetic_trace(steps=14, layers=1, experts=32, assignments_per_step=4096, zipf=1.2, drift=0.05)
    results = replay(loads, Layout(ep_size=8, replica_sync_tokens=10.0), window=4, replan_every=5)
    plain, greedy, ours = results["plain EP"], results["greedy replication"], results["ours (topology-aware)"]
    assert plain["replicas"] == 0 and plain["moved_replicas_per_replan"] == 0
    assert ours["imbalance"] < plain["imbalance"] and ours["imbalance"] <= greedy["imbalance"] + 0.05
    assert ours["replicas"] > 0 and ours["planning_ms_max"] > 0


def test_simulate_command_writes_the_table_and_json(tmp_path, capsys):
    trace = tmp_path / "t.npz"
    loads = synthetic_trace(steps=8, layers=1, experts=64, assignments_per_step=8192, seed=1)
    save_trace(trace, loads, np.arange(1, 9), {"description": "synthetic test", "intermediate_size": 8})
    out = tmp_path / "r.json"
    moe_placement(["simulate", str(trace), "--ep", "8", "32", "--window", "3", "--replan-every", "2",
                   "--output", str(out)])  # fmt: skip
    table = capsys.readouterr().out
    assert table.count("| t | 8 |") == 3 and table.count("| t | 32 |") == 3
    record = json.loads(out.read_text())
    assert "simulate" in record["meta"]["command"] and len(record["runs"]) == 2
    assert record["runs"][0]["layout"]["replica_sync_tokens"] == 24.0  # 3 x intermediate_size


def test_a_file_that_is_not_a_trace_is_refused(tmp_path):
    np.savez(tmp_path / "x.npz", other=np.ones(2))
    with pytest.raises(ValueError, match="is not a router-load trace: it lacks loads, meta, steps"):
        load_trace(tmp_path / "x.npz")


def test_record_command_trains_a_small_moe_on_quickstart_data(tmp_path):
    from forge_lightning.tools.data import build_quickstart

    build_quickstart(tmp_path / "qs", vocab_size=300, max_bytes=200_000, workers=1)
    out = tmp_path / "rec.npz"
    moe_placement(["record", "--data", str(tmp_path / "qs"), "--output", str(out), "--steps", "3",
                   "--experts", "16", "--top-k", "2", "--batch-size", "2", "--seq-length", "32"])  # fmt: skip
    loads, steps, meta = load_trace(out)
    assert loads.shape == (3, 2, 16) and steps.tolist() == [1, 2, 3]
    assert (loads.sum(axis=-1) == 2 * 32 * 2).all()  # batch x sequence x top-2, every layer and step
    assert meta["description"].startswith("recorded: debug-moe LLM preset with 2 layers, 16 experts, top-2")


def test_record_command_names_the_missing_data(tmp_path):
    with pytest.raises(SystemExit, match="run `forge-data quickstart --output"):
        moe_placement(["record", "--data", str(tmp_path / "none"), "--output", str(tmp_path / "r.npz")])

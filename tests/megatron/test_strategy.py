"""MegatronStrategy trains the tiny LLM to the single-process losses of the native path (CPU, gloo, 2 processes).

One reference run of the default strategy (1 process, batch 4), then one ``fit`` per megatron layout at the same
global batch, through ``forge_entry.py`` (the forge CLI with the test-only CUDA shim). fp32, 3 steps.
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"
STRATEGY = "forge_lightning.strategies.megatron.MegatronStrategy"
STEPS = [0, 1, 2]


def _metrics(root: Path, name: str) -> list[dict[str, str]]:
    return list(csv.DictReader((root / "runs" / "tests" / name / "version_0" / "metrics.csv").open()))


def _column(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


@pytest.fixture(scope="module")
def runner(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")

    runs: dict[str, list[dict[str, str]]] = {}

    def run(name: str, *args: str, devices: int = 2, batch: int = 2) -> list[dict[str, str]]:
        if name in runs:  # one run per layout name, shared by the tests that read it
            return runs[name]
        cmd = [
            sys.executable,
            str(HERE / "forge_entry.py"),
            "fit",
            "--config",
            str(TINY_YAML),
            "--data.data_prefix",
            str(tiny_corpus["prefix"]),
            "--data.tokenizer",
            str(tiny_corpus["tokenizer"]),
            "--trainer.max_steps",
            "3",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.devices",
            str(devices),
            "--data.batch_size",
            str(batch),
            "--trainer.logger.init_args.name",
            name,
            *args,
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        runs[name] = _metrics(root, name)
        return runs[name]

    run.reference = run("reference", devices=1, batch=4)
    assert sorted(_column(run.reference, "train/loss")) == STEPS
    return run


def _assert_same_losses(rows, reference, tol=1e-5) -> None:
    losses, expected = _column(rows, "train/loss"), _column(reference, "train/loss")
    assert sorted(losses) == STEPS
    deltas = {s: abs(losses[s] - expected[s]) for s in STEPS}
    assert max(deltas.values()) <= tol, deltas


def _tp2(runner):
    return runner(
        "tp2", "--trainer.strategy", STRATEGY, "--trainer.strategy.tensor_model_parallel_size", "2", batch=4
    )


def _cp2(runner):
    return runner(
        "cp2", "--trainer.strategy", STRATEGY, "--trainer.strategy.context_parallel_size", "2", batch=4
    )


def test_tensor_parallel_matches_one_process_with_validation(runner):
    rows = _tp2(runner)
    _assert_same_losses(rows, runner.reference)
    val, expected = _column(rows, "val/loss"), _column(runner.reference, "val/loss")
    assert val and sorted(val) == sorted(expected)
    assert max(abs(val[s] - expected[s]) for s in val) <= 1e-5


def test_context_parallel_matches_one_process_with_validation(runner):
    """CP = 2 on 2 processes (DP = 1, so the data rank's batch is the reference's 4 rows): each rank trains on half
    of every sequence (megatron's load-balanced split) with Ulysses attention."""
    rows = _cp2(runner)
    _assert_same_losses(rows, runner.reference)
    val, expected = _column(rows, "val/loss"), _column(runner.reference, "val/loss")
    assert val and sorted(val) == sorted(expected)
    assert max(abs(val[s] - expected[s]) for s in val) <= 1e-5


def test_gradient_norm_counts_tensor_parallel_shards_once(runner):
    """Same global batch, weights whole (CP) or split (TP): megatron's clipping norm must agree; it does only if
    every tensor-parallel weight is tagged as such (a wrongly tagged shard is counted from TP rank 0 alone)."""
    tp, cp = _column(_tp2(runner), "train/grad_norm"), _column(_cp2(runner), "train/grad_norm")
    assert sorted(tp) == sorted(cp) == STEPS
    assert max(abs(tp[s] - cp[s]) / cp[s] for s in STEPS) <= 1e-5, (tp, cp)


def test_ring_context_parallel_matches_one_process(runner):
    """CP = 2 with ring attention (``cp_comm_type: p2p``): key/value blocks pass between the 2 ranks."""
    rows = runner(
        "cp2_p2p",
        "--trainer.strategy",
        STRATEGY,
        "--trainer.strategy.context_parallel_size",
        "2",
        "--trainer.strategy.cp_comm_type",
        "p2p",
        "--trainer.limit_val_batches",
        "0",
        batch=4,
    )
    _assert_same_losses(rows, runner.reference)


def test_sequence_parallel_matches_one_process(runner):
    rows = runner(
        "tp2_sp",
        "--trainer.strategy",
        STRATEGY,
        "--trainer.strategy.tensor_model_parallel_size",
        "2",
        "--trainer.strategy.sequence_parallel",
        "true",
        "--trainer.limit_val_batches",
        "0",
        batch=4,
    )
    _assert_same_losses(rows, runner.reference)


def test_pipeline_1f1b_matches_one_process(runner):
    rows = runner(
        "pp2",
        "--trainer.strategy",
        STRATEGY,
        "--trainer.strategy.pipeline_model_parallel_size",
        "2",
        "--trainer.accumulate_grad_batches",
        "2",
        "--trainer.limit_val_batches",
        "0",
    )
    _assert_same_losses(rows, runner.reference)


def test_distributed_optimizer_matches_one_process(runner):
    rows = runner(
        "dp2_distopt",
        "--trainer.strategy",
        STRATEGY,
        "--trainer.strategy.use_distributed_optimizer",
        "true",
        "--trainer.limit_val_batches",
        "0",
    )
    _assert_same_losses(rows, runner.reference)


def test_fused_adam_matches_one_process(runner):
    """Data parallel at TP = 1 (the fused linear + cross-entropy loss) with torch's fused AdamW kernel, which the
    ``performance.optimizer`` setting picks (``auto``: fused on CUDA)."""
    rows = runner(
        "dp2_fused_adam",
        "--trainer.strategy",
        STRATEGY,
        "--trainer.strategy.tensor_model_parallel_size",
        "1",
        "--performance.optimizer",
        "fused",
        "--trainer.limit_val_batches",
        "0",
    )
    _assert_same_losses(rows, runner.reference)


def test_pretrained_weights_read_per_rank_match_one_process(runner, tmp_path):
    """``model.init_args.pretrained`` under megatron: the CLI leaves the native model on the meta device and each
    TP rank reads its shards from the files; the losses are those of the native path loading the full model."""
    import torch
    import yaml

    from forge_lightning.modules.llm import CausalLM

    torch.manual_seed(123)  # weights unlike the seed-7 random initialisation of the reference
    config = yaml.safe_load(TINY_YAML.read_text())["model"]["init_args"]["config"]
    CausalLM(config=config).save_pretrained(tmp_path / "hf")
    pretrained = ("--model.init_args.pretrained", str(tmp_path / "hf"), "--trainer.limit_val_batches", "0")
    reference = runner("pretrained_reference", *pretrained, devices=1, batch=4)
    assert _column(reference, "train/loss")[0] != _column(runner.reference, "train/loss")[0]
    rows = runner(
        "pretrained_tp2",
        "--trainer.strategy",
        STRATEGY,
        "--trainer.strategy.tensor_model_parallel_size",
        "2",
        *pretrained,
        batch=4,
    )
    _assert_same_losses(rows, reference)


@pytest.fixture(scope="module")
def packed_args(tiny_corpus, tmp_path_factory):
    """CLI arguments for packed pretraining with the z-loss (``model.z_loss`` 0.01): the tiny corpus cut into
    100-character documents (~50 tokens: a row of 64 tokens holds parts of 2 or 3) with ``reset_position_ids``
    (``document_ids`` in the batches: attention within each document, positions restarting at each)."""
    from forge_lightning.datamodules import PretrainDataModule
    from forge_lightning.tools.data import main as forge_data

    root = tmp_path_factory.mktemp("short_documents")
    texts = [json.loads(line)["text"] for line in tiny_corpus["jsonl"].read_text().splitlines()]
    pieces = [t[i : i + 100] for t in texts for i in range(0, len(t), 100)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces))
    prefix = root / "short"
    tokenizer = str(tiny_corpus["tokenizer"])
    forge_data(
        [
            "pretrain",
            "--input",
            str(root / "docs.jsonl"),
            "--tokenizer",
            tokenizer,
            "--output-prefix",
            str(prefix),
        ]
    )
    data = PretrainDataModule(
        str(prefix),
        tokenizer,
        seq_length=64,
        batch_size=4,
        num_workers=0,
        pin_memory=False,
        reset_position_ids=True,
    )
    data.setup("fit")
    first = next(iter(data.train_dataloader()))
    assert first["document_ids"].amax(dim=1).sum() >= 4  # document boundaries inside the rows
    return (
        "--data.data_prefix",
        str(prefix),
        "--data.seq_length",
        "64",
        "--data.reset_position_ids",
        "true",
        "--trainer.limit_val_batches",
        "0",
        "--model.init_args.z_loss",
        "0.01",
    )


PACKED_LAYOUTS = {
    # TP = 2 + SP: the z-loss's logsumexp over the vocabulary split over the TP ranks.
    "packed_tp2_sp": (
        [
            "--trainer.strategy.tensor_model_parallel_size",
            "2",
            "--trainer.strategy.sequence_parallel",
            "true",
        ],
        4,
    ),
    "packed_pp2": (
        ["--trainer.strategy.pipeline_model_parallel_size", "2", "--trainer.accumulate_grad_batches", "2"],
        2,
    ),
    # Ulysses CP = 2: each rank holds half of every row; the document mask applies after the all-to-all.
    "packed_cp2": (["--trainer.strategy.context_parallel_size", "2"], 4),
}


@pytest.mark.parametrize("name", PACKED_LAYOUTS)
def test_packed_documents_and_z_loss_match_one_process(runner, packed_args, name):
    """Packed rows (``document_ids``, positions restarting per document) with the z-loss (``train/loss`` includes
    it, as natively) against the default strategy on one process."""
    reference = runner("packed_reference", *packed_args, devices=1, batch=4)
    layout, batch = PACKED_LAYOUTS[name]
    rows = runner(name, *packed_args, "--trainer.strategy", STRATEGY, *layout, batch=batch)
    _assert_same_losses(rows, reference)


def test_plain_data_loaders_are_split_over_data_parallel_ranks():
    """Lightning adds a DistributedSampler only for strategies it knows to be distributed."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from forge_lightning.strategies.megatron import MegatronStrategy

    trainer = Trainer(strategy=MegatronStrategy(), accelerator="cpu", devices=1, logger=False)
    assert trainer._accelerator_connector.is_distributed
    assert trainer._data_connector._requires_distributed_sampler(DataLoader(list(range(8))))


def test_adam_kernels_follow_the_performance_setting():
    """torch's Adam(W), megatron's fallback without TE / Apex, gets the fused kernel (``auto`` on CUDA only) and
    steps as the default implementation does; an optimizer that has stepped keeps its kernels."""
    import torch

    from forge_lightning.strategies.megatron.optimizer import _choose_kernels

    def stepped(implementation: str | None) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        param = torch.nn.Parameter(torch.linspace(-1, 1, 10))
        optimizer = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1)
        if implementation is not None:
            _choose_kernels(optimizer, implementation)
        for _ in range(3):
            param.grad = param.detach().sin()
            optimizer.step()
        return optimizer, param.detach()

    plain = stepped(None)[1]
    for implementation, fused in (("fused", True), ("foreach", False), ("auto", False)):
        optimizer, param = stepped(implementation)
        assert optimizer.param_groups[0]["fused"] is fused
        torch.testing.assert_close(param, plain, atol=1e-6, rtol=0)
    _choose_kernels(optimizer, "fused")
    assert optimizer.param_groups[0]["fused"] is False

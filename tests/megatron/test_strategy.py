"""MegatronStrategy trains the tiny LLM to the single-process losses of the native path (CPU, gloo, 2 processes).

One reference run of the default strategy (1 process, batch 4), then one ``fit`` per megatron layout at the same
global batch. fp32, 3 steps. The runs are listed in ``fit_plan`` and run as plan steps of conftest's ``fit_runs``
(the forge CLI with the test-only CUDA shim, one worker launch per process count for all modules' runs, see
fit_plan.py); each test reads its runs' metrics."""

import json
from pathlib import Path

import pytest
import torch
from fit_plan import PlanRuns, fit_step

HERE = Path(__file__).resolve().parent
HERE_STEM = Path(__file__).stem  # fit_plan's inputs are in fit_runs.root / HERE_STEM (conftest.py)
REPO = HERE.parents[1]
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"
STRATEGY = "forge_lightning.strategies.megatron.MegatronStrategy"
STEPS = [0, 1, 2]


def _column(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def _fit(corpus: dict[str, Path], name: str, *args: str, devices: int = 2, batch: int = 2) -> dict:
    """The plan step of ``forge fit`` of the tiny YAML for 3 steps on ``devices`` processes."""
    return fit_step(
        name,
        [
            "fit",
            "--config",
            str(TINY_YAML),
            "--data.data_prefix",
            str(corpus["prefix"]),
            "--data.tokenizer",
            str(corpus["tokenizer"]),
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
        ],
        nproc=devices,
    )


def _pretrained(root: Path) -> tuple[str, ...]:
    """CLI arguments loading the tiny LLM's weights from files, weights unlike the seed-7 random initialisation of
    the reference."""
    import torch
    import yaml

    from forge_lightning.modules.llm import CausalLM

    config = yaml.safe_load(TINY_YAML.read_text())["model"]["init_args"]["config"]
    with torch.random.fork_rng(devices=[]):  # this process's (CPU) random state stays as it was
        torch.manual_seed(123)
        CausalLM(config=config).save_pretrained(root / "hf")
    return ("--model.init_args.pretrained", str(root / "hf"), "--trainer.limit_val_batches", "0")


def _packed(tiny_corpus: dict[str, Path], root: Path) -> tuple[str, ...]:
    """CLI arguments for packed pretraining with the z-loss (``model.z_loss`` 0.01): the tiny corpus cut into
    100-character documents (~50 tokens: a row of 64 tokens holds parts of 2 or 3) with ``reset_position_ids``
    (``document_ids`` in the batches: attention within each document, positions restarting at each)."""
    from forge_lightning.tools.data import main as forge_data

    root.mkdir(parents=True)
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


# The callbacks that read or write the trained weights between steps (EMA's average, its evaluation swap, the
# export), under the distributed optimizer with the updated weights gathered after each step or lazily, in the
# next forward (overlap_param_gather): the runs must be the same to the bit.
DISTRIBUTED_OPTIMIZER_CALLBACKS = (
    *("--trainer.strategy.use_distributed_optimizer", "true"),
    *("--trainer.strategy.overlap_grad_reduce", "true"),
    "--trainer.callbacks+={class_path: forge_lightning.callbacks.ema.EMA, init_args: {decay: 0.5}}",
    "--trainer.callbacks+=forge_lightning.callbacks.HFExport",
)
PARAMETER_GATHER = {
    "dp2_gather_after_step": (),
    "dp2_gather_in_forward": ("--trainer.strategy.overlap_param_gather", "true"),
}


def fit_plan(tiny_corpus: dict[str, Path], root: Path) -> list[dict]:
    """Every run of this module (for conftest's ``fit_runs``), its inputs under ``root``: the 1-process references,
    then the 2-process layouts."""
    pretrained = _pretrained(root / "pretrained")
    packed = _packed(tiny_corpus, root / "short_documents")
    no_val = ("--trainer.limit_val_batches", "0")
    strategy = ("--trainer.strategy", STRATEGY)
    tp2 = (*strategy, "--trainer.strategy.tensor_model_parallel_size", "2")
    cp2 = (*strategy, "--trainer.strategy.context_parallel_size", "2")
    return [
        _fit(tiny_corpus, "reference", devices=1, batch=4),
        _fit(tiny_corpus, "pretrained_reference", *pretrained, devices=1, batch=4),
        _fit(tiny_corpus, "packed_reference", *packed, devices=1, batch=4),
        _fit(tiny_corpus, "tp2", *tp2, batch=4),
        _fit(tiny_corpus, "cp2", *cp2, batch=4),
        _fit(tiny_corpus, "cp2_p2p", *cp2, "--trainer.strategy.cp_comm_type", "p2p", *no_val, batch=4),
        _fit(tiny_corpus, "tp2_sp", *tp2, "--trainer.strategy.sequence_parallel", "true", *no_val, batch=4),
        _fit(
            tiny_corpus,
            "pp2",
            *strategy,
            "--trainer.strategy.pipeline_model_parallel_size",
            "2",
            "--trainer.accumulate_grad_batches",
            "2",
            *no_val,
        ),
        _fit(
            tiny_corpus,
            "dp2_distopt",
            *strategy,
            "--trainer.strategy.use_distributed_optimizer",
            "true",
            *no_val,
        ),
        _fit(
            tiny_corpus,
            "dp2_fused_adam",
            *strategy,
            "--trainer.strategy.tensor_model_parallel_size",
            "1",
            "--performance.optimizer",
            "fused",
            *no_val,
        ),
        _fit(tiny_corpus, "pretrained_tp2", *tp2, *pretrained, batch=4),
        *(
            _fit(tiny_corpus, name, *strategy, *DISTRIBUTED_OPTIMIZER_CALLBACKS, *overlap)
            for name, overlap in PARAMETER_GATHER.items()
        ),
        *(
            _fit(tiny_corpus, name, *packed, *strategy, *layout, batch=batch)
            for name, (layout, batch) in PACKED_LAYOUTS.items()
        ),
    ]


def _reference(runs: PlanRuns) -> list[dict[str, str]]:
    rows = runs.rows("reference")
    assert sorted(_column(rows, "train/loss")) == STEPS
    return rows


def _assert_same_losses(rows, reference, tol=1e-5) -> None:
    losses, expected = _column(rows, "train/loss"), _column(reference, "train/loss")
    assert sorted(losses) == STEPS
    deltas = {s: abs(losses[s] - expected[s]) for s in STEPS}
    assert max(deltas.values()) <= tol, deltas


def test_tensor_parallel_matches_one_process_with_validation(fit_runs):
    rows, reference = fit_runs.rows("tp2"), _reference(fit_runs)
    _assert_same_losses(rows, reference)
    val, expected = _column(rows, "val/loss"), _column(reference, "val/loss")
    assert val and sorted(val) == sorted(expected)
    assert max(abs(val[s] - expected[s]) for s in val) <= 1e-5


def test_context_parallel_matches_one_process_with_validation(fit_runs):
    """CP = 2 on 2 processes (DP = 1, so the data rank's batch is the reference's 4 rows): each rank trains on half
    of every sequence (megatron's load-balanced split) with Ulysses attention."""
    rows, reference = fit_runs.rows("cp2"), _reference(fit_runs)
    _assert_same_losses(rows, reference)
    val, expected = _column(rows, "val/loss"), _column(reference, "val/loss")
    assert val and sorted(val) == sorted(expected)
    assert max(abs(val[s] - expected[s]) for s in val) <= 1e-5


def test_gradient_norm_counts_tensor_parallel_shards_once(fit_runs):
    """Same global batch, weights whole (CP) or split (TP): megatron's clipping norm must agree; it does only if
    every tensor-parallel weight is tagged as such (a wrongly tagged shard is counted from TP rank 0 alone)."""
    tp, cp = (
        _column(fit_runs.rows("tp2"), "train/grad_norm"),
        _column(fit_runs.rows("cp2"), "train/grad_norm"),
    )
    assert sorted(tp) == sorted(cp) == STEPS
    assert max(abs(tp[s] - cp[s]) / cp[s] for s in STEPS) <= 1e-5, (tp, cp)


def test_ring_context_parallel_matches_one_process(fit_runs):
    """CP = 2 with ring attention (``cp_comm_type: p2p``): key/value blocks pass between the 2 ranks."""
    _assert_same_losses(fit_runs.rows("cp2_p2p"), _reference(fit_runs))


def test_sequence_parallel_matches_one_process(fit_runs):
    _assert_same_losses(fit_runs.rows("tp2_sp"), _reference(fit_runs))


def test_pipeline_1f1b_matches_one_process(fit_runs):
    _assert_same_losses(fit_runs.rows("pp2"), _reference(fit_runs))


def test_distributed_optimizer_matches_one_process(fit_runs):
    _assert_same_losses(fit_runs.rows("dp2_distopt"), _reference(fit_runs))


def test_fused_adam_matches_one_process(fit_runs):
    """Data parallel at TP = 1 (the fused linear + cross-entropy loss) with torch's fused AdamW kernel, which the
    ``performance.optimizer`` setting picks (``auto``: fused on CUDA)."""
    _assert_same_losses(fit_runs.rows("dp2_fused_adam"), _reference(fit_runs))


def test_weights_gathered_in_the_next_forward_are_complete_for_callbacks(fit_runs):
    """With ``overlap_param_gather`` each rank holds only its slice of the updated weights until the next forward
    gathers the rest; EMA (average, evaluation swap) and the export complete the gather first, so the losses, the
    validations on the average and the exported weights equal those of the gather after each step."""
    from safetensors.torch import load_file

    after, lazily = (fit_runs.rows(name) for name in PARAMETER_GATHER)
    for key in ("train/loss", "val/loss"):
        assert _column(after, key) and _column(lazily, key) == _column(after, key), key
    exports = [
        load_file(fit_runs.root / "runs" / "tests" / name / "version_0" / "hf" / "model.safetensors")
        for name in PARAMETER_GATHER
    ]
    assert exports[0].keys() == exports[1].keys()
    for name, tensor in exports[0].items():
        assert torch.equal(exports[1][name], tensor), name


def test_pretrained_weights_read_per_rank_match_one_process(fit_runs):
    """``model.init_args.pretrained`` under megatron: the CLI leaves the native model on the meta device and each
    TP rank reads its shards from the files; the losses are those of the native path loading the full model."""
    reference = fit_runs.rows("pretrained_reference")
    assert _column(reference, "train/loss")[0] != _column(_reference(fit_runs), "train/loss")[0]
    _assert_same_losses(fit_runs.rows("pretrained_tp2"), reference)


@pytest.fixture(scope="module")
def packed_documents(fit_runs, tiny_corpus) -> None:
    """The packed runs' data: document boundaries inside the rows of the first batch."""
    from forge_lightning.datamodules import PretrainDataModule

    data = PretrainDataModule(
        str(fit_runs.root / HERE_STEM / "short_documents" / "short"),
        str(tiny_corpus["tokenizer"]),
        seq_length=64,
        batch_size=4,
        num_workers=0,
        pin_memory=False,
        reset_position_ids=True,
    )
    data.setup("fit")
    first = next(iter(data.train_dataloader()))
    assert first["document_ids"].amax(dim=1).sum() >= 4  # document boundaries inside the rows


@pytest.mark.parametrize("name", PACKED_LAYOUTS)
def test_packed_documents_and_z_loss_match_one_process(fit_runs, packed_documents, name):
    """Packed rows (``document_ids``, positions restarting per document) with the z-loss (``train/loss`` includes
    it, as natively) against the default strategy on one process."""
    reference = fit_runs.rows("packed_reference")
    rows = fit_runs.rows(name)
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

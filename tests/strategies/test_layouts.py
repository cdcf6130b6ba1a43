"""Every native strategy layout trains the tiny LLM to the same losses as one process at the same global batch.

One ``python -m forge_lightning`` run per layout (2 processes on gloo, 5 steps, fp32); DCP / ZeRO-1 checkpoints
written at step 3 are resumed on ONE process (a different world size) and must reproduce steps 3-4. Under
``optimizer.name: muon`` (DDP, ZeRO-1, FSDP2, FSDP x TP on 4 processes) the final weights must match too.
"""

import csv
import shutil
from pathlib import Path

import pytest
import torch
from faults import overwrite_middle
from procs import forge_process, run_forge

from forge_lightning import manifest

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"
STEPS = [0, 1, 2, 3, 4]


def _losses(root: Path, name: str) -> dict[int, float]:
    rows = list(csv.DictReader((root / "runs" / "tests" / name / "version_0" / "metrics.csv").open()))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def _checkpoint_every_3(dirpath: str) -> str:
    return (
        "--trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: "
        f"{{dirpath: {dirpath}, every_n_train_steps: 3, save_top_k: -1}}}}]"
    )


@pytest.fixture(scope="module")
def runner(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    common = [
        "fit",
        "--config",
        str(TINY_YAML),
        "--data.data_prefix",
        str(tiny_corpus["prefix"]),
        "--data.tokenizer",
        str(tiny_corpus["tokenizer"]),
        "--trainer.max_steps",
        "5",
    ]

    def run(name: str, *args: str, devices: int = 2, batch: int = 2, checkpoint: bool = False) -> dict:
        extra = (
            [_checkpoint_every_3(f"ckpt_{name}")]
            if checkpoint
            else ["--trainer.enable_checkpointing", "false"]
        )
        run_forge(
            [
                *common,
                "--trainer.devices",
                str(devices),
                "--data.batch_size",
                str(batch),
                "--trainer.logger.init_args.name",
                name,
                *extra,
                *args,
            ],
            root,
        )
        return _losses(root, name)

    run.root, run.common = root, common
    run.reference = run("one", devices=1, batch=4)
    assert sorted(run.reference) == STEPS
    return run


def _assert_same(losses: dict[int, float], reference: dict[int, float], steps=STEPS, tol=2e-6) -> None:
    assert sorted(losses) == list(steps)
    deltas = {s: abs(losses[s] - reference[s]) for s in steps}
    assert max(deltas.values()) <= tol, deltas


def test_fsdp2_with_activation_checkpointing_and_dcp_resume_on_one_process(runner):
    losses = runner(
        "fsdp2",
        "--trainer.strategy",
        "fsdp2",
        "--performance.activation_checkpointing",
        "full",
        checkpoint=True,
    )
    _assert_same(losses, runner.reference)
    ckpt = runner.root / "ckpt_fsdp2" / "epoch=0-step=3.ckpt"
    files = sorted(p.name for p in ckpt.glob("*.distcp"))  # __<rank>_<writer>.distcp
    assert (ckpt / ".metadata").is_file() and {f.split("_")[2] for f in files} == {"0", "1"}, files
    assert len(files) > 2, f"each rank's writers write files of their own: {files}"
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    loader = meta["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader["consumed"] == 3 and loader["global_batch"] == 4
    listed = manifest.read_manifest(ckpt / manifest.MANIFEST_FILE)
    assert sorted(listed) == sorted(manifest.directory_files(ckpt)) and manifest.verify(ckpt).ok
    resumed = runner(
        "fsdp2_resume", "--trainer.strategy", "fsdp2", "--ckpt_path", str(ckpt), devices=1, batch=4
    )
    _assert_same(resumed, runner.reference, steps=[3, 4])

    # 4 KiB overwritten in the middle of rank 1's shard: `forge validate` on 2 processes (each hashes half of the
    # files) fails on both, naming the file, instead of validating wrong weights with exit code 0.
    corrupt = runner.root / "corrupt_fsdp2.ckpt"
    shutil.copytree(ckpt, corrupt)
    shard = max(corrupt.glob("__1_*.distcp"), key=lambda p: p.stat().st_size)
    overwrite_middle(shard)
    args = ["validate", *runner.common[1:], "--trainer.strategy", "fsdp2", "--trainer.devices", "2"]
    proc = forge_process([*args, "--data.batch_size", "2", "--ckpt_path", str(corrupt)], runner.root)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert f"{shard.name}: content changed" in output and "does not match its manifest" in output, output[
        -3000:
    ]


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("hsdp_2x1", ["--trainer.strategy", "forge_lightning.strategies.FSDP2Strategy",
                      "--trainer.strategy.data_parallel_replicate_size", "2"]),
        # selective checkpointing under FSDP2: its hooks must stay outside the checkpointed region
        ("hsdp_1x2", ["--trainer.strategy", "hsdp", "--performance.activation_checkpointing", "selective"]),
    ],
)  # fmt: skip
def test_hsdp_matches_one_process(runner, name, args):
    _assert_same(runner(name, *args), runner.reference)


@pytest.mark.parametrize(
    ("name", "value", "devices"),
    [
        ("fsdp2_keep", "false", 2),  # gathered parameters kept from forward to backward (ZeRO-2-like)
        ("fsdp2_reshard_to_2", "2", 4),  # resharded to pairs of the 4 ranks after forward
    ],
)
def test_fsdp2_reshard_after_forward_options_match_one_process(runner, name, value, devices):
    strategy = ["--trainer.strategy", "forge_lightning.strategies.FSDP2Strategy"]
    option = ["--trainer.strategy.reshard_after_forward", value]
    _assert_same(runner(name, *strategy, *option, devices=devices, batch=4 // devices), runner.reference)


def test_fsdp2_fp8_collectives_stay_close_to_one_process(runner):
    losses = runner(
        "fsdp2_fp8_comm",
        "--trainer.strategy",
        "forge_lightning.strategies.FSDP2Strategy",
        "--trainer.strategy.param_all_gather",
        "delta_fp8",
        "--trainer.strategy.gradient_reduce",
        "fp8",
    )
    _assert_same(losses, runner.reference, tol=2e-3)


def test_fsdp_x_tensor_parallel_matches_one_process(runner):
    losses = runner(
        "fsdp_tp",
        "--trainer.strategy",
        "forge_lightning.strategies.FSDP2Strategy",
        "--trainer.strategy.tensor_parallel_size",
        "2",
        batch=4,
    )
    _assert_same(losses, runner.reference)


def test_zero1_matches_one_process_and_resumes_on_one_process(runner):
    _assert_same(runner("zero1", "--trainer.strategy", "zero1", checkpoint=True), runner.reference)
    ckpt = runner.root / "ckpt_zero1" / "epoch=0-step=3.ckpt"
    state = torch.load(ckpt, weights_only=True)["optimizer_states"][0]["state"]
    # Consolidated on rank 0: the Adam state of all 20 parameters (embedding = tied head, 2 x 9 per layer, norm).
    assert sorted(state) == list(range(20)) and all("exp_avg_sq" in s for s in state.values())
    resumed = runner(
        "zero1_resume", "--trainer.strategy", "zero1", "--ckpt_path", str(ckpt), devices=1, batch=4
    )
    _assert_same(resumed, runner.reference, steps=[3, 4])


@pytest.mark.parametrize(
    ("name", "args", "tol"),
    [
        (
            "ddp_exact",
            [
                "--trainer.strategy",
                "forge_lightning.strategies.DDPStrategy",
                "--trainer.strategy.comm_hook",
                "none",
                "--performance.activation_checkpointing",  # applied by the module before DDP wraps it
                "selective",
            ],
            2e-6,
        ),
        ("ddp_bf16", ["--trainer.strategy", "ddp_bf16"], 1e-4),
        (
            "ddp_fp8",
            [
                "--trainer.strategy",
                "forge_lightning.strategies.DDPStrategy",
                "--trainer.strategy.comm_hook",
                "fp8",
                "--trainer.strategy.error_feedback",
                "true",
            ],
            1e-3,
        ),
    ],
)
def test_ddp_hooks_match_one_process(runner, name, args, tol):
    _assert_same(runner(name, *args), runner.reference, tol=tol)


def test_fsdp2_async_checkpoints_match_and_resume_on_one_process(runner):
    """``async_checkpoint``: the saves at steps 2 and 4 are written while training goes on; the first is completed
    by the second save, the second when fit ends, and ``save_top_k: 1`` removes step 2 only once step 4 is complete.
    The losses are the uninterrupted ones, and step 4's checkpoint (verified by its manifest) resumes on one
    process."""
    strategy = ["--trainer.strategy=forge_lightning.strategies.FSDP2Strategy"]
    strategy += ["--trainer.strategy.async_checkpoint=true"]
    keep_one = (
        "--trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: "
        "{dirpath: ckpt_fsdp2_async, every_n_train_steps: 2, save_top_k: 1, monitor: step, mode: max}}]"
    )
    _assert_same(
        runner("fsdp2_async", *strategy, "--trainer.enable_checkpointing=true", keep_one), runner.reference
    )
    folder = runner.root / "ckpt_fsdp2_async"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=4.ckpt"]
    assert manifest.verify(folder / "epoch=0-step=4.ckpt").ok
    resumed = runner(
        "fsdp2_async_resume",
        *strategy,
        "--ckpt_path",
        str(folder / "epoch=0-step=4.ckpt"),
        devices=1,
        batch=4,
    )
    _assert_same(resumed, runner.reference, steps=[4])


# Muon with fp32 Newton-Schulz (the bf16 default rounds differently ordered sums apart) at a Muon-sized learning rate;
# the AdamW part (embedding = tied head, norms) keeps optimizer.lr. Every run also writes its final weights.
MUON = [
    "--optimizer.name=muon",
    "--optimizer.muon.lr=0.02",
    "--optimizer.muon.ns_dtype=float32",
    "--trainer.callbacks+=family.weights_export.ExportWeights",
]


def _weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(root / "runs" / "tests" / name / "version_0" / "weights.pt", weights_only=True)


def _assert_same_weights(root: Path, name: str, reference: str, tol: float = 1e-5) -> None:
    """Within 1% of one AdamW step (lr 1e-3): AdamW normalises the embedding rows' near-zero gradients, whose
    rounding depends on the order of the sums (the Muon matrices agree to about 1e-7)."""
    ours, ref = _weights(root, name), _weights(root, reference)
    assert sorted(ours) == sorted(ref)
    deltas = {k: (ours[k] - ref[k]).abs().max().item() for k in ref}
    assert max(deltas.values()) <= tol, {k: d for k, d in deltas.items() if d > tol}


@pytest.fixture(scope="module")
def muon_reference(runner) -> dict[int, float]:
    return runner("muon_one", *MUON, devices=1, batch=4)


@pytest.mark.parametrize(
    ("name", "args", "devices", "batch"),
    [
        ("muon_ddp", ["--trainer.strategy=ddp"], 2, 2),
        # FSDP x TP on 4 processes (dp 2 x tp 2): matrices sharded Shard(0) / Shard(1) over tp, then over dp_shard.
        ("muon_fsdp_tp", ["--trainer.strategy=forge_lightning.strategies.FSDP2Strategy",
                          "--trainer.strategy.tensor_parallel_size=2"], 4, 2),
    ],
)  # fmt: skip
def test_muon_matches_one_process(runner, muon_reference, name, args, devices, batch):
    _assert_same(runner(name, *MUON, *args, devices=devices, batch=batch), muon_reference)
    _assert_same_weights(runner.root, name, "muon_one")


@pytest.mark.parametrize("strategy", ["zero1", "fsdp2"])
def test_muon_matches_one_process_and_resumes_on_one_process(runner, muon_reference, strategy):
    """Muon's state (momentum on each matrix's owner under ZeRO-1, sharded like the weights under FSDP2) is
    checkpointed at step 3 and resumed on one process, which reproduces steps 3-4."""
    name = f"muon_{strategy}"
    _assert_same(runner(name, *MUON, f"--trainer.strategy={strategy}", checkpoint=True), muon_reference)
    _assert_same_weights(runner.root, name, "muon_one")
    ckpt = runner.root / f"ckpt_{name}" / "epoch=0-step=3.ckpt"
    if strategy == "zero1":
        state = torch.load(ckpt, weights_only=True)["optimizer_states"][0]["state"]
        # Consolidated on rank 0: momentum of the 14 hidden matrices, Adam moments of the embedding and 5 norms.
        assert sum("momentum_buffer" in s for s in state.values()) == 14
        assert sum("exp_avg_sq" in s for s in state.values()) == 6
    resumed = runner(
        f"{name}_resume",
        *MUON,
        f"--trainer.strategy={strategy}",
        "--ckpt_path",
        str(ckpt),
        devices=1,
        batch=4,
    )
    _assert_same(resumed, muon_reference, steps=[3, 4])
    _assert_same_weights(runner.root, f"{name}_resume", "muon_one")

"""``WanDiffusionModule`` under MegatronStrategy (its twin: the plain ``WanDiT`` in megatron's DDP, optimizer and
schedule) trains to the losses and weights of the default strategy on one process, with context parallelism over
megatron's CP groups.

``forge fit`` of configs/diffusion/debug/cache_megatron_cp.yaml (the debug DiT, fp32, 3 steps of a global batch of 2)
from a perturbed initial DiT (``pretrained``) with SGD (whose updates show a wrongly scaled gradient), from a tiny
feature cache whose latents are 3 x 8 x 8 (48 patch tokens per video), on: the default
strategy (1 process); MegatronStrategy on 1 process; CP = 2 with Ulysses (``a2a``) and ring (``p2p``) attention;
CP = 4 with the hybrid (``a2a+p2p``, hierarchical sizes [2, 2]); CP = 2 x DP = 2 on 4 processes. Every run's
per-step ``train/loss``, its validation losses (``val/loss`` and one per fixed noise level, on the training samples
after the last step) and its exported DiT weights after the last step equal the default strategy's, the CP ranks
of a data rank read the same latents, and each runs its DiT blocks on its share of the tokens. TP = 2 is refused
with a message that names the option; a dist-checkpoint written at CP 2 with Ulysses resumes with ring attention to
the same last step, and one of another DiT width is refused by field. The runs are plan steps of conftest's
``fit_runs`` (see fit_plan.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fit_plan import PlanRuns, fit_step
from safetensors.torch import load_file
from wan_case import build_case

HERE = Path(__file__).resolve().parent
HERE_STEM = Path(__file__).stem
RECIPE = HERE.parents[1] / "configs" / "diffusion" / "debug" / "cache_megatron_cp.yaml"
TOKENS = 48  # patch tokens per video: latents 3 x 8 x 8, patch (1, 2, 2)
LOSS_TOL = 1e-6  # |train/loss - the default strategy's| per step (fp32)
WEIGHT_TOL = 1e-6  # max |weight - the default strategy's| after the 3 SGD steps (which move them up to 3e-2)
CP = "--trainer.strategy.context_parallel_size"
CHECKPOINT = "dit_checkpoints/epoch=0-step=2.ckpt"  # in the plan's working directory
SGD = ["--optimizer.name", "sgd", "--optimizer.lr", "0.05", "--optimizer.weight_decay", "0.01"]

# name: (processes, data-parallel size, CLI overrides of the recipe)
RUNS = {
    "dit_native": (1, 1, ["--trainer.strategy", "auto"]),
    "dit_megatron": (1, 1, [CP, "1"]),
    "dit_cp2": (2, 1, []),
    "dit_cp2_p2p": (2, 1, ["--trainer.strategy.cp_comm_type", "p2p"]),
    "dit_cp4_hybrid": (
        4,
        1,
        [
            *(CP, "4", "--trainer.strategy.cp_comm_type", "a2a+p2p"),
            *("--trainer.strategy.hierarchical_context_parallel_sizes", "[2, 2]"),
        ],
    ),
    "dit_cp2_dp2": (4, 2, []),
}
CONTEXT_PARALLEL = {"dit_cp2": 2, "dit_cp2_p2p": 2, "dit_cp4_hybrid": 4, "dit_cp2_dp2": 2}


def _fit(case_root: Path, name: str, nproc: int, data_parallel: int, *args: str, **kwargs) -> dict:
    callbacks = HERE / "dit_probe.py", HERE / "export_callback.py"
    assert all(c.is_file() for c in callbacks)
    return fit_step(
        name,
        [
            "fit",
            "--config",
            str(RECIPE),
            "--data",
            json.dumps(
                {
                    "class_path": "dit_probe.ValidatedVideoData",
                    "init_args": {
                        "cache": str(case_root / "features"),
                        "cache_config": str(case_root / "precompute.yaml"),
                        "batch_size": 2 // data_parallel,
                        "num_workers": 0,
                        "pin_memory": False,
                    },
                }
            ),
            "--trainer.devices",
            str(nproc),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
            "--trainer.logger",
            f"{{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: runs/tests, name: {name}}}}}",
            f"--trainer.callbacks+={{class_path: dit_probe.DiTTokens, init_args: {{path: {name}_tokens}}}}",
            "--trainer.callbacks+={class_path: export_callback.ExportAtStep, init_args: "
            f"{{step: 3, path: {name}_export/model.safetensors}}}}",
            *args,
        ],
        nproc=nproc,
        **kwargs,
    )


def _perturbed_dit(path: Path) -> Path:
    """The debug DiT with every weight moved by N(0, 0.1) (Wan's zero output projection would make the first step's
    prediction 0 and leave the blocks without a gradient), as a diffusers directory."""
    from forge_lightning.modules.diffusion import WanDiT, preset

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        dit = WanDiT(preset("debug", in_channels=4, out_channels=4))
        with torch.no_grad():
            for param in dit.parameters():
                param.add_(0.1 * torch.randn_like(param))
    dit.save_pretrained(path)
    return path


def fit_plan(tiny_corpus: dict[str, Path], root: Path) -> list[dict]:
    """This module's runs (for conftest's ``fit_runs``), the feature cache and the initial DiT under ``root``."""
    build_case(root, frames=17, size=(64, 64), bucket=(9, 64, 64))
    # SGD: a step's update is its gradient's (Adam's would hide a wrongly scaled gradient).
    start = ["--model.init_args.pretrained", str(_perturbed_dit(root / "dit")), *SGD]
    steps = [_fit(root, name, nproc, dp, *start, *args) for name, (nproc, dp, args) in RUNS.items()]
    tp2 = ["--trainer.strategy.tensor_model_parallel_size", "2", CP, "1"]
    # The 2-process launch runs these in order: a dist-checkpoint at step 2 (Ulysses), resumed with ring attention,
    # and refused for a DiT of another width.
    checkpoint = (
        "{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {dirpath: dit_checkpoints, "
    )
    checkpoint += "every_n_train_steps: 2, save_top_k: -1}}"
    resume = ["--trainer.enable_checkpointing", "true", "--ckpt_path", CHECKPOINT]
    wider = "{preset: debug, in_channels: 4, out_channels: 4, ffn_dim: 48}"
    save = ["--trainer.enable_checkpointing", "true", f"--trainer.callbacks+={checkpoint}"]
    return [
        *steps,
        _fit(root, "dit_cp2_save", 2, 1, *start, *save),
        _fit(root, "dit_cp2_p2p_resume", 2, 1, *start, *resume, "--trainer.strategy.cp_comm_type", "p2p"),
        _fit(
            root,
            "dit_resume_wider",
            2,
            1,
            *SGD,
            *resume,
            "--model.init_args.config",
            wider,
            expect_error=True,
        ),
        _fit(root, "dit_tp2_refused", 2, 1, *tp2, expect_error=True),
    ]


def _losses(fit_runs: PlanRuns, name: str) -> dict[int, float]:
    return {int(r["step"]): float(r["train/loss"]) for r in fit_runs.rows(name) if r.get("train/loss")}


def _weights(fit_runs: PlanRuns, name: str) -> dict[str, torch.Tensor]:
    return load_file(fit_runs.root / f"{name}_export" / "diffusion_pytorch_model.safetensors")


@pytest.mark.parametrize("name", [n for n in RUNS if n != "dit_native"])
def test_losses_and_weights_equal_the_default_strategy(fit_runs, name):
    """Training and validation losses (the validation data: the training samples, after the last step) and the
    exported weights."""
    reference, losses = _losses(fit_runs, "dit_native"), _losses(fit_runs, name)
    assert sorted(reference) == sorted(losses) == [0, 1, 2] and len(set(reference.values())) == 3
    deltas = {step: abs(losses[step] - reference[step]) for step in reference}
    assert max(deltas.values()) <= LOSS_TOL, deltas
    evaluation = [k for k in fit_runs.rows("dit_native")[0] if k.startswith("val/")]
    assert len(evaluation) == 6  # val/loss and the loss at each of the 5 fixed noise levels
    for key in evaluation:
        [ref] = [float(r[key]) for r in fit_runs.rows("dit_native") if r.get(key)]
        [val] = [float(r[key]) for r in fit_runs.rows(name) if r.get(key)]
        assert abs(val - ref) <= LOSS_TOL, (key, val, ref)
    expected, trained = _weights(fit_runs, "dit_native"), _weights(fit_runs, name)
    assert sorted(trained) == sorted(expected)
    worst = max((trained[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= WEIGHT_TOL


@pytest.mark.parametrize("name", sorted(CONTEXT_PARALLEL))
def test_context_parallel_ranks_share_the_data_and_split_the_tokens(fit_runs, name):
    nproc, data_parallel, _ = RUNS[name]
    cp = CONTEXT_PARALLEL[name]
    fit_runs.rows(name)  # the run succeeded
    ranks = [
        json.loads((fit_runs.root / f"{name}_tokens" / f"rank{r}.json").read_text()) for r in range(nproc)
    ]
    native = json.loads((fit_runs.root / "dit_native_tokens" / "rank0.json").read_text())
    assert [s["tokens"] for s in native] == [[TOKENS]] * 3
    for rank, steps in enumerate(ranks):
        assert [s["tokens"] for s in steps] == [[TOKENS // cp]] * 3, rank
    # megatron's rank order: the CP ranks of a data rank are consecutive
    for first in range(0, nproc, cp):
        assert all(ranks[r] == ranks[first] for r in range(first, first + cp))
    if data_parallel == 1:
        assert [s["latents"] for s in ranks[0]] == [s["latents"] for s in native]
    else:
        assert ranks[0] != ranks[cp]  # the data ranks read different samples


def test_tensor_parallelism_is_refused(fit_runs):
    message = fit_runs.error("dit_tp2_refused")
    assert "tensor_model_parallel_size (2) is not supported for the Wan DiT under MegatronStrategy" in message
    assert "FSDP2Strategy" in message


def test_a_context_parallel_checkpoint_resumes_with_ring_attention(fit_runs):
    """The dist-checkpoint of step 2 at CP 2 (a2a) resumed at CP 2 (p2p): the last step's loss and the final weights
    are the uninterrupted default strategy's."""
    resumed, reference = _losses(fit_runs, "dit_cp2_p2p_resume"), _losses(fit_runs, "dit_native")
    assert sorted(resumed) == [2]
    assert abs(resumed[2] - reference[2]) <= LOSS_TOL
    expected, trained = _weights(fit_runs, "dit_native"), _weights(fit_runs, "dit_cp2_p2p_resume")
    assert max((trained[k] - expected[k]).abs().max().item() for k in expected) <= WEIGHT_TOL


def test_a_checkpoint_of_another_dit_is_refused(fit_runs):
    message = fit_runs.error("dit_resume_wider")
    assert (
        "the checkpoint's Wan DiT differs from the module's: ffn_dim (32 in the checkpoint, 48 here)"
        in message
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("tensor_model_parallel_size", 2),
        ("pipeline_model_parallel_size", 2),
        ("virtual_pipeline_model_parallel_size", 2),
        ("expert_model_parallel_size", 2),
        ("expert_tensor_parallel_size", 2),
    ],
)
def test_model_parallel_layouts_are_refused_by_name(option, value):
    from forge_lightning.contracts import MegatronBuild, MegatronDims
    from forge_lightning.modules.diffusion.megatron import check_layout
    from forge_lightning.modules.diffusion.wan_config import preset

    build = MegatronBuild(dims=MegatronDims(**{option: value}), device=torch.device("cpu"), bf16=False)
    with pytest.raises(
        ValueError, match=rf"^{option} \({value}\) is not supported for the Wan DiT .* FSDP2Strategy$"
    ):
        check_layout(preset("debug"), build)


def test_recompute_and_heads_that_do_not_split_are_refused():
    from forge_lightning.contracts import MegatronBuild, MegatronDims
    from forge_lightning.modules.diffusion.megatron import check_layout
    from forge_lightning.modules.diffusion.wan_config import preset

    config, cpu = preset("debug"), torch.device("cpu")  # 2 heads
    with pytest.raises(ValueError, match=r"components.dit.recompute \('full'\) is not applied"):
        check_layout(config, MegatronBuild(dims=MegatronDims(), device=cpu, bf16=False, recompute="full"))
    ulysses4 = MegatronBuild(dims=MegatronDims(context_parallel_size=4), device=cpu, bf16=False)
    with pytest.raises(
        ValueError, match=r"context_parallel_size \(4\) must divide the DiT's num_heads \(2\)"
    ):
        check_layout(config, ulysses4)
    hybrid = MegatronDims(
        context_parallel_size=8, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 2]
    )
    with pytest.raises(ValueError, match=r"hierarchical_context_parallel_sizes\[0\] \(4\) must divide"):
        check_layout(config, MegatronBuild(dims=hybrid, device=cpu, bf16=False))
    ring = MegatronDims(context_parallel_size=4, cp_comm_type="p2p")  # ring attention splits no heads
    check_layout(config, MegatronBuild(dims=ring, device=cpu, bf16=False))

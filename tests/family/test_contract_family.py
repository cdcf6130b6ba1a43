"""The contracts are enough: a family that is not a language model (the MLP-Mixer of mixer.py, with its own megatron
twin in mixer_twin.py) trains under DDP, FSDP2 (DP and TP) and MegatronStrategy (TP = 2, and DP = 2 with the
distributed optimizer) on 2 CPU processes to the losses and weights of one process, with no change under
``forge_lightning/strategies/``; with a NaN training sample, every strategy leaves the same step out as one process
(the non-finite guard).

One reference ``forge fit`` on 1 process (global batch 8 = 2 micro-batches of 4, a quarter of the samples unlabelled,
so micro-batches hold different numbers of labelled samples), and one 2-process worker (worker.py) running every other
case through the same CLI and YAML in the same processes. fp32, 3 steps, AdamW with weight decay, cosine schedule.
"""

import ast
import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from mixer import PRESETS, MixerClassifier, MixerConfig  # noqa: E402
from worker import CASES, YAML  # noqa: E402

FAMILY_FILES = ("mixer.py", "mixer_twin.py")
STEPS = [0, 1, 2]
LOSS_TOL = 1e-5  # fp32: measured <= 2.4e-7
WEIGHT_TOL = 1e-5  # fp32, after 3 AdamW steps of lr 1e-2: measured <= 6e-7
TRAINED = ["ddp", "fsdp2", "fsdp2_tp2", "megatron_tp2", "megatron_dp2"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Run the references (one process each, one after the other) while the worker runs; return their folder."""
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("family")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]))
    worker = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    worker += ["--master-port", str(_free_port()), str(HERE / "worker.py"), str(out), *CASES]
    running = subprocess.Popen(
        worker, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for name, extra in (("reference", []), ("reference_nan", ["--data.init_args.nan_sample", "5"])):
        reference = [sys.executable, "-m", "forge_lightning", "fit", "--config", str(YAML), *extra]
        reference += [
            "--trainer.logger.init_args.save_dir",
            str(out),
            "--trainer.logger.init_args.name",
            name,
        ]
        proc = subprocess.run(reference, cwd=out, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    output, _ = running.communicate(timeout=300)
    assert running.returncode == 0, output[-8000:]
    return out


def _metrics(out: Path, name: str) -> list[dict[str, str]]:
    return list(csv.DictReader((out / name / "version_0" / "metrics.csv").open()))


def _column(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def _weights(out: Path, name: str, which: str = "weights.pt") -> dict[str, torch.Tensor]:
    return torch.load(out / name / "version_0" / which, weights_only=True)


def _deltas(out: Path, name: str, reference: str, key: str) -> dict[int, float]:
    got, want = _column(_metrics(out, name), key), _column(_metrics(out, reference), key)
    assert sorted(got) == sorted(want) == STEPS, (got, want)
    return {s: abs(got[s] - want[s]) for s in STEPS}


def _weight_delta(out: Path, name: str, reference: str) -> float:
    got, want = _weights(out, name), _weights(out, reference)
    assert list(got) == list(want)  # the plain model's names, in its order
    return max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("name", TRAINED)
def test_losses_and_weights_match_one_process(runs, name):
    """train/loss of every step, val/loss after every step and the trained (gathered) weights equal one process's."""
    train = _deltas(runs, name, "reference", "train/loss")
    val = _deltas(runs, name, "reference", "val/loss")
    assert max(train.values()) <= LOSS_TOL and max(val.values()) <= LOSS_TOL, (train, val)
    assert _weight_delta(runs, name, "reference") <= WEIGHT_TOL
    start, end = _weights(runs, name, "weights_start.pt"), _weights(runs, name)
    assert min((end[k] - start[k]).abs().max().item() for k in end) > 1e-3  # every tensor trained


def test_megatron_gradient_norm_agrees_across_layouts(runs):
    """The same global batch with the weights split (TP = 2) or whole (DP = 2): megatron's clipping norm agrees only
    if the twin's tensor-parallel weights are tagged as such (a replicated tensor is counted once, on TP rank 0)."""
    tp = _column(_metrics(runs, "megatron_tp2"), "train/grad_norm")
    dp = _column(_metrics(runs, "megatron_dp2"), "train/grad_norm")
    assert sorted(tp) == sorted(dp) == STEPS
    assert max(abs(tp[s] - dp[s]) / dp[s] for s in STEPS) <= 1e-5, (tp, dp)


@pytest.mark.parametrize("name", ["megatron_validate_tp2", "megatron_validate_dp2"])
def test_megatron_checkpoint_reloads_at_any_layout(runs, name):
    """The TP = 2 run's dist-checkpoint (the twin's sharded state: its parallel linears split over TP) validates at
    TP = 2 and at TP = 1 x DP = 2 to the reference's last val/loss."""
    val = _column(_metrics(runs, name), "val/loss")
    expected = _column(_metrics(runs, "reference"), "val/loss")[STEPS[-1]]
    assert len(val) == 1 and abs(next(iter(val.values())) - expected) <= LOSS_TOL, (val, expected)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "bad_megatron_pp2",
            "pipeline_model_parallel_size=2 is not supported by the MLP-Mixer's megatron twin",
        ),
        ("bad_megatron_kernel", "performance.kernels.rms_norm is not applied under MegatronStrategy"),
        (
            "bad_megatron_checkpoint_config",
            "was written for another model: num_layers: checkpoint 2, this model 3",
        ),
    ],
)
def test_megatron_refusals_name_the_option(runs, name, match):
    assert match in (runs / f"{name}_error.txt").read_text()


def test_megatron_does_not_decay_an_embedding_table(runs):
    """With a learned position embedding (an ``nn.Embedding``) and weight decay 0.1, MegatronStrategy (TP = 2) against
    the native path (DDP, the same global batch)."""
    train = _deltas(runs, "megatron_position", "ddp_position", "train/loss")
    assert max(train.values()) <= LOSS_TOL, train
    assert _weight_delta(runs, "megatron_position", "ddp_position") <= WEIGHT_TOL


@pytest.mark.parametrize("name", ["ddp_nan", "fsdp2_nan", "megatron_tp2_nan", "megatron_dp2_nan"])
def test_a_nan_sample_on_one_rank_leaves_its_step_out_everywhere(runs, name):
    """The NaN sample reaches one rank (or both TP ranks of one data rank): every rank skips that step (one decision,
    all-reduced), so the losses of the other steps and the trained weights equal one process's with the same
    sample."""
    got, want = (
        _column(_metrics(runs, name), "train/loss"),
        _column(_metrics(runs, "reference_nan"), "train/loss"),
    )
    assert sorted(got) == sorted(want) == STEPS, (got, want)
    bad = [s for s in STEPS if math.isnan(want[s])]
    assert len(bad) == 1 and math.isnan(got[bad[0]]), (got, want)
    assert max(abs(got[s] - want[s]) for s in STEPS if s not in bad) <= LOSS_TOL, (got, want)
    skipped = _column(_metrics(runs, name), "train/skipped_steps")
    assert skipped[STEPS[-1]] == 1 and skipped[bad[0]] == 1, skipped
    assert _weight_delta(runs, name, "reference_nan") <= WEIGHT_TOL
    start, end = _weights(runs, name, "weights_start.pt"), _weights(runs, name)
    assert all(torch.isfinite(t).all() for t in end.values())
    assert min((end[k] - start[k]).abs().max().item() for k in end) > 1e-3  # the other steps trained


# ----------------------------------------------------------------------------------------------- in process


def test_config_names_the_field():
    with pytest.raises(ValueError, match=r"token_hidden_size \(0\) must be a positive integer"):
        MixerConfig(token_hidden_size=0)
    with pytest.raises(ValueError, match=r"layer_norm_eps \(0.0\) must be positive"):
        MixerConfig(layer_norm_eps=0.0)
    with pytest.raises(ValueError, match="unknown mixer preset 'huge'"):
        MixerConfig.load("huge")
    with pytest.raises(TypeError):
        MixerConfig(4)  # keyword-only


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_build_and_classify(preset):
    module = MixerClassifier(preset)
    config = module.config
    patches = torch.randn(3, config.num_patches, config.patch_dim)
    assert module.model(patches).shape == (3, config.num_classes)
    stats = module.batch_stats({"patches": patches})
    assert stats["samples"] == 3 and stats["tokens"] == 3 * config.num_patches and stats["flops"] > 0


def test_plan_declares_blocks_tp_styles_and_divisors():
    module = MixerClassifier()
    plan = module.parallel_plan()
    (component,) = plan.components
    assert component.blocks == list(module.model.blocks)
    names = {name for block in component.blocks for name, _ in block.named_modules()}
    assert set(component.tp_plan) <= names  # every style names a module of each block
    plan.check_tensor_parallel(2, option="tensor_parallel_size")
    with pytest.raises(ValueError, match=r"mixer.token_hidden_size \(8\)"):
        plan.check_tensor_parallel(3, option="tensor_parallel_size")


def test_twin_maps_weights_by_the_tp_plan():
    from mixer_twin import COLUMNS, REPLICATED, ROWS, weight_kind

    plan = MixerClassifier().model.tp_plan()
    kinds = {
        "patch_embed.weight": REPLICATED,
        "blocks.0.token_norm.weight": REPLICATED,
        "blocks.0.token_mlp.fc1.weight": ROWS,
        "blocks.0.token_mlp.fc1.bias": ROWS,
        "blocks.1.channel_mlp.fc2.weight": COLUMNS,
        "blocks.1.channel_mlp.fc2.bias": REPLICATED,
        "head.weight": REPLICATED,
    }
    assert {name: weight_kind(name, plan) for name in kinds} == kinds


@pytest.mark.parametrize(
    ("degrees", "match"),
    [
        (dict(pipeline_model_parallel_size=2), "pipeline_model_parallel_size=2"),
        (dict(context_parallel_size=2), "context_parallel_size=2"),
        (dict(expert_model_parallel_size=2), "expert_model_parallel_size=2"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), "sequence_parallel=True"),
    ],
)
def test_twin_refuses_layouts_it_does_not_implement(degrees, match):
    from mixer_twin import MixerTwin

    from forge_lightning.contracts import MegatronBuild, MegatronDims

    build = MegatronBuild(dims=MegatronDims(**degrees), device=torch.device("cpu"), bf16=False)
    with pytest.raises(NotImplementedError, match=match):
        MixerTwin(MixerClassifier().model, build, objective=None)


def test_twin_checkpoint_config_names_each_field():
    from mixer_twin import MixerTwin

    from forge_lightning.contracts import MegatronBuild, MegatronDims, MegatronTwin

    build = MegatronBuild(dims=MegatronDims(), device=torch.device("cpu"), bf16=False)
    twin = MixerTwin(MixerClassifier().model, build, objective=None)
    assert isinstance(twin, MegatronTwin)
    saved = twin.hf_config()
    twin.check_checkpoint_config(saved)
    with pytest.raises(
        ValueError, match=r"num_layers: checkpoint 3, this model 2; num_classes: checkpoint 9"
    ):
        twin.check_checkpoint_config({**saved, "num_layers": 3, "num_classes": 9})


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (``import`` and ``from`` forms, at any depth)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_family_imports_no_strategy():
    offenders = {
        name: sorted(n for n in _imported_modules(HERE / name) if n.startswith("forge_lightning.strategies"))
        for name in FAMILY_FILES
    }
    assert offenders == {name: [] for name in FAMILY_FILES}

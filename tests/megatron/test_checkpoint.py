"""MegatronStrategy checkpoints resume exactly at the same layout and within fp32 tolerance at another one;
interleaved pipeline parallelism (VPP) matches one process.

All runs are the forge CLI (fp32, tiny LLM, 5 steps, checkpoint at step 3) inside two worker launches, so
megatron-core is imported twice in all (see checkpoint_worker.py):

    2 processes                                  then 1 process
    tp2 ──ckpt──> tp2_resume (same layout)       tp2 ckpt ──> tp2_to_one (TP1), other_model (refused),
                                                              megatron-to-hf
    pp2 ──ckpt──> pp2_to_tp2                     vpp ckpt ──> vpp_to_one (TP1), validate_vpp (TP1, `validate`)
    vpp (PP2 x VPP2, 4 layers) ──ckpt            dp2_distopt ckpt ──> distopt_to_one, other_optimizer (refused)
    dp2_distopt (DP2, distributed optimizer,     reference_4_layers (default strategy): vpp's reference
      dp_reshardable) ──ckpt──> distopt_to_tp2 (refused: TP changes)
    dp2_distopt_full (fully_reshardable) ──ckpt──> distopt_full_to_tp2

The crash-during-save, shape-mismatch and encoder-side (a composed model's, see test_components.py for the runs)
checks run in this process on a one-process megatron world.
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port
from faults import overwrite_middle
from procs import assert_clean_exit
from safetensors.torch import load_file
from tiny import TINY_LLM

from forge_lightning import manifest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"
STRATEGY = ["--trainer.strategy", "forge_lightning.strategies.megatron.MegatronStrategy"]
TP2 = [*STRATEGY, "--trainer.strategy.tensor_model_parallel_size", "2"]
TP1 = [*STRATEGY, "--trainer.strategy.tensor_model_parallel_size", "1"]
PP2 = [*STRATEGY, "--trainer.strategy.pipeline_model_parallel_size", "2"]
VPP = [*PP2, "--trainer.strategy.virtual_pipeline_model_parallel_size", "2"]
DIST_OPT = [*STRATEGY, "--trainer.strategy.use_distributed_optimizer", "true"]
FULLY_RESHARDABLE = ["--trainer.strategy.dist_ckpt_optim_fully_reshardable", "true"]
FOUR_LAYERS = ["--model.init_args.config.num_hidden_layers", "4"]
STEP3 = "epoch=0-step=3.ckpt"
# fp32 losses (~6.2) of another layout differ by rounding (another reduction order), which Adam amplifies step by
# step (lr 1e-3): measured 0 for TP2 -> TP1, <= 4e-6 for PP2 -> TP2 and DP2 -> 1, up to 1.8e-5 (train) and 3.6e-5
# (validation) by step 4 for PP2 x VPP2 against one process.
TOLERANCE = 1e-4


def _fit(
    root: Path,
    name: str,
    *args: str,
    batch: int = 4,
    accumulate: int = 1,
    save: bool = False,
    export: bool = False,
    command: str = "fit",
) -> dict:
    """One plan step: ``forge fit`` (or another ``command``) of the tiny LLM for 5 steps.

    ``save``: a checkpoint after step 3; ``export``: the weights at step 3 as Hugging Face safetensors.
    """
    callbacks = []
    if export:
        callbacks.append(
            "{class_path: export_callback.ExportAtStep, "
            f"init_args: {{step: 3, path: {root / 'exported' / name / 'model.safetensors'}}}}}"
        )
    if save:
        callbacks.append(
            "{class_path: lightning.pytorch.callbacks.ModelCheckpoint, "
            f"init_args: {{dirpath: {root / ('ckpt_' + name)}, every_n_train_steps: 3, save_top_k: -1}}}}"
        )
    return {
        "name": name,
        "args": [
            command,
            "--config",
            str(TINY_YAML),
            "--data.data_prefix",
            str(root / "corpus" / "docs_text_document"),
            "--data.tokenizer",
            str(root / "corpus" / "tok"),
            "--trainer.max_steps",
            "5",
            "--data.batch_size",
            str(batch),
            "--trainer.accumulate_grad_batches",
            str(accumulate),
            "--trainer.logger.init_args.name",
            name,
            f"--trainer.callbacks=[{', '.join(callbacks)}]",
            *([] if save else ["--trainer.enable_checkpointing", "false"]),
            *args,
        ],
    }


def _launch(root: Path, nproc: int, plan: list[dict]) -> dict:
    """Run ``plan`` in ``nproc`` worker processes; the per-step results (errors, seconds)."""
    plan = [{**s, "args": [*s["args"], "--trainer.devices", str(nproc)]} if "args" in s else s for s in plan]
    (root / "plan.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), str(HERE / "checkpoint_worker.py"), str(root / "plan.json")]
    log = root / f"worker_{nproc}.log"  # the workers' full output, for a failure's details
    with log.open("w") as out:
        proc = subprocess.run(
            cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=300
        )
    proc.stdout = log.read_text()
    assert_clean_exit(proc)
    results = json.loads((root / f"results_{nproc}.json").read_text())
    expected = {step["name"] for step in plan if step.get("expect_error")}
    failed = {k: r["error"] for k, r in results.items() if r["error"] and k not in expected}
    assert not failed, f"{failed}\n{proc.stdout[-6000:]}"
    return results


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_ckpt")
    (root / "corpus").symlink_to(tiny_corpus["root"])
    saved = ("tp2", "pp2", "vpp", "dp2_distopt", "dp2_distopt_full")
    ckpt = {name: str(root / f"ckpt_{name}" / STEP3) for name in saved}
    distopt_tp2 = [*DIST_OPT, "--trainer.strategy.tensor_model_parallel_size", "2"]
    no_val = ["--trainer.limit_val_batches", "0"]
    results = _launch(
        root,
        2,
        [
            _fit(root, "tp2", *TP2, *no_val, save=True, export=True),
            _fit(root, "tp2_resume", *TP2, *no_val, "--ckpt_path", ckpt["tp2"]),
            _fit(root, "pp2", *PP2, *no_val, batch=2, accumulate=2, save=True),
            _fit(root, "pp2_to_tp2", *TP2, *no_val, "--ckpt_path", ckpt["pp2"], batch=2, accumulate=2),
            _fit(root, "vpp", *VPP, *FOUR_LAYERS, accumulate=2, save=True),
            _fit(root, "dp2_distopt", *DIST_OPT, *no_val, batch=2, save=True),
            {
                **_fit(root, "distopt_to_tp2", *distopt_tp2, *no_val, "--ckpt_path", ckpt["dp2_distopt"]),
                "expect_error": True,
            },
            _fit(root, "dp2_distopt_full", *DIST_OPT, *FULLY_RESHARDABLE, *no_val, batch=2, save=True),
            # the same global batch (4) at TP2 x DP1
            _fit(root, "distopt_full_to_tp2", *distopt_tp2, *no_val, "--ckpt_path", ckpt["dp2_distopt_full"]),
        ],
    )
    results |= _launch(
        root,
        1,
        [
            _fit(root, "reference_4_layers", *FOUR_LAYERS, accumulate=2),
            _fit(root, "tp2_to_one", *TP1, *no_val, "--ckpt_path", ckpt["tp2"]),
            _fit(root, "vpp_to_one", *TP1, *FOUR_LAYERS, *no_val, "--ckpt_path", ckpt["vpp"], accumulate=2),
            _fit(root, "distopt_to_one", *DIST_OPT, *no_val, "--ckpt_path", ckpt["dp2_distopt"]),
            _fit(root, "validate_vpp", *TP1, *FOUR_LAYERS, "--ckpt_path", ckpt["vpp"], command="validate"),
            {
                **_fit(root, "other_model", *TP1, *FOUR_LAYERS, "--ckpt_path", ckpt["tp2"]),
                "expect_error": True,
            },
            {**_fit(root, "other_optimizer", *TP1, "--ckpt_path", ckpt["dp2_distopt"]), "expect_error": True},
            {"name": "megatron_to_hf", "megatron_to_hf": [ckpt["tp2"], str(root / "hf_from_tp2_step3")]},
        ],
    )
    return root, results


def _metric(root: Path, name: str, key: str = "train/loss") -> dict[int, float]:
    rows = csv.DictReader((root / "runs" / "tests" / name / "version_0" / "metrics.csv").open())
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def test_resume_at_the_same_layout_is_exact(runs):
    root, _ = runs
    full, resumed = _metric(root, "tp2"), _metric(root, "tp2_resume")
    assert sorted(full) == [0, 1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert all(resumed[s] == full[s] for s in (3, 4)), (resumed, full)
    meta = torch.load(root / "ckpt_tp2" / STEP3 / "meta.pt", weights_only=True)
    assert meta["global_step"] == 3 and meta["megatron"]["layout"]["tensor_model_parallel_size"] == 2
    loader = meta["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader["consumed"] == 3 and loader["global_batch"] == 4


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ("tp2", "tp2_to_one"),
        ("pp2", "pp2_to_tp2"),
        ("vpp", "vpp_to_one"),
        ("dp2_distopt", "distopt_to_one"),
        ("dp2_distopt_full", "distopt_full_to_tp2"),
    ],
)
def test_resume_at_another_layout_matches_within_fp32_tolerance(runs, saved, resumed):
    root, _ = runs
    full, losses = _metric(root, saved), _metric(root, resumed)
    assert sorted(losses) == [3, 4]
    deltas = {s: abs(losses[s] - full[s]) for s in (3, 4)}
    assert max(deltas.values()) <= TOLERANCE, deltas


def test_interleaved_pipeline_matches_one_process(runs):
    root, _ = runs
    for key in ("train/loss", "val/loss"):
        losses, expected = _metric(root, "vpp", key), _metric(root, "reference_4_layers", key)
        assert losses and sorted(losses) == sorted(expected), key
        deltas = {s: abs(losses[s] - expected[s]) for s in expected}
        assert max(deltas.values()) <= TOLERANCE, (key, deltas)


def test_validate_loads_the_weights_of_another_layout(runs):
    root, _ = runs
    (loss,) = _metric(root, "validate_vpp", "val/loss").values()
    # The uninterrupted runs validate every 2 micro-batches: after step 3 is their validation logged at step 2.
    for run in ("vpp", "reference_4_layers"):
        assert abs(loss - _metric(root, run, "val/loss")[2]) <= TOLERANCE, run


def test_checkpoint_of_another_model_is_refused_with_the_fields(runs):
    _, results = runs
    error = results["other_model"]["error"]
    assert error.startswith("ValueError") and "was written for another model" in error, error
    assert "num_layers: checkpoint 2, model 4" in error and "config.json" in error, error


def test_checkpoint_of_another_optimizer_kind_is_refused(runs):
    _, results = runs
    error = results["other_optimizer"]["error"]
    assert "{'distributed': True, 'bf16': False}, this run has {'distributed': False" in error, error
    assert "use_distributed_optimizer" in error


def test_a_dp_reshardable_optimizer_state_at_another_model_parallel_layout_is_refused(runs):
    root, results = runs
    error = results["distopt_to_tp2"]["error"]
    assert error.startswith("ValueError") and "dp_reshardable form" in error, error
    assert "tensor_model_parallel_size 1 -> 2" in error and "dist_ckpt_optim_fully_reshardable" in error, (
        error
    )
    forms = {
        name: torch.load(root / f"ckpt_{name}" / STEP3 / "meta.pt", weights_only=True)["megatron"]
        for name in ("dp2_distopt", "dp2_distopt_full")
    }
    assert forms["dp2_distopt"]["optimizer_sharding"] == "dp_reshardable"
    assert forms["dp2_distopt_full"]["optimizer_sharding"] == "fully_reshardable"


def test_megatron_to_hf_reads_a_training_checkpoint_of_another_layout(runs):
    root, _ = runs
    converted = load_file(root / "hf_from_tp2_step3" / "model.safetensors")
    exported = load_file(root / "exported" / "tp2" / "model.safetensors")  # gathered from TP2 at step 3
    assert sorted(converted) == sorted(exported)
    assert all(torch.equal(converted[k], exported[k]) for k in exported)


# ----- in this process: one-process megatron world ----------------------------------------------------------------


def _tiny_model(**overrides):
    from forge_lightning.modules.llm.config import LLMConfig
    from forge_lightning.modules.llm.megatron import build_gpt_model, gpt_decoder_spec, transformer_config

    config = LLMConfig.load({**TINY_LLM, **overrides})
    tf = transformer_config(config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return config, build_gpt_model(config, tf, gpt_decoder_spec(tf), pre_process=True, post_process=True)


def _save(model, config, path: Path, **extra) -> None:
    from forge_lightning.strategies.megatron import checkpoint as ckpt

    state = {ckpt.SHARDED_KEY: ckpt.sharded_state_dict([model], None, is_loading=False), **extra}
    ckpt.MegatronCheckpointIO().save_checkpoint({**state, ckpt.HF_CONFIG_KEY: config.to_hf()}, path)


def _load(model, path: Path) -> dict:
    from forge_lightning.strategies.megatron import checkpoint as ckpt

    template = ckpt.sharded_state_dict([model], None, is_loading=True)
    loaded = ckpt.MegatronCheckpointIO().load_checkpoint(path, sharded_state_dict=template)
    ckpt.load_into([model], None, loaded.pop(ckpt.SHARDED_KEY))
    return loaded


def test_a_save_that_dies_midway_leaves_the_last_checkpoint_loadable(megatron_world, tmp_path):
    config, model = _tiny_model()
    path = tmp_path / "last.ckpt"
    _save(model, config, path, global_step=1)
    good = {k: v.clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    # The shards are written, then writing meta.pt fails (a function cannot be saved): a real failure midway.
    with pytest.raises(Exception, match="pickle"):
        _save(model, config, path, global_step=2, not_saveable=lambda: None)
    assert (tmp_path / ".last.ckpt.tmp" / ".metadata").is_file()  # the torn attempt, beside the checkpoint
    assert _load(model, path)["global_step"] == 1
    assert all(torch.equal(p, good[k]) for k, p in model.named_parameters())
    _save(model, config, path, global_step=3)  # the next save replaces the torn attempt
    assert not (tmp_path / ".last.ckpt.tmp").exists() and _load(model, path)["global_step"] == 3


def test_every_rank_hashes_its_shards_into_the_manifest(runs):
    root, _ = runs
    ckpt = root / "ckpt_tp2" / STEP3
    listed = manifest.read_manifest(ckpt / manifest.MANIFEST_FILE)
    assert sorted(listed) == manifest.directory_files(ckpt)
    assert {"meta.pt", "config.json", "common.pt", "metadata.json", ".metadata"} <= listed.keys()
    assert {name.split("_")[2] for name in listed if name.endswith(".distcp")} == {"0", "1"}
    assert manifest.verify(ckpt).ok


def test_a_checkpoint_with_a_changed_shard_is_refused_naming_the_file(megatron_world, tmp_path):
    config, model = _tiny_model()
    path = tmp_path / "last.ckpt"
    _save(model, config, path, global_step=1)
    shard = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    overwrite_middle(shard)
    with pytest.raises(manifest.ManifestError, match=rf"{shard.name}: content changed"):
        _load(model, path)


def test_a_checkpoint_of_another_shape_names_the_tensor(megatron_world, tmp_path):
    from forge_lightning.strategies.megatron import checkpoint as ckpt

    config, model = _tiny_model()
    _save(model, config, tmp_path / "ckpt", global_step=1)
    other_config, other = _tiny_model(intermediate_size=96)
    from moe_reference import decoder_twin

    from forge_lightning.modules.llm.model import DecoderLM

    with pytest.raises(ValueError, match=r"intermediate_size: checkpoint 128, model 96"):
        ckpt.check_model_config(tmp_path / "ckpt", decoder_twin(DecoderLM(other_config)))
    with pytest.raises(
        ValueError, match=r"decoder\.layers\.mlp\.linear_fc2\.weight: checkpoint \(2, 64, 128\)"
    ):
        _load(other, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="is a file, not a MegatronStrategy checkpoint"):
        _load(model, tmp_path / "ckpt" / "meta.pt")


def test_an_encoder_side_round_trips_and_its_absence_is_named(megatron_world, tmp_path):
    """A composed model's encoder side (plain modules, see components.py) is saved beside the twin and loads back;
    a checkpoint without it (e.g. of the decoder LM alone) is refused naming the missing components."""
    from forge_lightning.strategies.megatron import checkpoint as ckpt

    config, model = _tiny_model()
    encoder = {"encoder": torch.nn.Linear(4, 3)}
    state = ckpt.sharded_state_dict([model], None, is_loading=False, components=encoder)
    assert state[ckpt.COMPONENTS_KEY]["encoder"]["components.encoder.weight"].replica_id == (0, 0, 0)
    ckpt.MegatronCheckpointIO().save_checkpoint(
        {ckpt.SHARDED_KEY: state, ckpt.HF_CONFIG_KEY: config.to_hf()}, tmp_path / "composed"
    )
    _save(model, config, tmp_path / "decoder_only")
    other = {"encoder": torch.nn.Linear(4, 3)}
    template = ckpt.sharded_state_dict([model], None, is_loading=True, components=other)
    loaded = ckpt.MegatronCheckpointIO().load_checkpoint(tmp_path / "composed", sharded_state_dict=template)
    ckpt.load_into([model], None, loaded[ckpt.SHARDED_KEY], components=other)
    assert all(
        torch.equal(a, b) for a, b in zip(encoder["encoder"].parameters(), other["encoder"].parameters())
    )
    template = ckpt.sharded_state_dict([model], None, is_loading=True, components=other)
    with pytest.raises(ValueError, match=r"holds no weights for the components \['encoder'\]"):
        ckpt.MegatronCheckpointIO().load_checkpoint(tmp_path / "decoder_only", sharded_state_dict=template)


def test_the_strategy_keeps_its_checkpoint_io():
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    import forge_lightning.strategies.megatron  # noqa: F401  (registers "megatron")
    from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO
    from forge_lightning.strategies.megatron.checkpoint import MegatronCheckpointIO

    kwargs = dict(strategy="megatron", accelerator="cpu", devices=1, logger=False)
    # forge's CLI adds its single-file default when the strategy is named by its short name: kept out.
    trainer = pl.Trainer(plugins=[AtomicCheckpointIO()], **kwargs)
    assert isinstance(trainer.strategy.checkpoint_io, MegatronCheckpointIO)
    with pytest.raises(TypeError, match="through MegatronCheckpointIO, not TorchCheckpointIO"):
        pl.Trainer(plugins=[TorchCheckpointIO()], **kwargs)


def test_a_tensor_parallel_weight_saved_whole_is_refused(megatron_world, monkeypatch):
    """A twin whose sharded state dict gives a TP-split parameter unsplit would write TP rank 0's shard as the
    whole tensor: the save refuses it, naming the parameter (here: a TP = 1 chunk seen as TP = 2)."""
    from megatron.core import parallel_state

    from forge_lightning.strategies.megatron import checkpoint as ckpt

    _, model = _tiny_model()
    ckpt.sharded_state_dict([model], None, is_loading=False)  # TP = 1: nothing to split
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"parameters \['embedding.word_embeddings.weight', .* saved whole"):
        ckpt.sharded_state_dict([model], None, is_loading=False)


def test_a_version_1_checkpoint_reads_as_fully_reshardable_and_writers_are_checked():
    from forge_lightning.strategies.megatron import checkpoint as ckpt

    assert ckpt.optimizer_sharding({"megatron": {"format": ckpt.FORMAT, "version": 1}}) == "fully_reshardable"
    assert ckpt.optimizer_sharding({"megatron": {"optimizer_sharding": "dp_reshardable"}}) == "dp_reshardable"
    with pytest.raises(ValueError, match="writers_per_rank must be at least 1"):
        ckpt.MegatronCheckpointIO(writers_per_rank=0)


def test_the_forked_results_queue_server_takes_the_default_action_on_sigterm():
    """The writers' results queue is served by a forked Manager: it must not run the parent's Python signal
    handlers (Lightning's SIGTERM handler broadcasts over the parent's process group and would hang there)."""
    script = """
import multiprocessing, signal, time
signal.signal(signal.SIGTERM, lambda *_: time.sleep(3600))  # a parent's handler that never returns
from megatron.core.dist_checkpointing.strategies import filesystem_async
from forge_lightning.strategies.megatron.checkpoint import _start_results_queue_by_fork
_start_results_queue_by_fork()
filesystem_async._results_queue.put("written")
assert filesystem_async._results_queue.get() == "written"
(server,) = multiprocessing.active_children()
assert server._popen.method == "fork"
server.terminate()
server.join(10)
print("EXITCODE", server.exitcode)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "EXITCODE -15" in proc.stdout, proc.stdout + proc.stderr[-3000:]

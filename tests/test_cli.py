"""The `forge` command: config parsing, overrides, errors, saved configs, loggers and 2-process DDP."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from procs import assert_clean_exit

from forge_lightning.cli import ForgeCLI

REPO = Path(__file__).resolve().parent.parent
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"
ALL_CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


def _is_precompute_config(path: Path) -> bool:
    """A `forge-data precompute` config: a feature cache's data and frozen modules, no model (it sits beside the
    recipe that reads the cache)."""
    keys = set(yaml.safe_load(path.read_text()) or {})
    return {"data", "modules"} <= keys and "model" not in keys


PRECOMPUTE_CONFIGS = [p for p in ALL_CONFIGS if _is_precompute_config(p)]
FIT_CONFIGS = [p for p in ALL_CONFIGS if p not in PRECOMPUTE_CONFIGS]


def _data_args(corpus):
    return ["--data.data_prefix", str(corpus["prefix"]), "--data.tokenizer", str(corpus["tokenizer"])]


def _print_config(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ForgeCLI(args=args)
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("config", FIT_CONFIGS, ids=[str(p.relative_to(REPO)) for p in FIT_CONFIGS])
def test_every_shipped_config_parses(config, capsys):
    resolved = _print_config(["fit", "--config", str(config), "--print_config"], capsys)
    assert resolved["model"]["class_path"].startswith("forge_lightning.")
    assert "optimizer" in resolved and "scheduler" in resolved
    cache_config = (resolved["data"].get("init_args") or {}).get("cache_config") or ""
    if cache_config.startswith(
        "configs/"
    ):  # a shipped recipe's cache is checked against a shipped precompute YAML
        assert REPO / cache_config in PRECOMPUTE_CONFIGS, cache_config


@pytest.mark.parametrize(
    "config", PRECOMPUTE_CONFIGS, ids=[str(p.relative_to(REPO)) for p in PRECOMPUTE_CONFIGS]
)
def test_every_shipped_precompute_config_parses(config):
    from forge_lightning.datamodules.diffusion.buckets import parse_buckets
    from forge_lightning.datamodules.diffusion.precompute import load_precompute_config

    parsed = load_precompute_config(config)
    data = parsed.data
    assert parse_buckets(
        data.buckets, temporal_stride=data.temporal_stride, spatial_stride=data.spatial_stride
    )
    assert [m.name for m in parsed.modules] and all(
        m.target.startswith(("forge_lightning.", "diffusers.", "transformers.")) for m in parsed.modules
    )


def test_print_config_applies_overrides(capsys):
    resolved = _print_config(
        [
            "fit",
            "--config",
            str(TINY_YAML),
            "--trainer.max_steps",
            "50",
            "--optimizer.lr",
            "3e-4",
            "--print_config",
        ],
        capsys,
    )
    assert resolved["trainer"]["max_steps"] == 50
    assert resolved["optimizer"]["lr"] == 3e-4
    assert resolved["data"]["init_args"]["seq_length"] == 32


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.max_stepz", "5"], "max_stepz"),
        (["--optimizer.lr", "fast"], "optimizer.lr"),
        (["--data.init_args.seq_lenght", "8"], "seq_lenght"),
        (["--model.init_args.z_loss", "[1, 2]"], "z_loss"),
    ],
)
def test_unknown_keys_and_wrong_types_fail_before_work(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ForgeCLI(args=["fit", "--config", str(TINY_YAML), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _forge(args, cwd, env_extra=None):
    # Inherited W&B variables (e.g. the service address an in-process run of another test left behind) would
    # send this run's records to that service and its directory.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env = {**inherited, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env_extra or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "forge_lightning", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_clean_exit(proc)
    return proc


def _train_losses(log_dir):
    rows = list(csv.DictReader((Path(log_dir) / "metrics.csv").read_text().splitlines()))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def test_fit_validate_predict_and_loggers(tiny_corpus, tmp_path):
    """fit saves its config and checkpoint and logs to CSV, TensorBoard and W&B (offline); validate and predict
    run from the checkpoint; forge-convert exports it to a transformers-loadable directory."""
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    env = {k: str(wandb_dir) for k in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")}
    loggers = (
        "[{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {save_dir: runs, name: cli}},"
        " {class_path: lightning.pytorch.loggers.TensorBoardLogger, init_args: {save_dir: runs, name: tb}},"
        " {class_path: lightning.pytorch.loggers.WandbLogger, init_args: {save_dir: runs, project: forge-test,"
        " offline: true}}]"
    )
    _forge(
        ["fit", "--config", str(TINY_YAML), *_data_args(tiny_corpus), "--trainer.logger", loggers],
        tmp_path,
        env,
    )
    run_dir = tmp_path / "runs" / "cli" / "version_0"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 4
    assert saved["data"]["init_args"]["data_prefix"] == str(tiny_corpus["prefix"])
    ckpts = list((run_dir / "checkpoints").glob("*.ckpt"))
    assert len(ckpts) == 1
    train = _train_losses(run_dir)
    assert sorted(train) == [0, 1, 2, 3]
    assert list((tmp_path / "runs" / "tb").glob("version_0/events.out.tfevents.*"))
    # The offline run's record file holds every logged metric (synced later with `wandb sync`).
    records = list((tmp_path / "runs" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1 and b"train/loss" in records[0].read_bytes()

    ckpt = ["--ckpt_path", str(ckpts[0]), "--trainer.logger", "false"]
    out = _forge(["validate", "--config", str(TINY_YAML), *_data_args(tiny_corpus), *ckpt], tmp_path).stdout
    assert "val/loss" in out
    predict = [
        "--data.predict_prompts",
        '["def ", "import "]',
        "--model.init_args.generation.max_new_tokens",
        "8",
    ]
    writer = ["--trainer.callbacks+=forge_lightning.callbacks.TextPredictionWriter"]
    writer += ["--trainer.callbacks.output", str(tmp_path / "pred.jsonl")]
    _forge(
        ["predict", "--config", str(TINY_YAML), *_data_args(tiny_corpus), *ckpt, *predict, *writer], tmp_path
    )
    records = [json.loads(line) for line in (tmp_path / "pred.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["def ", "import "]
    assert all(r["completion"] for r in records)

    from forge_lightning.tools.convert import main as forge_convert

    forge_convert(["ckpt-to-hf", "--ckpt", str(ckpts[0]), "--output", str(tmp_path / "hf")])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    state = torch.load(ckpts[0], weights_only=True)["state_dict"]
    torch.testing.assert_close(hf.model.embed_tokens.weight, state["model.model.embed_tokens.weight"])
    again = ["ckpt-to-hf", "--ckpt", str(ckpts[0]), "--output", str(tmp_path / "hf")]
    with pytest.raises(SystemExit, match=r"hf exists and is not empty: .*forge-convert: --overwrite"):
        forge_convert(again)
    forge_convert([*again, "--overwrite"])


def test_two_process_ddp_matches_one_process(tiny_corpus, tmp_path):
    common = [
        "fit",
        "--config",
        str(TINY_YAML),
        *_data_args(tiny_corpus),
        "--trainer.enable_checkpointing",
        "false",
    ]
    _forge([*common, "--data.batch_size", "4", "--trainer.logger.init_args.name", "one"], tmp_path)
    _forge(
        [
            *common,
            "--data.batch_size",
            "2",
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ddp",
            "--trainer.logger.init_args.name",
            "two",
        ],
        tmp_path,
    )
    one = _train_losses(tmp_path / "runs" / "tests" / "one" / "version_0")
    two = _train_losses(tmp_path / "runs" / "tests" / "two" / "version_0")
    assert sorted(one) == sorted(two) == [0, 1, 2, 3]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5, abs=1e-6)


def test_registered_short_names_of_strategies_that_own_their_checkpoints_get_no_default_plugin():
    import forge_lightning.strategies  # noqa: F401  (registers the short names)
    from forge_lightning.cli import strategy_traits

    assert strategy_traits("fsdp2").owns_checkpoint_io and strategy_traits("megatron").owns_checkpoint_io
    for name in ("ddp_fp8", "auto", None):
        assert not strategy_traits(name).owns_checkpoint_io


def test_a_diverging_run_stops_with_the_guards_error_and_exports_nothing(tiny_corpus, tmp_path):
    """lr 1e3: the loss turns NaN within a few steps; forge's default NonFiniteGuard leaves those steps out, stops
    after max_consecutive of them with a non-zero exit and the newest checkpoint's name, and no export is written."""
    args = ["fit", "--config", str(TINY_YAML), *_data_args(tiny_corpus), "--optimizer.lr", "1e3"]
    args += [
        "--trainer.max_steps",
        "40",
        "--trainer.val_check_interval",
        "40",
        "--trainer.limit_val_batches",
        "0",
    ]
    args += ["--trainer.callbacks+=forge_lightning.callbacks.HFExport", "--trainer.callbacks.dirpath", "hf"]
    guard = "{class_path: forge_lightning.callbacks.NonFiniteGuard, init_args: {max_consecutive: 3}}"
    args += [f"--trainer.callbacks+={guard}"]
    proc = subprocess.run(
        [sys.executable, "-m", "forge_lightning", *args],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "NonFiniteGuard: 3 optimizer steps in a row had a non-finite loss or gradients" in output, output[
        -3000:
    ]
    assert "not applied" in output and "Lower optimizer.lr" in output
    assert not (tmp_path / "hf").exists()


def test_exit_now_joins_threads_runs_exit_handlers_and_flushes():
    """``forge`` leaves through ``exit_now``: what the interpreter's exit would do for a run's results (threads
    that are not daemons finish, exit handlers run, buffered output is written) happens, with the exit code."""
    code = (
        "import atexit, sys, threading, time\n"
        "from forge_lightning.cli import exit_now\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread finished'))).start()\n"
        "atexit.register(lambda: print('exit handler ran'))\n"
        "sys.stdout.write('buffered')\n"
        "exit_now(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == ["bufferedthread", "finished", "exit", "handler", "ran"], proc.stdout

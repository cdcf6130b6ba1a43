"""``ClosedLoopEval`` in a short ``fit`` of the tiny Pi0.5 on Reach2D demonstrations (CSV and offline W&B
loggers), and ``forge-eval`` on the checkpoint it leaves."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from forge_lightning.callbacks import ClosedLoopEval
from forge_lightning.datamodules.lerobot import LeRobotDataModule
from forge_lightning.modules.embodied import Pi05Policy
from forge_lightning.tools.evaluate import main as forge_eval

CHUNK = [round(0.1 * k, 1) for k in range(10)]
EVAL_ARGS = {"num_episodes": 4, "num_envs": 2, "max_episode_steps": 12, "n_action_steps": 5, "num_videos": 1}


def _run_config(reach_data) -> dict:
    """The run as a ``forge fit`` YAML would describe it (read by forge-eval)."""
    return {
        "model": {
            "class_path": "forge_lightning.modules.embodied.Pi05Policy",
            "init_args": {"config": "quickstart", "tokenizer": str(reach_data["tokenizer"])},
        },
        "data": {
            "class_path": "forge_lightning.datamodules.lerobot.LeRobotDataModule",
            "init_args": {"roots": [str(reach_data["dataset"])], "delta_timestamps": {"action": CHUNK}},
        },
        "trainer": {
            "callbacks": [
                {
                    "class_path": "forge_lightning.callbacks.ClosedLoopEval",
                    "init_args": {"env": "forge/Reach2D-v0", **EVAL_ARGS},
                }
            ]
        },
    }


@pytest.fixture(scope="module")
def run(reach_data, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("closed_loop")
    callback = ClosedLoopEval(every_n_steps=2, video_dir=str(root / "videos"), **EVAL_ARGS)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            mp.setenv(name, str(root / "wandb"))
        torch.manual_seed(0)
        wandb = WandbLogger(project="forge-test", save_dir=str(root), offline=True)
        trainer = Trainer(
            max_steps=4,
            accelerator="cpu",
            logger=[CSVLogger(str(root), name="csv"), wandb],
            callbacks=[callback, ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True)],
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        policy = Pi05Policy("quickstart", tokenizer=str(reach_data["tokenizer"]), optimizer={"lr": 1e-3})
        datamodule = LeRobotDataModule(
            str(reach_data["dataset"]),
            delta_timestamps={"action": CHUNK},
            normalization={"observation.state": "min_max", "action": "min_max"},
            batch_size=8,
            num_workers=0,
            pin_memory=False,
        )
        trainer.fit(policy, datamodule)
        wandb.experiment.finish()
        import wandb as wandb_sdk

        wandb_sdk.teardown()  # stop the W&B service this process started, so no later test inherits it
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(_run_config(reach_data)))
    return {
        "root": root,
        "callback": callback,
        "trainer": trainer,
        "config": config,
        "wandb_dir": Path(wandb.experiment.dir),
    }


def test_callback_evaluates_every_n_steps_and_logs(run):
    callback, root = run["callback"], run["root"]
    assert [step for step, _ in callback.history] == [2, 4]  # the end of training (step 4) is not repeated
    for _, metrics in callback.history:
        assert metrics["episodes"] == 4
        assert metrics["success_ci_low"] <= metrics["success_rate"] <= metrics["success_ci_high"]
        assert 1 <= metrics["mean_length"] <= 12
    rows = list(csv.DictReader((Path(run["trainer"].loggers[0].log_dir) / "metrics.csv").open()))
    logged = sorted(int(r["step"]) for r in rows if r.get("eval/success_rate"))
    assert logged == [2, 4]
    for step in (2, 4):
        assert len(list((root / "videos" / f"step_{step:06d}").glob("episode_000_*.mp4"))) == 1


def test_callback_logs_videos_to_wandb(run):
    media = list(run["wandb_dir"].rglob("*.mp4"))
    assert len(media) == 2, media  # one video per evaluation


def test_forge_eval_runs_the_checkpoint_and_the_random_baseline(run, capsys):
    output = run["root"] / "eval"
    ckpt = run["root"] / "ckpt" / "last.ckpt"
    forge_eval(
        [
            "--config",
            str(run["config"]),
            "--ckpt",
            str(ckpt),
            "--episodes",
            "3",
            "--baseline",
            "random",
            "--output",
            str(output),
        ]
    )
    out = capsys.readouterr().out
    assert "policy: success" in out and "random: success" in out and "success rate: policy" in out
    for name in ("policy", "random"):
        metrics = json.loads((output / name / "metrics.json").read_text())
        assert metrics["episodes"] == 3
        assert metrics["mean_length"] <= 12  # max_episode_steps from the run's ClosedLoopEval
        assert len(list((output / name / "videos").glob("*.mp4"))) == 1
    # the checkpoint's statistics are used: the loaded policy maps actions back to the dataset's units
    from forge_lightning.tools.evaluate import load_policy

    policy = load_policy(yaml.safe_load(run["config"].read_text()), ckpt, "cpu")
    assert isinstance(policy, Pi05Policy) and policy.normalizer is not None
    assert policy.normalizer.modes == {"observation.state": "min_max", "action": "min_max"}


def test_forge_eval_refuses_a_missing_checkpoint_and_unknown_env(run):
    with pytest.raises(SystemExit, match="--ckpt"):
        forge_eval(["--config", str(run["config"])])
    with pytest.raises(SystemExit, match="no adapter"):
        forge_eval(["--config", str(run["config"]), "--policy", "random", "--env", "nope/Nothing-v0"])

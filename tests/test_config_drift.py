"""A resumed run whose config no longer matches its checkpoint is refused, listing every differing key; data,
optimizer and scheduler changes pass only when named in ``--resume.allow_changes``."""

import csv
from pathlib import Path

import pytest
import torch

from forge_lightning.callbacks.config_drift import ConfigDriftCheck, compare, config_record
from forge_lightning.cli import main as forge

REPO = Path(__file__).resolve().parents[1]
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"


def test_compare_refuses_model_keys_and_allows_only_named_keys_or_prefixes():
    saved = config_record(
        {
            "model": {"init_args": {"config": {"rope_theta": 1e4}, "pretrained": "a"}},
            "data": {"init_args": {"seq_length": 64, "split": "969,30,1", "num_workers": 2}},
            "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
            "trainer": {"max_steps": 10},
        }
    )
    current = config_record(
        {
            "model": {"init_args": {"config": {"rope_theta": 5e5}, "pretrained": "b"}},
            "data": {"init_args": {"seq_length": 128, "split": "969,30,1", "num_workers": 8}},
            "optimizer": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
            "trainer": {"max_steps": 20},
        }
    )
    assert "trainer.max_steps" not in saved and "model.init_args.pretrained" not in saved
    drift = compare(saved, current, ["optimizer", "data.init_args.seq_length", "model.init_args.config"])
    assert [key for key, _, _ in drift.refused] == ["model.init_args.config.rope_theta"]
    assert [key for key, _, _ in drift.allowed] == [
        "data.init_args.seq_length",
        "optimizer.betas",
        "optimizer.lr",
    ]
    assert compare(saved, saved, []).refused == []


def test_allow_changes_outside_the_data_optimizer_and_scheduler_sections_is_refused():
    with pytest.raises(
        ValueError, match=r"\['model.init_args', 'trainer.max_steps'\]: only keys of the data"
    ):
        ConfigDriftCheck({}, allow_changes=["model.init_args", "trainer.max_steps", "scheduler"])


def _fit(corpus, *extra):
    args = ["fit", "--config", str(TINY_YAML), "--data.data_prefix", str(corpus["prefix"])]
    args += ["--data.tokenizer", str(corpus["tokenizer"]), "--trainer.logger.init_args.save_dir", "runs"]
    args += ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath=ckpt"]
    forge([*args, "--trainer.callbacks.every_n_train_steps=2", *extra])


def _steps(version: int) -> list[int]:
    rows = csv.DictReader((Path("runs") / "tiny" / f"version_{version}" / "metrics.csv").open())
    return sorted({int(r["step"]) for r in rows if r.get("train/loss")})


def test_resume_with_another_model_data_or_optimizer_config(tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fit(tiny_corpus, "--trainer.max_steps", "2")
    ckpt = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    saved = torch.load(ckpt, weights_only=True)["callbacks"]["ConfigDriftCheck"]["config"]
    assert saved["model.config.rope_theta"] == 10000.0 and saved["data.init_args.seq_length"] == 32
    assert not any(key.startswith("model.init_args.config") for key in saved)  # as the module resolved it

    resume = ["--trainer.max_steps", "4", "--ckpt_path", ckpt]
    with pytest.raises(
        ValueError, match=r"(?s)model.config.rope_theta: checkpoint 10000.0, now 20000\n.*cannot"
    ):
        _fit(tiny_corpus, *resume, "--model.init_args.config.rope_theta", "20000")
    changes = ["--data.seq_length", "16", "--optimizer.lr", "3e-4"]
    with pytest.raises(ValueError) as refused:
        _fit(tiny_corpus, *resume, *changes)
    message = str(refused.value)
    assert "data.init_args.seq_length: checkpoint 32, now 16" in message
    assert "optimizer.lr: checkpoint 0.001, now 0.0003" in message
    assert "--resume.allow_changes data.init_args.seq_length optimizer.lr" in message

    allow = ["--resume.allow_changes", "[data.init_args.seq_length, optimizer]"]
    with pytest.warns(UserWarning, match="with changes allowed by --resume.allow_changes"):
        _fit(tiny_corpus, *resume, *changes, *allow)
    assert _steps(3) == [2, 3]  # versions 1 and 2 were the refused resumes

"""``--ckpt_path last`` finds the run's newest complete last checkpoint across its ``version_N`` folders (or says
where it looked), a plain state dict given as ``--ckpt_path`` gets a message saying how to load weights, and the
temporaries of killed saves are removed when the next run starts."""

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from faults import overwrite_middle
from lightning.pytorch.loggers import CSVLogger
from procs import assert_clean_exit

from forge_lightning import manifest
from forge_lightning.resume import checkpoint_dirs, find_last_checkpoint, remove_stale_temporaries

REPO = Path(__file__).resolve().parents[1]
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"


def _trainer(root: Path) -> pl.Trainer:
    logger = CSVLogger(save_dir=root, name="run")
    return pl.Trainer(logger=logger, default_root_dir=root, accelerator="cpu", enable_progress_bar=False)


def _checkpoint_file(path: Path, age_s: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": 1}, path)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_last_is_the_newest_complete_one_of_every_version(tmp_path):
    older = _checkpoint_file(tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt", age_s=60)
    newer = _checkpoint_file(tmp_path / "run" / "version_1" / "checkpoints" / "last.ckpt", age_s=30)
    torn = tmp_path / "run" / "version_2" / "checkpoints" / "last.ckpt"
    torn.parent.mkdir(parents=True)
    torn.write_bytes(b"not a zip")  # newest, but not a checkpoint
    sharded = tmp_path / "run" / "version_3" / "checkpoints" / "last.ckpt"
    sharded.mkdir(parents=True)  # a directory without its meta.pt: a save that did not finish
    trainer = _trainer(tmp_path)
    assert older.parent in checkpoint_dirs(trainer)
    assert find_last_checkpoint(trainer) == newer
    (sharded / "meta.pt").write_bytes(b"")
    assert find_last_checkpoint(trainer) == sharded


def test_no_last_checkpoint_lists_where_it_looked(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"no complete last\*\.ckpt .*\n  .*run/version_0/checkpoints"
    ):
        find_last_checkpoint(_trainer(tmp_path))


def test_stale_temporaries_are_removed_and_a_moved_aside_checkpoint_is_kept(tmp_path):
    folder = tmp_path / "checkpoints"
    (folder / ".epoch=0-step=3.ckpt.tmp").mkdir(parents=True)  # a sharded save killed midway
    (folder / ".epoch=0-step=3.ckpt.tmp" / "__0_0.distcp").write_bytes(b"x" * 100)
    (folder / ".last.ckpt.k2j3.tmp").write_bytes(b"x" * 100)  # a single-file save killed midway
    (folder / ".last.ckpt.old").mkdir()  # the only copy after a crash between a replacement's renames
    (folder / "last.ckpt").write_bytes(b"")
    removed = remove_stale_temporaries([folder, tmp_path / "missing"])
    assert sorted(p.name for p in removed) == [".epoch=0-step=3.ckpt.tmp", ".last.ckpt.k2j3.tmp"]
    assert sorted(p.name for p in folder.iterdir()) == [".last.ckpt.old", "last.ckpt"]


def _forge(args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "forge_lightning", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _fit_args(corpus, *extra):
    args = ["fit", "--config", str(TINY_YAML), "--data.data_prefix", str(corpus["prefix"])]
    args += ["--data.tokenizer", str(corpus["tokenizer"]), "--trainer.logger.init_args.save_dir", "runs"]
    args += ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_last=true"]
    return [*args, "--trainer.callbacks.every_n_train_steps=2", *extra]


def test_forge_fit_ckpt_path_last_resumes_the_previous_version(tiny_corpus, tmp_path):
    first = _forge(_fit_args(tiny_corpus, "--trainer.max_steps", "2"), tmp_path)
    assert_clean_exit(first)
    checkpoints = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    (checkpoints / ".epoch=0-step=9.ckpt.tmp").mkdir()  # left by a save that was killed
    second = _forge(_fit_args(tiny_corpus, "--trainer.max_steps", "4", "--ckpt_path", "last"), tmp_path)
    assert_clean_exit(second)
    output = second.stdout + second.stderr
    assert f"--ckpt_path last: {checkpoints / 'last.ckpt'}" in output, output[-3000:]
    assert "removed 1 temporary file(s) of interrupted saves" in output, output[-3000:]
    assert not (checkpoints / ".epoch=0-step=9.ckpt.tmp").exists()
    rows = list(csv.DictReader((tmp_path / "runs" / "tiny" / "version_1" / "metrics.csv").open()))
    assert sorted({int(r["step"]) for r in rows if r.get("train/loss")}) == [
        2,
        3,
    ]  # steps 0-1 were not redone

    # The first case: 4 KiB overwritten in the middle of a checkpoint (same size) made `forge validate`
    # exit 0 on NaN weights. Its manifest refuses it now, naming the file.
    last = tmp_path / "runs" / "tiny" / "version_1" / "checkpoints" / "last.ckpt"
    assert manifest.verify(last).ok
    overwrite_middle(last)
    args = ["validate", *_fit_args(tiny_corpus)[1:], "--ckpt_path", str(last)]
    proc = _forge(args, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "last.ckpt: content changed" in output and "forge-convert verify" in output, output[-3000:]


def test_a_plain_state_dict_as_ckpt_path_says_how_to_load_weights(tiny_corpus, tmp_path):
    torch.save({"model.embed_tokens.weight": torch.zeros(512, 64)}, tmp_path / "weights.pt")
    proc = _forge(_fit_args(tiny_corpus, "--ckpt_path", str(tmp_path / "weights.pt")), tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "is a plain state dict, not a training checkpoint" in output, output[-3000:]
    assert "model.init_args.pretrained" in output and "KeyError" not in output

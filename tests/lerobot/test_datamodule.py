"""Episode split, weighted mixing, StepLoader resumption and decoding in forked DataLoader workers."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_lightning.datamodules.lerobot import LeRobotDataModule, LeRobotDataset, split_episodes
from forge_lightning.datamodules.loader import StepLoader

CAMERA = "observation.images.cam"


def test_split_is_by_episode_and_seeded():
    train, val = split_episodes(range(10), 0.2, seed=3)
    assert len(val) == 2 and sorted(train + val) == list(range(10)) and not set(train) & set(val)
    assert (train, val) == split_episodes(range(10), 0.2, seed=3)
    assert split_episodes(range(3), 0.1, seed=0)[1] != []  # at least one validation episode
    with pytest.raises(ValueError, match=r"val_fraction \(1.5\) must be in \[0, 1\)"):
        split_episodes(range(3), 1.5, seed=0)


def test_datamodule_split_and_mix(fixtures_dir):
    module = LeRobotDataModule(
        [str(fixtures_dir / "v30"), str(fixtures_dir / "v21")],
        weights=[3.0, 1.0],
        val_fraction=0.34,
        num_train_samples=40,
        batch_size=4,
        num_workers=0,
        pin_memory=False,
    )
    module.setup("fit")
    parts = module.train_dataset.datasets
    assert [len(p.episodes) for p in parts] == [2, 2]
    val_episodes = [d.episodes for d in module.val_dataset.datasets]
    assert all(len(v) == 1 for v in val_episodes)
    for part, val in zip(parts, val_episodes):
        assert not set(part.episodes) & set(val)
    sources = [int(module.train_dataset.dataset_index[i]) for i in range(40)]
    assert sources.count(0) == 30 and sources.count(1) == 10  # 3:1 mix
    item = module.train_dataset[0]
    assert item[CAMERA].shape == (3, 32, 32)
    with pytest.raises(ValueError, match=r"weights has 1 entries but roots has 2"):
        LeRobotDataModule([str(fixtures_dir / "v30")] * 2, weights=[1.0])


def _collect(loader: StepLoader, count: int) -> list[torch.Tensor]:
    seen = []
    for batch in loader:
        loader.mark_consumed()
        seen.append(batch["index"])
        if len(seen) == count:
            break
    return seen


def test_step_loader_resumes_exactly(fixtures_dir, delta_timestamps):
    dataset = LeRobotDataset(fixtures_dir / "v30", delta_timestamps=delta_timestamps)
    options = dict(batch_size=4, seed=7, label_key=None)
    full = _collect(StepLoader(dataset, **options), 10)
    first = StepLoader(dataset, **options)
    head = _collect(first, 4)
    resumed = StepLoader(dataset, **options)
    resumed.load_state_dict(first.state_dict())
    tail = _collect(resumed, 6)
    assert all(torch.equal(a, b) for a, b in zip(full, head + tail))


def _in_fresh_process(check: str, fixtures_dir) -> None:
    """Run a check of worker_checks.py in a new interpreter.

    Forking DataLoader workers from a process that earlier tests filled with thread pools (the Triton
    interpreter, gloo, tokenizers) can deadlock inside torch itself; these checks are about our decoders, so they
    start from a clean process, as a training job does.
    """
    script = Path(__file__).with_name("worker_checks.py")
    proc = subprocess.run(
        [sys.executable, str(script), check, str(fixtures_dir)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_forked_workers_decode_their_own_frames(fixtures_dir):
    """Workers never reuse decoders the parent opened before forking, and pickling drops them."""
    _in_fresh_process("forked_workers_decode_their_own_frames", fixtures_dir)


def test_datamodule_train_loader_with_workers(fixtures_dir):
    _in_fresh_process("datamodule_train_loader_with_workers", fixtures_dir)

"""Checks that fork DataLoader workers, run by test_datamodule.py in a fresh interpreter.

Usage: python worker_checks.py CHECK FIXTURES_DIR
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from forge_lightning.datamodules.lerobot import LeRobotDataModule, LeRobotDataset

CAMERA = "observation.images.cam"


def forked_workers_decode_their_own_frames(fixtures: Path) -> None:
    expected = load_file(str(fixtures / "v30_reading.safetensors"))["plain/" + CAMERA]
    dataset = LeRobotDataset(fixtures / "v30")
    dataset[0]  # the parent opens a decoder before the workers fork
    assert dataset.videos.num_open == 1
    assert pickle.loads(pickle.dumps(dataset)).videos.num_open == 0
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=6, num_workers=2, multiprocessing_context="fork", shuffle=False
    )
    frames = torch.cat([batch[CAMERA] for batch in loader])
    assert torch.equal(torch.round(frames * 255).to(torch.uint8), expected)
    assert dataset.videos.num_open == 1  # the parent's decoder was left alone


def datamodule_train_loader_with_workers(fixtures: Path) -> None:
    module = LeRobotDataModule(str(fixtures / "forge_v30"), batch_size=8, num_workers=2, pin_memory=False)
    module.setup("fit")
    loader = module.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) == 7
    indices = torch.cat([b["index"] for b in batches])
    assert len(set(indices.tolist())) == 56
    assert batches[0][CAMERA].shape == (8, 3, 32, 32)


if __name__ == "__main__":
    globals()[sys.argv[1]](Path(sys.argv[2]))

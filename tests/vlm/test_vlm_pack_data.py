"""Packing in ``VLMDataModule``: packed rows hold several samples with their images in order, the host-side
positions equal the model's own, and training on packed rows gives every trained token the loss it has unpacked
(fp32, 1e-5), also through the training loader (``step_tokens``); the cap on vision patches per row holds; the bins
of ``forge-data vlm-pack`` equal the online packer's and a bins file of other data or options is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vlm_pack_case import datamodule, model, per_sample_losses, token_losses, write_data

from forge_lightning.datamodules.vlm.packing import packed_collate
from forge_lightning.tools.data import main as forge_data

TOL = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return write_data(tmp_path_factory.mktemp("vlm_pack"))


def test_packed_training_gives_each_token_its_unpacked_loss(data) -> None:
    plain = datamodule(*data)
    packed = datamodule(*data, pack=True)
    rows = packed.train_dataset
    assert len(rows) < len(plain.train_dataset) and all(len(b) >= 1 for b in rows.bins)
    assert sorted(i for b in rows.bins for i in b) == list(range(len(plain.train_dataset)))
    with_images = [b for b in rows.bins if sum(len(rows.dataset.samples[i].images) for i in b) >= 2]
    assert with_images, "a row should hold several images"
    row = rows[rows.bins.index(with_images[0])]
    assert row["position_ids"].shape == (3, 160) and row["document_ids"].shape == (160,)
    assert int(row["image_grid_thw"].prod(-1).sum()) == row["pixel_values"].shape[0]

    vlm = model(plain)
    batch = packed.collate_fn([rows[i] for i in range(len(rows))])
    assert batch["position_ids"].shape == (3, len(rows), 160) and "attention_mask" not in batch
    with torch.no_grad():  # the host-side positions are those the model computes per document
        without = {k: v for k, v in batch.items() if k != "position_ids"}
        torch.testing.assert_close(token_losses(vlm, batch), token_losses(vlm, without), atol=1e-6, rtol=0)

    ours, reference = per_sample_losses(vlm, packed), per_sample_losses(vlm, plain)
    assert ours.keys() == reference.keys()
    for i, losses in reference.items():
        torch.testing.assert_close(ours[i], losses, atol=TOL, rtol=TOL, msg=f"sample {i}")

    means = []
    for dm in (plain, packed):  # one training step over the whole epoch through the training loader
        dm.batch_size = len(dm.train_dataset)
        (loaded,) = list(dm.train_dataloader())
        with torch.no_grad():
            means.append(token_losses(vlm, loaded).sum() / loaded["step_tokens"])
    torch.testing.assert_close(means[0], means[1], atol=TOL, rtol=TOL)


def test_vision_patch_cap_per_row(data) -> None:
    free = datamodule(*data, pack=True).train_dataset
    capped = datamodule(*data, pack=True, max_patches_per_row=160).train_dataset
    patches = [sum(capped.dataset.samples[i].num_patches for i in b) for b in capped.bins]
    assert max(patches) <= 160
    assert max(sum(free.dataset.samples[i].num_patches for i in b) for b in free.bins) > 160
    with pytest.raises(ValueError, match=r"train.jsonl:\d+: its images have \d+ vision patches, more than "):
        datamodule(*data, pack=True, max_patches_per_row=100)
    with pytest.raises(ValueError, match="max_patches_per_row caps packed rows: set pack"):
        datamodule(*data, max_patches_per_row=100)


def test_offline_bins_equal_the_online_packers_and_are_checked(data, tmp_path: Path) -> None:
    tokenizer, train = data
    out = tmp_path / "bins.jsonl"
    argv = ["vlm-pack", "--input", str(train), "--tokenizer", str(tokenizer), "--output", str(out)]
    options = ["--processor", "qwen2_vl", "--patch-size", "4", "--min-pixels", "256", "--max-pixels", "1024"]
    forge_data([*argv, *options, "--seq-length", "160", "--max-patches-per-row", "160"])
    online = datamodule(*data, pack=True, max_patches_per_row=160).train_dataset
    offline = datamodule(*data, packed_bins=str(out)).train_dataset
    assert offline.bins == online.bins
    head, first = (json.loads(line) for line in out.read_text().splitlines()[:2])
    assert head["format"] == "forge-vlm-pack" and head["rows"] == len(online) and head["samples"] == 12
    assert first["samples"] == online.bins[0] and first["patches"] <= 160
    vlm = model(datamodule(*data))
    with torch.no_grad():  # the same rows, so the same per-token losses
        torch.testing.assert_close(
            token_losses(vlm, packed_collate([offline[i] for i in range(len(offline))])),
            token_losses(vlm, packed_collate([online[i] for i in range(len(online))])),
            atol=0,
            rtol=0,
        )

    with pytest.raises(ValueError, match=r"packed for seq_length 160, but this run has 200"):
        datamodule(*data, packed_bins=str(out), seq_length=200)
    lines = out.read_text().splitlines()
    row = json.loads(lines[1])
    row["tokens"][0] += 1
    out.write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")
    with pytest.raises(
        ValueError, match=r"bins.jsonl:2: sample \d+ was .*train.jsonl:\d+ with \d+ tokens when packed"
    ):
        datamodule(*data, packed_bins=str(out))
    out.write_text("not a bins file\n")
    with pytest.raises(ValueError, match="not a forge-vlm-pack v1 bins file"):
        datamodule(*data, packed_bins=str(out))

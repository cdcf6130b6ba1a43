"""Our reader against lerobot's own readings of the same datasets, item by item, exactly.

Frames are compared for exact equality: both sides decode with PyAV (lerobot 0.3.3 / 0.4.4 through
torchvision's PyAV reader, PyAV 15; ours with the project's PyAV) using dav1d and FFmpeg's rgb24 conversion.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forge_lightning.datamodules.lerobot import LeRobotDataset, LeRobotFormatError, LeRobotMeta

CAMERA = "observation.images.cam"
DATASETS = ("v20", "v21", "v30", "forge_v30")
VERSIONS = {"v20": "v2.0", "v21": "v2.1", "v30": "v3.0", "forge_v30": "v3.0"}


def _stack(dataset: LeRobotDataset, indices: list[int], key: str) -> torch.Tensor:
    values = torch.stack([dataset[i][key] for i in indices])
    if key == CAMERA:  # lerobot's frames are uint8 / 255: the fixture keeps the uint8 values
        assert torch.equal(torch.round(values * 255) / 255, values)
        values = torch.round(values * 255).to(torch.uint8)
    return values


@pytest.mark.parametrize("name", DATASETS)
def test_items_equal_lerobot(name, fixtures_dir, reference, delta_timestamps):
    expected = reference(name)
    assert LeRobotMeta(fixtures_dir / name).version == VERSIONS[name]
    plain = LeRobotDataset(fixtures_dir / name)
    delta = LeRobotDataset(fixtures_dir / name, delta_timestamps=delta_timestamps)
    assert len(plain) == len(expected["plain/indices"]) == 60
    for prefix, dataset in (("plain", plain), ("delta", delta)):
        indices = expected[f"{prefix}/indices"].tolist()
        keys = [
            k.split("/", 1)[1] for k in expected if k.startswith(f"{prefix}/") and k != f"{prefix}/indices"
        ]
        assert CAMERA in keys and "action" in keys
        for key in keys:
            ours, theirs = _stack(dataset, indices, key), expected[f"{prefix}/{key}"]
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (prefix, key)
            assert torch.equal(ours, theirs), (prefix, key)
    tasks = json.loads((fixtures_dir / f"{name}_reading.json").read_text())["tasks"]
    assert [plain[i]["task"] for i in range(len(plain))] == tasks


def test_pad_flags_at_episode_edges(fixtures_dir, delta_timestamps):
    dataset = LeRobotDataset(fixtures_dir / "v30", delta_timestamps=delta_timestamps)
    first, last = dataset[20], dataset[39]  # first and last frame of episode 1
    assert first["observation.state_is_pad"].tolist() == [True, True, False]
    assert first[f"{CAMERA}_is_pad"].tolist() == [True, False]
    assert last["action_is_pad"].tolist() == [False, True, True, True, True]
    # padded positions repeat the episode's edge frame (clamped, like lerobot)
    assert torch.equal(first["observation.state"][0], first["observation.state"][2])
    assert torch.equal(last["action"][4], last["action"][0])
    assert torch.equal(first[CAMERA][0], first[CAMERA][1])


def test_episode_subset_reads_the_same_frames(fixtures_dir, reference):
    expected = reference("v21")["plain/observation.state"]
    subset = LeRobotDataset(fixtures_dir / "v21", episodes=[2, 0])
    assert len(subset) == 40 and subset.episodes == [0, 2]
    assert torch.equal(
        torch.stack([subset[i]["observation.state"] for i in range(40)]),
        expected[[*range(20), *range(40, 60)]],
    )


def test_missing_root_unknown_version_corrupt_parquet(tmp_path, copy_of):
    with pytest.raises(LeRobotFormatError, match="does not exist"):
        LeRobotDataset(tmp_path / "nowhere")
    root = copy_of("v30")
    info = json.loads((root / "meta" / "info.json").read_text())
    (root / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v1.6"}))
    with pytest.raises(
        LeRobotFormatError,
        match="info.json: codebase_version: expected one of v2.0, v2.1, v3.0, found 'v1.6'",
    ):
        LeRobotDataset(root)
    (root / "meta" / "info.json").write_text(json.dumps(info))
    data = root / "data" / "chunk-000" / "file-000.parquet"
    data.write_bytes(data.read_bytes()[:200])
    with pytest.raises(LeRobotFormatError, match="file-000.parquet is not a readable parquet file"):
        LeRobotDataset(root)


def test_bad_options_name_field_and_value(fixtures_dir):
    with pytest.raises(ValueError, match=r"delta_timestamps\['action'\] \(0.05\) is not a multiple of 1/fps"):
        LeRobotDataset(fixtures_dir / "v30", delta_timestamps={"action": [0.0, 0.05]})
    with pytest.raises(ValueError, match="'gripper' is not a feature"):
        LeRobotDataset(fixtures_dir / "v30", delta_timestamps={"gripper": [0.0]})
    with pytest.raises(ValueError, match=r"normalization\['action'\] \('zscore'\) must be one of"):
        LeRobotDataset(fixtures_dir / "v30", normalization={"action": "zscore"})
    with pytest.raises(ValueError, match="episodes"):
        LeRobotDataset(fixtures_dir / "v30", episodes=[7])


def test_writer_output_matches_source_frames(fixtures_dir):
    """The writer's mp4 holds the frames it was given, up to the codec's loss (AV1, crf 30)."""
    import sys

    sys.path.insert(0, str(fixtures_dir.parents[2] / "scripts"))
    try:
        from make_lerobot_fixtures import make_frame
    finally:
        sys.path.pop(0)
    dataset = LeRobotDataset(fixtures_dir / "forge_v30")
    for i in (0, 25, 59):
        item = dataset[i]
        source = make_frame(int(item["episode_index"]), int(item["frame_index"]))
        assert torch.equal(item["observation.state"], torch.from_numpy(source["observation.state"]))
        decoded = item[CAMERA].permute(1, 2, 0).numpy() * 255
        assert np.abs(decoded - source[CAMERA]).mean() < 6

"""Stats (loaded, aggregated, computed by ``forge-data lerobot-stats``, written by ``LeRobotWriter``) and
normalisation against lerobot's; histogram camera stats against a float64 reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forge_lightning.datamodules.lerobot import (
    LeRobotDataset,
    LeRobotMeta,
    LeRobotWriter,
    Normalizer,
    aggregate_stats,
    feature_stats,
    image_stats,
)
from forge_lightning.datamodules.lerobot.meta import read_parquet
from forge_lightning.tools.lerobot_data import add_commands

CAMERA = "observation.images.cam"
VECTORS = ("observation.state", "action", "timestamp", "frame_index", "episode_index", "index", "task_index")


def _forge_data(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="forge-data")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


def _lerobot_stats(expected: dict) -> dict[str, dict[str, np.ndarray]]:
    stats: dict[str, dict[str, np.ndarray]] = {}
    for key, value in expected.items():
        if key.startswith("stats/"):
            _, feature, name = key.split("/")
            stats.setdefault(feature, {})[name] = value.double().numpy()
    return stats


@pytest.mark.parametrize("name", ["v20", "v21", "v30", "forge_v30"])
def test_loaded_stats_equal_lerobot(name, fixtures_dir, reference):
    """v2.1 aggregates episodes_stats.jsonl at load time, v2.0 / v3.0 read stats.json: all as lerobot does."""
    theirs = _lerobot_stats(reference(name))
    ours = LeRobotMeta(fixtures_dir / name).stats
    assert set(ours) == set(theirs)
    for feature, stats in theirs.items():
        assert set(stats) <= set(ours[feature]), feature
        for stat, value in stats.items():
            np.testing.assert_allclose(
                np.asarray(ours[feature][stat], dtype=np.float64), value, rtol=1e-6, atol=1e-9
            )


@pytest.mark.parametrize("name", ["v20", "v21", "v30"])
def test_computed_stats_match_lerobot(name, copy_of, reference, capsys):
    """``lerobot-stats`` recomputes what lerobot wrote, in the version's layout.

    mean / std / min / max / count of the numeric features are exact (to float64 rounding). Quantiles are
    exact order statistics here but a 5000-bin histogram estimate in lerobot 0.4.4: checked against our own
    definition (numpy's linear interpolation over the episode's frames). Camera stats come from the decoded
    video here but from the frames before encoding in lerobot: equal up to the codec's loss.
    """
    root = copy_of(name)
    theirs = _lerobot_stats(reference(name))
    (root / "meta" / ("episodes_stats.jsonl" if name == "v21" else "stats.json")).unlink()
    assert LeRobotMeta(root).stats is None
    _forge_data(["lerobot-stats", str(root)])
    assert "wrote" in capsys.readouterr().out
    assert (root / "meta" / ("episodes_stats.jsonl" if name == "v21" else "stats.json")).exists()
    ours = LeRobotMeta(root).stats
    for feature in VECTORS:
        for stat in ("mean", "std", "min", "max", "count"):
            np.testing.assert_allclose(
                np.ravel(ours[feature][stat]), np.ravel(theirs[feature][stat]), rtol=1e-6, atol=1e-7
            )
        for stat in ("q01", "q10", "q50", "q90", "q99"):
            assert stat in ours[feature]
    np.testing.assert_allclose(ours[CAMERA]["mean"], theirs[CAMERA]["mean"], atol=0.01)
    values = LeRobotDataset(root, episodes=[1]).columns["observation.state"]
    per_episode = (
        json.loads((root / "meta" / "episodes_stats.jsonl").read_text().splitlines()[1])["stats"]
        if name == "v21"
        else None
    )
    if per_episode is not None:
        np.testing.assert_allclose(
            per_episode["observation.state"]["q90"], np.quantile(values, 0.9, axis=0), rtol=1e-6
        )


def test_stats_command_refuses_to_overwrite(fixtures_dir):
    with pytest.raises(SystemExit, match="already has stats: pass --force"):
        _forge_data(["lerobot-stats", str(fixtures_dir / "v30")])
    with pytest.raises(SystemExit, match="does not exist"):
        _forge_data(["lerobot-stats", str(fixtures_dir / "missing")])


@pytest.mark.parametrize("mode", ["mean_std", "min_max", "quantiles", "quantile10"])
def test_normalisation_uses_dataset_stats(mode, fixtures_dir, reference):
    stats = _lerobot_stats(reference("v30"))["action"]
    plain = LeRobotDataset(fixtures_dir / "v30")
    normed = LeRobotDataset(fixtures_dir / "v30", normalization={"action": mode, CAMERA: "identity"})
    x = torch.stack([plain[i]["action"] for i in range(len(plain))]).double()
    y = torch.stack([normed[i]["action"] for i in range(len(normed))]).double()
    low, high = {
        "mean_std": ("mean", "std"),
        "min_max": ("min", "max"),
        "quantiles": ("q01", "q99"),
        "quantile10": ("q10", "q90"),
    }[mode]
    low, high = torch.from_numpy(stats[low]), torch.from_numpy(stats[high])
    expected = (x - low) / (high + 1e-8) if mode == "mean_std" else 2 * (x - low) / (high - low) - 1
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    if mode == "min_max":
        assert y.min() >= -1 - 1e-6 and y.max() <= 1 + 1e-6
        torch.testing.assert_close(y.amin(0), torch.full((2,), -1.0, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.equal(normed[3][CAMERA], plain[3][CAMERA])
    normalizer = Normalizer(stats={"action": stats}, modes={"action": mode})
    torch.testing.assert_close(normalizer.unnormalize("action", normalizer.normalize("action", x)), x)


def test_normalisation_without_stats_names_the_command(copy_of):
    root = copy_of("v20")
    (root / "meta" / "stats.json").unlink()
    with pytest.raises(ValueError, match="forge-data lerobot-stats"):
        LeRobotDataset(root, normalization={"action": "mean_std"})


def _exact_image_stats(frames_THWC: np.ndarray) -> dict[str, np.ndarray]:
    """The float64 reference: every pixel as a float in [0, 1], numpy reductions and quantiles."""
    return feature_stats(frames_THWC.transpose(0, 3, 1, 2) / 255.0, image=True)


@pytest.mark.parametrize(
    ("shape", "values"),
    [
        ((1, 1, 1, 3), None),  # one pixel: every quantile is that pixel
        ((2, 3, 5, 3), None),  # fewer pixels than quantile steps: interpolation between neighbours
        ((12, 17, 9, 3), None),
        ((9, 16, 16, 3), (0, 85, 170, 255)),  # four levels: long runs of ties around every quantile
        ((4, 8, 8, 1), (77,)),  # a constant channel
    ],
)
def test_histogram_image_stats_equal_float64_reference(shape, values):
    """``image_stats`` (256-bin histograms) gives the float64 pass's values: every stat within 1e-12."""
    rng = np.random.default_rng(sum(shape))
    frames = rng.choice(np.arange(256) if values is None else np.array(values), shape).astype(np.uint8)
    ours, exact = image_stats(frames), _exact_image_stats(frames)
    assert (
        set(ours) == set(exact) == {"min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99"}
    )
    for name, value in exact.items():
        assert ours[name].shape == value.shape, name
        np.testing.assert_allclose(ours[name], value, rtol=0, atol=1e-12, err_msg=name)
    channels_first = image_stats(np.ascontiguousarray(frames.transpose(0, 3, 1, 2)), channel_axis=1)
    for name, value in ours.items():
        np.testing.assert_array_equal(channels_first[name], value, err_msg=name)


def test_histogram_image_stats_are_exact_on_large_episodes():
    """On 40 x 64 x 64 x 3 frames the mean equals the integer sum's to 1e-15; numpy's float64 pass drifts more."""
    frames = np.random.default_rng(0).integers(0, 256, (40, 64, 64, 3), dtype=np.uint8)
    ours, exact = image_stats(frames), _exact_image_stats(frames)
    integer_mean = frames.reshape(-1, 3).sum(axis=0, dtype=np.int64) / (frames.size // 3) / 255.0
    np.testing.assert_allclose(ours["mean"].ravel(), integer_mean, rtol=0, atol=1e-15)
    for name, value in exact.items():
        np.testing.assert_allclose(ours[name], value, rtol=0, atol=1e-12, err_msg=name)
    with pytest.raises(TypeError, match="uint8"):
        image_stats(frames / 255.0)


def test_writer_camera_stats_equal_float64_reference(tmp_path):
    """The writer's per-episode and dataset camera stats (parquet columns, stats.json) match the float64 pass."""
    rng = np.random.default_rng(1)
    camera = {"dtype": "video", "shape": (32, 32, 3), "names": ["height", "width", "channels"]}
    writer = LeRobotWriter(
        tmp_path / "ds",
        fps=10,
        features={CAMERA: camera, "action": {"dtype": "float32", "shape": (2,)}},
        codec="libx264",
    )
    episodes = [rng.integers(0, 256, (length, 32, 32, 3), dtype=np.uint8) for length in (5, 8)]
    for frames in episodes:
        for image in frames:
            writer.add_frame({CAMERA: image, "action": rng.normal(size=2)}, task="push")
        writer.save_episode()
    root = writer.finalize()
    expected = [_exact_image_stats(frames) for frames in episodes]
    meta = LeRobotMeta(root)
    for name, value in aggregate_stats([{CAMERA: e} for e in expected])[CAMERA].items():
        np.testing.assert_allclose(np.asarray(meta.stats[CAMERA][name]), value, rtol=0, atol=1e-12)
    table = read_parquet(next((root / "meta" / "episodes").rglob("*.parquet"))).to_pydict()
    for e, stats in enumerate(expected):
        for name, value in stats.items():
            np.testing.assert_allclose(
                np.asarray(table[f"stats/{CAMERA}/{name}"][e]), value, rtol=0, atol=1e-12
            )

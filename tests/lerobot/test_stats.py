"""Stats (loaded, aggregated, computed by ``forge-data lerobot-stats``) and normalisation against lerobot's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forge_lightning.datamodules.lerobot import LeRobotDataset, LeRobotMeta, Normalizer
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

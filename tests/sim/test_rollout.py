"""The closed-loop rollout: chunked execution and re-planning, vectorised episodes, seeds, metrics, videos."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forge_lightning.datamodules.lerobot import Normalizer
from forge_lightning.sim.adapters import adapter_for
from forge_lightning.sim.envs import make_vector_env
from forge_lightning.sim.evaluate import EvalConfig, evaluate_policy
from forge_lightning.sim.rollout import RandomPolicy, Rollout


def _run(policy, num_episodes, *, num_envs=4, vectorization="sync", n_action_steps=None, seed=100, **kwargs):
    envs = make_vector_env("forge/Reach2D-v0", num_envs, vectorization=vectorization)
    try:
        rollout = Rollout(
            policy, envs, adapter_for("forge/Reach2D-v0"), n_action_steps=n_action_steps, **kwargs
        )
        return rollout.run(num_episodes, seed=seed)
    finally:
        envs.close()


def test_image_policy_solves_reach2d_in_closed_loop(image_policy):
    episodes = _run(image_policy, 24, n_action_steps=2)
    assert [r.index for r in episodes] == list(range(24))
    assert [r.seed for r in episodes] == [100 + i for i in range(24)]
    assert np.mean([r.success for r in episodes]) >= 0.95
    assert all(0 < r.length < 50 for r in episodes if r.success)


def test_episodes_do_not_depend_on_the_number_of_envs_or_the_vectorization(image_policy):
    one = _run(image_policy, 6, num_envs=1)
    three = _run(image_policy, 6, num_envs=3, vectorization="async")
    assert [(r.success, r.length) for r in one] == [(r.success, r.length) for r in three]
    np.testing.assert_allclose([r.reward for r in one], [r.reward for r in three], rtol=1e-6)


def test_chunks_run_open_loop_for_n_action_steps(image_policy):
    episodes = _run(image_policy, 1, num_envs=1, n_action_steps=3)
    # one policy call per 3 steps of the episode
    assert len(image_policy.calls) == -(-episodes[0].length // 3)
    image_policy.calls.clear()
    episodes = _run(image_policy, 1, num_envs=1)  # default: the whole chunk (4)
    assert len(image_policy.calls) == -(-episodes[0].length // 4)


def test_idle_envs_and_video_frames(image_policy):
    episodes = _run(image_policy, 3, num_envs=5, num_videos=2)  # more envs than episodes
    assert len(episodes) == 3
    assert [r.frames is not None for r in episodes] == [True, True, False]
    # a frame before every step and the final one
    assert len(episodes[0].frames) == episodes[0].length + 1
    assert episodes[0].frames[0].shape == (32, 32, 3)


def test_observations_are_normalised_with_the_policys_statistics(image_policy):
    """A policy that carries a normalizer gets the normalised state (here: a shift by the stats' q01/q99)."""
    stats = {"observation.state": {"q01": np.array([-2.0, -2.0]), "q99": np.array([2.0, 2.0])}}
    seen = []

    class Normalised:
        normalizer = Normalizer(stats=stats, modes={"observation.state": "quantiles"})

        def predict_action_chunk(self, batch):
            seen.append(batch["observation.state"].clone())
            batch = {**batch, "observation.state": batch["observation.state"] * 2}  # back to arena units
            return image_policy.predict_action_chunk(batch)

    episodes = _run(Normalised(), 4)
    assert all(r.success for r in episodes)
    assert torch.cat(seen).abs().max() <= 0.5  # arena [-1, 1] is [-0.5, 0.5] after normalisation


def test_evaluate_policy_reports_metrics_and_writes_videos(image_policy, tmp_path):
    config = EvalConfig(num_episodes=10, num_envs=5, n_action_steps=4, num_videos=2, seed=5)
    report = evaluate_policy(image_policy, config, video_dir=tmp_path)
    m = report.metrics
    assert m["episodes"] == 10 and m["success_rate"] == 1.0
    assert (m["success_ci_low"], m["success_ci_high"]) == pytest.approx((0.722467, 1.0), abs=1e-6)
    assert m["length_ci_low"] <= m["mean_length"] <= m["length_ci_high"]
    assert sorted(p.name for p in report.videos) == ["episode_000_success.mp4", "episode_001_success.mp4"]
    assert all(p.stat().st_size > 0 for p in report.videos)
    assert "success 1.000 [0.722, 1.000]" in report.format()


def test_random_policy_baseline_rarely_succeeds():
    envs = make_vector_env("forge/Reach2D-v0", 1)
    policy = RandomPolicy(envs.single_action_space, chunk_size=10, seed=0)
    envs.close()
    report = evaluate_policy(policy, EvalConfig(num_episodes=40, num_envs=8, num_videos=0))
    assert report.metrics["success_rate"] <= 0.15
    assert report.metrics["mean_length"] > 40


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"env": "nope/Nothing-v0"}, "no adapter"),
        ({"num_episodes": 0}, "num_episodes"),
        ({"vectorization": "threads"}, "vectorization"),
    ],
)
def test_bad_eval_settings_are_refused(kwargs, match):
    with pytest.raises((KeyError, ValueError), match=match):
        EvalConfig(**kwargs)

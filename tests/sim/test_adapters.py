"""Adapters of the optional simulators (the ``sim`` extra): gym-pusht's PushT and gym-aloha's MuJoCo tasks,
run for real when their packages are installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forge_lightning.sim.adapters import adapter_for
from forge_lightning.sim.envs import make_env, make_vector_env
from forge_lightning.sim.evaluate import EvalConfig, evaluate_policy
from forge_lightning.sim.rollout import Rollout


class GoTo:
    """Sends every env to one absolute action (PushT: a target position) and remembers the states it saw."""

    def __init__(self, action) -> None:
        self.action = torch.as_tensor(action, dtype=torch.float64)
        self.states: list[torch.Tensor] = []

    def predict_action_chunk(self, batch):
        self.states.append(batch["observation.state"].clone())
        return self.action.expand(len(batch["task"]), 4, -1)


def test_pusht_features_are_lerobot_pushts():
    pytest.importorskip("gym_pusht")
    adapter = adapter_for("gym_pusht/PushT-v0")
    env = make_env("gym_pusht/PushT-v0")
    features = adapter.features(env)
    assert features["observation.image"] == {
        "dtype": "video",
        "shape": [96, 96, 3],
        "names": ["height", "width", "channels"],
    }
    assert features["observation.state"]["shape"] == [2] and features["action"]["shape"] == [2]
    obs, _ = env.reset(seed=0)
    mapped = adapter.observation({k: v[None] for k, v in obs.items()})
    np.testing.assert_allclose(mapped["observation.state"][0], obs["agent_pos"], rtol=1e-6)
    assert mapped["observation.image"].dtype == np.uint8
    # actions are absolute positions in [0, 512]: passed through, clipped to the space
    np.testing.assert_array_equal(
        adapter.action(np.array([[100.0, 700.0]]), env.action_space), [[100.0, 512.0]]
    )
    env.close()


def test_pusht_agent_follows_the_policys_actions():
    pytest.importorskip("gym_pusht")
    envs = make_vector_env("gym_pusht/PushT-v0", 2, max_episode_steps=30)
    policy = GoTo([300.0, 200.0])
    try:
        episodes = Rollout(policy, envs, adapter_for("gym_pusht/PushT-v0"), n_action_steps=4).run(2, seed=0)
    finally:
        envs.close()
    assert [r.length for r in episodes] == [30, 30]
    assert all(0.0 <= r.reward <= 30.0 for r in episodes)
    final = policy.states[-1]
    assert torch.linalg.norm(final - torch.tensor([300.0, 200.0]), dim=-1).max() < 20  # the agent got there


def test_pi05_runs_in_pusht(reach_data):
    pytest.importorskip("gym_pusht")
    from forge_lightning.modules.embodied import Pi05Policy

    torch.manual_seed(0)
    policy = Pi05Policy(
        "quickstart", tokenizer=str(reach_data["tokenizer"]), image_keys=["observation.image"]
    )
    config = EvalConfig(
        env="gym_pusht/PushT-v0", num_episodes=2, num_envs=2, max_episode_steps=6, num_videos=0
    )
    report = evaluate_policy(policy, config)
    assert report.metrics["episodes"] == 2 and report.metrics["mean_length"] == 6


@pytest.mark.slow
def test_aloha_insertion_features_and_joint_actions():
    pytest.importorskip("gym_aloha")
    adapter = adapter_for("gym_aloha/AlohaInsertion-v0")
    envs = make_vector_env("gym_aloha/AlohaInsertion-v0", 1, max_episode_steps=3)
    obs, _ = envs.reset(seed=0)
    features = adapter.observation(obs)
    assert features["observation.images.top"].shape == (1, 480, 640, 3)
    assert features["observation.state"].shape == (1, 14)
    hold = features["observation.state"][0].astype(np.float64)  # joint targets = current joints: stay put
    policy = GoTo(hold)
    try:
        episodes = Rollout(policy, envs, adapter, num_videos=1).run(1, seed=0)
    finally:
        envs.close()
    assert episodes[0].length == 3 and not episodes[0].success
    assert len(episodes[0].frames) == 4
    np.testing.assert_allclose(policy.states[-1][0].numpy(), hold, atol=0.1)

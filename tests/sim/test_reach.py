"""``forge/Reach2D-v0``: gymnasium API, determinism, the image, and the scripted expert's success."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from forge_lightning.sim.envs import make_env
from forge_lightning.sim.reach import Reach2DEnv, Reach2DExpert


def _episode(env, policy, seed):
    obs, info = env.reset(seed=seed)
    images, done, steps, reward = [obs["pixels"]], False, 0, 0.0
    while not done:
        obs, r, terminated, truncated, info = env.step(policy(obs, info))
        images.append(obs["pixels"])
        done, steps, reward = terminated or truncated, steps + 1, reward + r
    return np.stack(images), info["is_success"], steps, reward


def test_passes_gymnasium_env_checker():
    check_env(make_env("forge/Reach2D-v0").unwrapped, skip_render_check=False)


def test_same_seed_same_episode_other_seed_other_episode():
    env = make_env("forge/Reach2D-v0")
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(50, 2))
    runs = []
    for seed in (7, 7, 8):
        obs, info = env.reset(seed=seed)
        trace = [obs["agent_pos"], info["target_pos"]]
        for a in actions[:10]:
            obs, *_ = env.step(a)
            trace.append(obs["agent_pos"])
        runs.append((np.stack(trace), obs["pixels"]))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert not np.allclose(runs[0][0], runs[2][0])


def test_image_shows_target_and_agent_where_they_are():
    env = Reach2DEnv(image_size=32)
    obs, info = env.reset(seed=3)
    image = obs["pixels"].astype(int)

    def pixel(xy):  # arena units -> (row, col)
        return int((1 - xy[1]) / 2 * 32), int((xy[0] + 1) / 2 * 32)

    red, blue = image[pixel(info["target_pos"])], image[pixel(obs["agent_pos"])]
    assert red[0] > 200 and red[1] < 80, red
    assert blue[2] > 200 and blue[0] < 80, blue
    # the target's position is in the image only, not in the state
    assert set(obs) == {"pixels", "agent_pos"}


def test_scripted_expert_solves_reach2d_and_random_does_not():
    env = make_env("forge/Reach2D-v0")
    expert = Reach2DExpert(env.unwrapped.max_speed)
    results = [
        _episode(env, lambda o, i: expert(o["agent_pos"], i["target_pos"]), seed) for seed in range(200)
    ]
    success = np.mean([r[1] for r in results])
    assert success >= 0.95, success
    assert success == 1.0  # measured: every one of the 200 episodes, in 8.5 steps on average
    assert np.mean([r[2] for r in results]) < 15
    # the return is the distance covered towards the target: positive for the expert
    assert min(r[3] for r in results) > 0.3
    rng = np.random.default_rng(0)
    random = np.mean([_episode(env, lambda o, i: rng.uniform(-1, 1, 2), seed)[1] for seed in range(200)])
    assert random < 0.1, random


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"image_size": 4}, "image_size"), ({"success_radius": 0.0}, "success_radius")]
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Reach2DEnv(**kwargs)

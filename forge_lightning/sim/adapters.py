"""Env adapters: a simulator's observations as a policy's LeRobot features, the policy's actions as env actions.

::

    env obs {"pixels": (N,H,W,3), "agent_pos": (N,S)} ─ observation() ─> {"observation.image(s.*)": uint8 (N,H,W,3),
                                                                            "observation.state": (N,S)}
    policy action chunk (N, A) in the dataset's units ─ action() ─> env action (clipped to its action space)

Feature names follow the LeRobot datasets recorded in each simulator (``lerobot/pusht``:
``observation.image``, ``lerobot/aloha_sim_*``: ``observation.images.top``), so a policy trained on them is
evaluated on the features it saw. Observations arrive batched, as a vector env returns them.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces

from forge_lightning.sim.reach import TASK


class EnvAdapter:
    """Maps one simulator's observations and actions to and from LeRobot features.

    Subclasses name the env's package (imported to register it), the default ``gym.make`` keyword arguments,
    the task string, and where each feature comes from in the observation (a path of keys).
    """

    package: ClassVar[str | None] = None
    env_kwargs: ClassVar[dict[str, Any]] = {}
    task: ClassVar[str] = ""
    images: ClassVar[dict[str, tuple[str, ...]]] = {}
    state: ClassVar[tuple[str, tuple[str, ...]] | None] = None

    def prepare(self) -> None:
        """Imports the env's package so its ids are registered (raises a hint when it is not installed)."""
        if self.package is None:
            return
        try:
            importlib.import_module(self.package)
        except ImportError as error:
            raise ImportError(
                f"{type(self).__name__} needs the {self.package!r} package: pip install 'forge-lightning[sim]' "
                f"({error})"
            ) from error

    @property
    def video_key(self) -> str:
        """The camera feature that rollout videos show."""
        return next(iter(self.images))

    def observation(self, obs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """LeRobot features of a batch of observations: cameras uint8 ``(N, H, W, 3)``, the state float32."""
        features = {key: np.asarray(_lookup(obs, path), dtype=np.uint8) for key, path in self.images.items()}
        if self.state is not None:
            key, path = self.state
            features[key] = np.asarray(_lookup(obs, path), dtype=np.float32)
        return features

    def action(self, actions: np.ndarray, action_space: spaces.Box) -> np.ndarray:
        """Env actions for a batch of policy actions ``(N, A)``: the env's width, clipped to its bounds."""
        width = action_space.shape[-1]
        actions = np.asarray(actions, dtype=np.float64)
        if actions.shape[-1] < width:
            raise ValueError(f"the policy gives {actions.shape[-1]} action values, the env takes {width}")
        return np.clip(actions[..., :width], action_space.low, action_space.high).astype(action_space.dtype)

    def success(self, info: Mapping[str, Any], index: int) -> bool:
        """Whether env ``index`` of a vector env reports success in this step's ``info``."""
        mask = info.get("_is_success")
        if "is_success" not in info or (mask is not None and not mask[index]):
            return False
        return bool(info["is_success"][index])

    def features(self, env: Any) -> dict[str, dict[str, Any]]:
        """LeRobot feature specs (for ``LeRobotWriter``) of one (non-vector) env's observations and actions."""
        sample = self.observation(_batched(env.observation_space.sample()))
        result: dict[str, dict[str, Any]] = {}
        for key, value in sample.items():
            if key in self.images:
                result[key] = {
                    "dtype": "video",
                    "shape": list(value.shape[1:]),
                    "names": ["height", "width", "channels"],
                }
            else:
                result[key] = {"dtype": "float32", "shape": list(value.shape[1:]), "names": None}
        result["action"] = {"dtype": "float32", "shape": list(env.action_space.shape), "names": None}
        return result


def _lookup(obs: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = obs
    for key in path:
        if key not in value:
            raise KeyError(f"the observation has no {'/'.join(path)} (keys at that level: {sorted(value)})")
        value = value[key]
    return value


def _batched(obs: Any) -> Any:
    if isinstance(obs, Mapping):
        return {key: _batched(value) for key, value in obs.items()}
    return np.asarray(obs)[None]


class Reach2DAdapter(EnvAdapter):
    """``forge/Reach2D-v0``: the camera as ``observation.images.top``, the agent position as the state."""

    package = "forge_lightning.sim.reach"
    task = TASK
    images = {"observation.images.top": ("pixels",)}
    state = ("observation.state", ("agent_pos",))

    def prepare(self) -> None:
        from forge_lightning.sim.reach import register

        register()


class PushTAdapter(EnvAdapter):
    """``gym_pusht/PushT-v0`` (gym-pusht) as ``lerobot/pusht``: a 96x96 ``observation.image``, the agent's
    position as ``observation.state``, actions the agent's target position in ``[0, 512]^2`` (unchanged)."""

    package = "gym_pusht"
    env_kwargs = {"obs_type": "pixels_agent_pos", "render_mode": "rgb_array"}
    task = "Push the T-shaped block onto the T-shaped target."
    images = {"observation.image": ("pixels",)}
    state = ("observation.state", ("agent_pos",))


class AlohaAdapter(EnvAdapter):
    """gym-aloha's bimanual MuJoCo tasks as ``lerobot/aloha_sim_*``: the top camera (480x640) as
    ``observation.images.top``, the 14 joint positions as ``observation.state``, 14 joint targets as actions.

    MuJoCo renders headless through EGL unless ``MUJOCO_GL`` names another backend (``osmesa``).
    """

    package = "gym_aloha"
    env_kwargs = {"obs_type": "pixels_agent_pos", "render_mode": "rgb_array"}
    task = "Insert the peg into the socket"
    images = {"observation.images.top": ("pixels", "top")}
    state = ("observation.state", ("agent_pos",))

    def prepare(self) -> None:
        os.environ.setdefault("MUJOCO_GL", "egl")  # must be set before mujoco is first imported
        super().prepare()


class AlohaTransferCubeAdapter(AlohaAdapter):
    """``gym_aloha/AlohaTransferCube-v0``: the same features as the insertion task, another task string."""

    task = "Pick up the cube with the right arm and transfer it to the left arm."


ADAPTERS: dict[str, type[EnvAdapter]] = {
    "forge/Reach2D-v0": Reach2DAdapter,
    "gym_pusht/PushT-v0": PushTAdapter,
    "gym_aloha/AlohaInsertion-v0": AlohaAdapter,
    "gym_aloha/AlohaTransferCube-v0": AlohaTransferCubeAdapter,
}
"""Env id -> its adapter."""


def adapter_for(env_id: str) -> EnvAdapter:
    """The adapter of a supported env id."""
    if env_id not in ADAPTERS:
        raise KeyError(f"no adapter for env {env_id!r}; supported: {', '.join(ADAPTERS)}")
    return ADAPTERS[env_id]()

"""``forge/Reach2D-v0``: move a point agent onto a coloured target that only the camera shows.

A 2-D arena ``[-1, 1]^2`` rendered with numpy (no simulator, no system libraries)::

    observation  pixels     (size, size, 3) uint8: grey arena, red target disc, blue agent disc
                 agent_pos  (2,) float32: the agent's position (the target's is NOT in the state)
    action       (2,) in [-1, 1]: velocity; the agent moves by ``action * max_speed`` (clipped to the arena)
    reward       progress towards the target (previous distance - new distance), so the return is how much
                 closer the episode got
    terminated   the agent is within ``success_radius`` of the target (``info["is_success"]``)

A policy must find the target in the image and steer with the state (or the image) towards it. The scripted
expert (:class:`Reach2DExpert`) reads the target from ``info["target_pos"]`` and moves straight at it.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

ENV_ID = "forge/Reach2D-v0"
TASK = "reach the red target"
_BACKGROUND = np.array([64, 64, 64], dtype=np.float32)
_ARENA = np.array([140, 140, 140], dtype=np.float32)
_TARGET_COLOUR = np.array([230, 40, 40], dtype=np.float32)
_AGENT_COLOUR = np.array([40, 90, 240], dtype=np.float32)


class Reach2DEnv(gym.Env):
    """Reach a red target in a 2-D arena; the target is visible only in the rendered image.

    Args:
        image_size: side of the square camera image in pixels.
        max_speed: distance the agent moves per step at full action.
        success_radius: the episode succeeds when the agent is this close to the target.
        target_radius: drawn radius of the target (arena units).
        agent_radius: drawn radius of the agent (arena units).
        min_start_distance: the agent starts at least this far from the target.
        render_mode: ``rgb_array`` (``render()`` returns the camera image) or ``None``.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(
        self,
        image_size: int = 32,
        max_speed: float = 0.1,
        success_radius: float = 0.12,
        target_radius: float = 0.15,
        agent_radius: float = 0.1,
        min_start_distance: float = 0.5,
        render_mode: str | None = "rgb_array",
    ) -> None:
        if image_size < 8:
            raise ValueError(f"image_size ({image_size}) must be at least 8 pixels")
        if not 0 < success_radius < min_start_distance:
            raise ValueError(
                f"success_radius ({success_radius}) must be in (0, min_start_distance ({min_start_distance}))"
            )
        self.image_size, self.max_speed = image_size, max_speed
        self.success_radius, self.min_start_distance = success_radius, min_start_distance
        self.target_radius, self.agent_radius = target_radius, agent_radius
        self.render_mode = render_mode
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.observation_space = spaces.Dict(
            {
                "pixels": spaces.Box(0, 255, shape=(image_size, image_size, 3), dtype=np.uint8),
                "agent_pos": spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32),
            }
        )
        # Pixel centres in arena units; row 0 is the top (y = +1).
        centres = (np.arange(image_size) + 0.5) / image_size * 2 - 1
        self._grid_x, self._grid_y = np.meshgrid(centres, -centres)
        self._agent = np.zeros(2, dtype=np.float32)
        self._target = np.zeros(2, dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        margin = max(self.target_radius, self.agent_radius)
        self._target = self.np_random.uniform(-1 + margin, 1 - margin, size=2).astype(np.float32)
        while True:
            agent = self.np_random.uniform(-1 + margin, 1 - margin, size=2).astype(np.float32)
            if np.linalg.norm(agent - self._target) >= self.min_start_distance:
                break
        self._agent = agent
        return self._observation(), self._info()

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        before = self.distance
        velocity = np.clip(np.asarray(action, dtype=np.float32).reshape(2), -1.0, 1.0)
        self._agent = np.clip(self._agent + velocity * self.max_speed, -1.0, 1.0).astype(np.float32)
        info = self._info()
        return self._observation(), float(before - self.distance), bool(info["is_success"]), False, info

    @property
    def distance(self) -> float:
        """Distance from the agent to the target."""
        return float(np.linalg.norm(self._agent - self._target))

    def render(self) -> np.ndarray:
        """The camera image ``(image_size, image_size, 3)`` uint8."""
        image = np.broadcast_to(_ARENA, (self.image_size, self.image_size, 3)).copy()
        image[[0, -1], :] = _BACKGROUND
        image[:, [0, -1]] = _BACKGROUND
        for centre, radius, colour in (
            (self._target, self.target_radius, _TARGET_COLOUR),
            (self._agent, self.agent_radius, _AGENT_COLOUR),
        ):
            alpha = self._disc_coverage(centre, radius)[..., None]
            image = image * (1 - alpha) + colour * alpha
        return np.round(image).astype(np.uint8)

    def _disc_coverage(self, centre: np.ndarray, radius: float) -> np.ndarray:
        """Per-pixel coverage in ``[0, 1]`` of a disc, linear over one pixel at its edge (anti-aliased), so the
        image carries the disc's position below the pixel size."""
        pixel = 2.0 / self.image_size
        distance = np.hypot(self._grid_x - centre[0], self._grid_y - centre[1])
        return np.clip((radius - distance) / pixel + 0.5, 0.0, 1.0)

    def _observation(self) -> dict[str, np.ndarray]:
        return {"pixels": self.render(), "agent_pos": self._agent.copy()}

    def _info(self) -> dict[str, Any]:
        distance = self.distance
        return {
            "target_pos": self._target.copy(),
            "distance": distance,
            "is_success": distance < self.success_radius,
        }


class Reach2DExpert:
    """Scripted expert: full speed straight at the target, slowing down to land on it.

    Args:
        max_speed: the environment's ``max_speed`` (to land exactly on the target on the last step).
    """

    def __init__(self, max_speed: float = 0.1) -> None:
        self.max_speed = max_speed

    def __call__(self, agent_pos: np.ndarray, target_pos: np.ndarray) -> np.ndarray:
        """Actions ``[..., 2]`` for agent and target positions ``[..., 2]``."""
        return np.clip((target_pos - agent_pos) / self.max_speed, -1.0, 1.0).astype(np.float32)


def register() -> None:
    """Registers ``forge/Reach2D-v0`` with gymnasium (50 steps per episode); safe to call again."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point="forge_lightning.sim.reach:Reach2DEnv", max_episode_steps=50)

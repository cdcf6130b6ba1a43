"""Writes the LeRobot v3.0 dataset the VLA throughput benchmark trains on (benchmarks/vla_throughput.py).

N episodes x F frames, two cameras (``observation.images.base``, ``observation.images.wrist``) as mp4 with
LeRobot's encoder settings (SVT-AV1, key frame every 2 frames, CRF 30), a state and an action of Pi0.5's sizes
(32 values each by default) and one task string, written by ``LeRobotWriter``; plus a word-level prompt
tokenizer (PaliGemma's special ids, the task's words, the 256 state bins) for both policies::

    python benchmarks/make_vla_dataset.py --output data/vla_bench     # 50 x 300 x 2 x 224^2
    python benchmarks/make_vla_dataset.py --output data/vla_tiny --episodes 2 --frames 20 --size 32 \\
        --state-dim 8 --action-dim 6                                    # the CPU dry run (the `debug` preset)

writes ``<output>/dataset`` (the LeRobot root) and ``<output>/tokenizer``.

The frames are a small synthetic scene, so that video compression behaves as on camera footage rather than on
flat colours (~8 kB per frame at 224x224): a textured table (low-frequency patterns and fine grain), a bin, a
red cube and a distractor, and a gripper that follows the first two joints of the trajectory and carries the
cube in the second half of the episode, plus sensor noise. The base camera sees the whole scene through a
slowly shaking window; the wrist camera a 2x crop that moves with the gripper. Joints are sums of slow
sinusoids in ``[-1, 1]``; the action at frame ``t`` is the joint vector at ``t + 1``, so actions are
predictable from the observation.

Episodes are rendered in worker processes while the main process encodes and writes them (the writer appends
every episode to one mp4 per camera, so writing itself is sequential).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

CAMERAS = ("observation.images.base", "observation.images.wrist")
TASK = "pick up the red cube"
STATE_KEY, ACTION_KEY = "observation.state", "action"


# ----- the scene --------------------------------------------------------------------------------------------
def joint_trajectory(rng: np.random.Generator, length: int, width: int, fps: int) -> np.ndarray:
    """``[length, width]`` smooth joint positions in ``[-1, 1]``: three sinusoids per joint, 0.05-0.5 Hz."""
    t_T1 = np.arange(length)[:, None] / fps
    freqs = rng.uniform(0.05, 0.5, (3, width))
    phases = rng.uniform(0, 2 * np.pi, (3, width))
    amps = rng.dirichlet(np.ones(3), width).T * rng.uniform(0.5, 0.95, width)  # [3, width], sum <= 0.95
    return (amps[:, None] * np.sin(2 * np.pi * freqs[:, None] * t_T1[None] + phases[:, None])).sum(0)


def _texture(rng: np.random.Generator, side: int) -> np.ndarray:
    """A ``[side, side, 3]`` uint8 table top: a colour, random low-frequency cosine patterns, fine grain."""
    yy, xx = np.mgrid[0:side, 0:side] / side
    base = rng.uniform(60, 180, 3)
    pattern = np.zeros((side, side))
    for _ in range(6):
        fy, fx = rng.uniform(1, 8, 2)
        pattern += rng.uniform(5, 20) * np.cos(2 * np.pi * (fy * yy + fx * xx) + rng.uniform(0, 2 * np.pi))
    tint = rng.uniform(0.6, 1.0, 3)
    grain = rng.normal(0, 12, (side, side, 1))  # fine static texture (wood grain, cloth)
    return np.clip(base + (pattern[..., None] + grain) * tint, 0, 255).astype(np.uint8)


def _disc(canvas: np.ndarray, center: np.ndarray, radius: float, color: tuple[int, ...]) -> None:
    """Draws a filled disc (in place) where it overlaps the canvas."""
    side = canvas.shape[0]
    y0, x0 = (np.maximum(center - radius, 0)).astype(int)
    y1, x1 = (np.minimum(center + radius + 1, side)).astype(int)
    if y1 <= y0 or x1 <= x0:
        return
    yy, xx = np.mgrid[y0:y1, x0:x1]
    inside = (yy - center[0]) ** 2 + (xx - center[1]) ** 2 <= radius**2
    canvas[y0:y1, x0:x1][inside] = color


def _square(canvas: np.ndarray, center: np.ndarray, half: float, color: tuple[int, ...]) -> None:
    y0, x0 = np.clip(center - half, 0, canvas.shape[0]).astype(int)
    y1, x1 = np.clip(center + half, 0, canvas.shape[0]).astype(int)
    canvas[y0:y1, x0:x1] = color


def render_frames(rng: np.random.Generator, joints: np.ndarray, size: int) -> dict[str, np.ndarray]:
    """Both cameras' ``[T, size, size, 3]`` uint8 frames of one episode (gripper at joints 0 and 1)."""
    # The scene canvas: the base camera sees it at half resolution through a slowly shaking window (margin
    # pixels of play), the wrist camera a full-resolution crop centred on the gripper.
    margin = max(2, size // 8)
    side = 2 * size + 2 * margin
    table = _texture(rng, side)
    bin_at, cube_at, other_at = rng.uniform(0.25, 0.75, (3, 2)) * side
    gripper_TP = (0.5 + 0.4 * joints[:, :2]) * side  # [T, 2] (y, x)
    shake_T2 = np.round(margin * np.sin(np.arange(len(joints))[:, None] / rng.uniform(4, 12, 2))).astype(int)
    grasp = len(joints) // 2
    frames = {key: np.empty((len(joints), size, size, 3), np.uint8) for key in CAMERAS}
    for t, gripper in enumerate(gripper_TP):
        canvas = table.copy()
        _square(canvas, bin_at, side * 0.08, (40, 60, 170))
        _disc(canvas, other_at + 4 * np.sin(t / 15), side * 0.04, (40, 160, 60))
        _disc(canvas, gripper, side * 0.05, (50, 50, 55))
        _disc(canvas, gripper, side * 0.025, (150, 150, 160))
        held = gripper + (side * 0.06, 0)  # the cube hangs below the gripper once grasped
        _square(canvas, held if t >= grasp else cube_at, side * 0.035, (200, 30, 30))
        y, x = margin + shake_T2[t]
        top, left = np.clip(gripper - size / 2, 0, side - size).astype(int)
        views = {
            CAMERAS[0]: canvas[y : y + 2 * size : 2, x : x + 2 * size : 2],
            CAMERAS[1]: canvas[top : top + size, left : left + size],
        }
        for key, view in views.items():
            noise = rng.integers(-3, 4, view.shape, dtype=np.int16)  # sensor noise: realistic bit rates
            frames[key][t] = np.clip(view.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    return frames


def render_episode(job: tuple[int, int, int, int, int, int, int]) -> dict[str, np.ndarray]:
    """One episode (runs in a worker): camera frames, ``[F, state_dim]`` states, ``[F, action_dim]`` actions.

    Args:
        job: ``(seed, episode, frames, size, state_dim, action_dim, fps)``.
    """
    seed, episode, frames, size, state_dim, action_dim, fps = job
    rng = np.random.default_rng([seed, episode])
    joints = joint_trajectory(rng, frames + 1, max(state_dim, action_dim, 2), fps)
    episode_data = render_frames(rng, joints[:frames], size)
    episode_data[STATE_KEY] = joints[:frames, :state_dim].astype(np.float32)
    episode_data[ACTION_KEY] = joints[1:, :action_dim].astype(np.float32)
    return episode_data


# ----- writing ----------------------------------------------------------------------------------------------
def features(size: int, state_dim: int, action_dim: int) -> dict[str, dict[str, Any]]:
    """LeRobot features of the dataset: two cameras, the state and the action."""
    camera = {"dtype": "video", "shape": (size, size, 3), "names": ["height", "width", "channels"]}
    return {
        **{key: dict(camera) for key in CAMERAS},
        STATE_KEY: {
            "dtype": "float32",
            "shape": (state_dim,),
            "names": [f"joint_{i}" for i in range(state_dim)],
        },
        ACTION_KEY: {
            "dtype": "float32",
            "shape": (action_dim,),
            "names": [f"joint_{i}" for i in range(action_dim)],
        },
    }


def _episodes(jobs: list[tuple[int, ...]], workers: int) -> Iterator[dict[str, np.ndarray]]:
    """Rendered episodes in order, at most ``2 * workers`` rendered ahead of the writer."""
    with ProcessPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        for job in jobs:
            pending.append(pool.submit(render_episode, job))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def write_dataset(args: argparse.Namespace) -> Path:
    """Renders and writes the dataset under ``args.output / "dataset"``; returns its root."""
    from forge_lightning.datamodules.lerobot import LeRobotWriter

    root = Path(args.output) / "dataset"
    writer = LeRobotWriter(
        root,
        fps=args.fps,
        features=features(args.size, args.state_dim, args.action_dim),
        robot_type="synthetic_arm",
        codec=args.codec,
        crf=args.crf,
        gop=args.gop,
    )
    jobs = [
        (args.seed, e, args.frames, args.size, args.state_dim, args.action_dim, args.fps)
        for e in range(args.episodes)
    ]
    start = time.perf_counter()
    for episode, data in enumerate(_episodes(jobs, args.workers)):
        for t in range(args.frames):
            frame: Mapping[str, Any] = {key: data[key][t] for key in (*CAMERAS, STATE_KEY, ACTION_KEY)}
            writer.add_frame(frame, task=TASK)
        writer.save_episode()
        if (episode + 1) % 10 == 0 or episode + 1 == args.episodes:
            print(f"episode {episode + 1}/{args.episodes} ({time.perf_counter() - start:.0f} s)", flush=True)
    return writer.finalize()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", required=True, help="directory for dataset/ and tokenizer/ (must not exist)"
    )
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--frames", type=int, default=300, help="frames per episode")
    parser.add_argument("--size", type=int, default=224, help="camera height and width")
    parser.add_argument("--state-dim", type=int, default=32)
    parser.add_argument("--action-dim", type=int, default=32)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--codec", default="libsvtav1", help="FFmpeg encoder (LeRobot's default: libsvtav1)")
    parser.add_argument("--crf", type=int, default=30)
    parser.add_argument("--gop", type=int, default=2, help="key-frame interval (LeRobot: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.size % 2 or args.episodes < 1 or args.frames < 2:
        raise SystemExit("--size must be even, --episodes >= 1 and --frames >= 2")
    from forge_lightning.sim.record import write_prompt_tokenizer

    start = time.perf_counter()
    root = write_dataset(args)
    tokenizer = write_prompt_tokenizer(Path(args.output) / "tokenizer", [TASK])
    videos = sum(p.stat().st_size for p in (root / "videos").rglob("*.mp4"))
    total = args.episodes * args.frames
    print(
        f"wrote {root} ({args.episodes} episodes x {args.frames} frames x {len(CAMERAS)} cameras at "
        f"{args.size}x{args.size}, {args.codec}; videos {videos / 1e6:.1f} MB, "
        f"{videos / (total * len(CAMERAS)) / 1e3:.1f} kB per frame) and {tokenizer} in "
        f"{time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()

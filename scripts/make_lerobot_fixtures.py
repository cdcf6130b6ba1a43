"""Writes tiny LeRobot datasets and saves lerobot's own readings of them (driven by make_lerobot_fixtures.sh).

``write --version v2.1`` (lerobot 0.3.3) also derives a v2.0 copy: the same data with the v2.0 stats layout
(``meta/stats.json``, aggregated by lerobot's own ``aggregate_stats``, instead of ``meta/episodes_stats.jsonl``).
``write --version v3.0`` runs under lerobot 0.4.4; ``write --version forge`` runs in the project venv and writes
with forge-lightning's ``LeRobotWriter``. ``read --version V`` opens the dataset with
``lerobot.datasets.lerobot_dataset.LeRobotDataset`` (PyAV backend) and saves, as safetensors beside it:

- ``plain/*``: every frame without ``delta_timestamps`` (camera as uint8: lerobot's float frames times 255),
- ``delta/*``: the items at ``INDICES`` with ``DELTA_TIMESTAMPS`` (history, action chunk, ``*_is_pad``),
- ``stats/<feature>/<stat>``: the stats lerobot loaded (``meta.stats``),

plus ``reading.json`` naming the lerobot / PyAV / FFmpeg versions that produced them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

FPS = 10
NUM_EPISODES = 3
NUM_FRAMES = 20
SIZE = 32
CAMERA = "observation.images.cam"
TASKS = ("push the block", "lift the cube", "push the block")
FEATURES = {
    CAMERA: {"dtype": "video", "shape": (SIZE, SIZE, 3), "names": ["height", "width", "channels"]},
    "observation.state": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
    "action": {"dtype": "float32", "shape": (2,), "names": ["dx", "dy"]},
}
DELTA_TIMESTAMPS = {
    CAMERA: [-0.1, 0.0],
    "observation.state": [-0.2, -0.1, 0.0],
    "action": [0.0, 0.1, 0.2, 0.3, 0.4],
}
INDICES = [0, 1, 2, 5, 17, 18, 19, 20, 21, 38, 39, 40, 41, 50, 57, 58, 59]
FOLDERS = {"v2.0": "v20", "v2.1": "v21", "v3.0": "v30", "forge": "forge_v30"}


def make_frame(episode: int, index: int) -> dict[str, np.ndarray]:
    """Deterministic frame content: a gradient background with a moving square; smooth state / action."""
    rng = np.random.default_rng([episode, index])
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    image = np.stack([x * 8, y * 8, np.full_like(x, 40 * episode + 3 * index)], axis=-1)
    row, col = 4 + index % 20, 2 + (3 * index + 5 * episode) % 24
    image[row : row + 6, col : col + 6] = (250, 30, 120)
    state = np.array([np.sin(0.3 * index + episode), np.cos(0.2 * index) + episode], dtype=np.float32)
    action = (state * 0.5 + rng.normal(0, 0.1, 2)).astype(np.float32)
    return {CAMERA: np.clip(image, 0, 255).astype(np.uint8), "observation.state": state, "action": action}


def write_with_lerobot(root: Path, version: str) -> None:
    """Writes the dataset with the installed lerobot (0.3.3: v2.1, 0.4.4: v3.0)."""
    install_torchvision_shim()
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    dataset = LeRobotDataset.create(
        repo_id=f"forge/fixture_{FOLDERS[version]}", fps=FPS, features=FEATURES, root=root, use_videos=True
    )
    for episode in range(NUM_EPISODES):
        for index in range(NUM_FRAMES):
            frame = make_frame(episode, index)
            if version == "v2.1":
                dataset.add_frame(frame, task=TASKS[episode])
            else:
                dataset.add_frame({**frame, "task": TASKS[episode]})
        dataset.save_episode()
    if hasattr(dataset, "finalize"):
        dataset.finalize()
    shutil.rmtree(root / "images", ignore_errors=True)


def derive_v20(v21: Path, v20: Path) -> None:
    """Copies a v2.1 dataset into the v2.0 layout, aggregating its per-episode stats with lerobot's code."""
    from lerobot.datasets.compute_stats import aggregate_stats
    from lerobot.datasets.utils import load_episodes_stats, write_stats

    shutil.copytree(v21, v20)
    episodes_stats = load_episodes_stats(v21)
    write_stats(aggregate_stats(list(episodes_stats.values())), v20)
    (v20 / "meta" / "episodes_stats.jsonl").unlink()
    info = json.loads((v20 / "meta" / "info.json").read_text())
    info["codebase_version"] = "v2.0"
    (v20 / "meta" / "info.json").write_text(json.dumps(info, indent=4))


def write_with_forge(root: Path) -> None:
    """Writes the same content with forge-lightning's LeRobotWriter (v3.0)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from forge_lightning.datamodules.lerobot import LeRobotWriter

    writer = LeRobotWriter(root, fps=FPS, features=FEATURES, robot_type="fixture")
    for episode in range(NUM_EPISODES):
        for index in range(NUM_FRAMES):
            writer.add_frame(make_frame(episode, index), task=TASKS[episode])
        writer.save_episode()
    writer.finalize()


def install_torchvision_shim() -> None:
    """Defines the ``torchvision::nms`` / ``qnms`` op schemas that torchvision's Python code registers fakes for.

    torchvision's compiled ops do not load beside this torch build; lerobot only needs torchvision's pure-Python
    video reader (PyAV backend), so empty schemas are enough for ``import torchvision`` to succeed.
    """
    import torch

    if getattr(install_torchvision_shim, "library", None) is None:
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define(
            "qnms(Tensor dets, Tensor scores, float iou_threshold, float scale, int zero_point) -> Tensor"
        )
        install_torchvision_shim.library = library  # keep the registration alive


def read_with_lerobot(root: Path) -> None:
    """Saves lerobot's readings of ``root`` (see the module docstring) beside it."""
    install_torchvision_shim()
    import av
    import lerobot
    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from safetensors.torch import save_file

    repo_id = f"forge/fixture_{root.name}"
    plain = LeRobotDataset(repo_id, root=root, video_backend="pyav")
    delta = LeRobotDataset(repo_id, root=root, delta_timestamps=DELTA_TIMESTAMPS, video_backend="pyav")
    tensors: dict[str, torch.Tensor] = {}
    for prefix, dataset, indices in (("plain", plain, range(len(plain))), ("delta", delta, INDICES)):
        items = [dataset[i] for i in indices]
        for key, value in items[0].items():
            if isinstance(value, torch.Tensor):
                stacked = torch.stack([item[key] for item in items])
                if key == CAMERA:  # lerobot's frames are uint8 / 255 in float32: store the uint8 exactly
                    as_uint8 = torch.round(stacked * 255)
                    assert torch.equal(as_uint8 / 255, stacked)
                    stacked = as_uint8.to(torch.uint8)
                tensors[f"{prefix}/{key}"] = stacked.contiguous()
        tensors[f"{prefix}/indices"] = torch.tensor(list(indices))
    for feature, stats in plain.meta.stats.items():
        for name, value in stats.items():
            tensors[f"stats/{feature}/{name}"] = torch.as_tensor(np.asarray(value)).contiguous()
    save_file(tensors, str(root.parent / f"{root.name}_reading.safetensors"))
    tasks = [plain[i]["task"] for i in range(len(plain))]
    reading = {
        "lerobot": lerobot.__version__,
        "av": av.__version__,
        "ffmpeg": av.library_versions["libavcodec"],
        "codebase_version": plain.meta.info["codebase_version"],
        "delta_timestamps": DELTA_TIMESTAMPS,
        "tasks": tasks,
    }
    (root.parent / f"{root.name}_reading.json").write_text(json.dumps(reading, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=["write", "read"])
    parser.add_argument("--version", required=True, choices=sorted(FOLDERS))
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    root = args.out / FOLDERS[args.version]
    if args.action == "read":
        read_with_lerobot(root)
    elif args.version == "forge":
        write_with_forge(root)
    elif args.version == "v2.0":
        raise SystemExit("v2.0 is derived from v2.1: run `write --version v2.1`")
    else:
        write_with_lerobot(root, args.version)
        if args.version == "v2.1":
            derive_v20(root, args.out / FOLDERS["v2.0"])


if __name__ == "__main__":
    main()

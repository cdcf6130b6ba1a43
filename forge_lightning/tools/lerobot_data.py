"""``forge-data`` subcommands for LeRobot datasets.

``forge-data lerobot-stats ROOT [--force]`` computes a dataset's stats (mean / std / min / max / count and the
q01 / q10 / q50 / q90 / q99 quantiles) and writes them in its version's layout. ``forge-data lerobot-info ROOT``
prints its version, features, episodes and whether it has stats.
"""

from __future__ import annotations

import argparse

from forge_lightning.datamodules.lerobot.compute import write_dataset_stats
from forge_lightning.datamodules.lerobot.meta import LeRobotFormatError, LeRobotMeta


def lerobot_stats(args: argparse.Namespace) -> None:
    """Computes and writes the stats of ``args.root``."""
    try:
        written = write_dataset_stats(args.root, force=args.force, video_backend=args.video_backend)
    except (LeRobotFormatError, FileExistsError) as error:
        raise SystemExit(f"forge-data lerobot-stats: error: {error}") from None
    for path in written:
        print(f"wrote {path}")


def lerobot_info(args: argparse.Namespace) -> None:
    """Prints a summary of the dataset at ``args.root``."""
    try:
        meta = LeRobotMeta(args.root)
    except LeRobotFormatError as error:
        raise SystemExit(f"forge-data lerobot-info: error: {error}") from None
    print(
        f"{meta.root}: LeRobot {meta.version}, {len(meta.episodes)} episodes, {meta.total_frames} frames, fps {meta.fps}"
    )
    for key, feature in meta.features.items():
        print(f"  {key}: {feature['dtype']} {feature['shape']}")
    print(f"  stats: {'yes' if meta.stats is not None else 'no (run forge-data lerobot-stats ROOT)'}")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``lerobot-stats`` and ``lerobot-info`` on ``forge-data``'s subparsers."""
    p = subparsers.add_parser("lerobot-stats", help="compute a LeRobot dataset's stats (incl. quantiles)")
    p.add_argument("root", help="dataset root (holding meta/info.json)")
    p.add_argument("--force", action="store_true", help="recompute stats the dataset already has")
    p.add_argument("--video-backend", default="pyav", help="pyav (default) or torchcodec")
    p.set_defaults(func=lerobot_stats)
    p = subparsers.add_parser("lerobot-info", help="print a LeRobot dataset's version, features and episodes")
    p.add_argument("root", help="dataset root (holding meta/info.json)")
    p.set_defaults(func=lerobot_info)

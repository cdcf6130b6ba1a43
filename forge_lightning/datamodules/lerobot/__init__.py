"""LeRobot datasets (v2.0 / v2.1 / v3.0) without the lerobot package: reader, stats, writer, data module,
camera augmentation on the device.

Public names are imported lazily so that data tools (``forge-data lerobot-stats``) start without Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ImageAugmentConfig": "augment",
    "LeRobotDataConfig": "datamodule",
    "LeRobotDataModule": "datamodule",
    "split_episodes": "datamodule",
    "LeRobotDataset": "dataset",
    "SUPPORTED_VERSIONS": "meta",
    "LeRobotFormatError": "meta",
    "LeRobotMeta": "meta",
    "Normalizer": "stats",
    "aggregate_stats": "stats",
    "feature_stats": "stats",
    "image_stats": "stats",
    "LeRobotWriter": "writer",
}

__all__ = [
    "SUPPORTED_VERSIONS",
    "ImageAugmentConfig",
    "LeRobotDataConfig",
    "LeRobotDataModule",
    "LeRobotDataset",
    "LeRobotFormatError",
    "LeRobotMeta",
    "LeRobotWriter",
    "Normalizer",
    "aggregate_stats",
    "feature_stats",
    "image_stats",
    "split_episodes",
]

if TYPE_CHECKING:
    from forge_lightning.datamodules.lerobot.augment import ImageAugmentConfig
    from forge_lightning.datamodules.lerobot.datamodule import (
        LeRobotDataConfig,
        LeRobotDataModule,
        split_episodes,
    )
    from forge_lightning.datamodules.lerobot.dataset import LeRobotDataset
    from forge_lightning.datamodules.lerobot.meta import SUPPORTED_VERSIONS, LeRobotFormatError, LeRobotMeta
    from forge_lightning.datamodules.lerobot.stats import (
        Normalizer,
        aggregate_stats,
        feature_stats,
        image_stats,
    )
    from forge_lightning.datamodules.lerobot.writer import LeRobotWriter


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

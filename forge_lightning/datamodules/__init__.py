"""LightningDataModules and the data logic they share.

Public names are imported lazily so that data tools (``forge-data``) start without importing Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "PretrainDataModule": "pretrain",
    "SFTDataModule": "sft",
    "ShardedLoader": "loader",
    "StepLoader": "loader",
    "TokenDataModule": "base",
}

__all__ = ["PretrainDataModule", "SFTDataModule", "ShardedLoader", "StepLoader", "TokenDataModule"]

if TYPE_CHECKING:
    from forge_lightning.datamodules.base import TokenDataModule
    from forge_lightning.datamodules.loader import ShardedLoader, StepLoader
    from forge_lightning.datamodules.pretrain import PretrainDataModule
    from forge_lightning.datamodules.sft import SFTDataModule


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

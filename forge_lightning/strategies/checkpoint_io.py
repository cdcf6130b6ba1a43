"""Checkpoint I/O that never leaves a half-written checkpoint behind and never unpickles code."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from forge_lightning.atomic_io import write_file


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """Save ``obj`` with ``torch.save`` atomically and durably (:func:`forge_lightning.atomic_io.write_file`).

    A process killed at any point leaves either the previous file at ``path`` or the new one, never a torn file.
    """
    write_file(path, lambda stream: torch.save(obj, stream))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint I/O with atomic saves (temp file + rename) and ``weights_only=True`` loads."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, path)

    @override
    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} not found: pass an existing file to --ckpt_path")
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as err:  # torch raises several types for torn or foreign files
            raise RuntimeError(
                f"could not load checkpoint {path}: {err}. The file is corrupt or was not written by forge-lightning "
                "(only tensors and plain containers are accepted; no pickled code is ever loaded)."
            ) from err

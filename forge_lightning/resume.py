"""Where a run resumes from: ``--ckpt_path last`` across the run's ``version_N`` folders, and the temporaries that
killed saves leave behind.

A run's checkpoints live where ``ModelCheckpoint`` puts them: its ``dirpath``, else
``<logger save_dir>/<logger name>/version_N/checkpoints`` (a new ``version_N`` per run), else
``<default_root_dir>/checkpoints``. Lightning's own ``last`` only looks in this run's folder, which is new and empty
under the default layout: it warns and trains from step 0. Here ``last`` is the newest complete ``last*.ckpt`` in
every folder of the run, or an error that lists where it looked.

Under ``torchrun --max-restarts N``, a worker that dies makes torchelastic restart every worker of the job
(``TORCHELASTIC_RESTART_COUNT`` counts the restarts). A restarted ``forge fit`` resumes by itself from the run's
newest complete checkpoint (any ``*.ckpt``: periodic or last), whose content its manifest then verifies.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Iterable
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from forge_lightning.manifest import sizes_match

META_FILE = (
    "meta.pt"  # the sharded checkpoints' (DCP, megatron) own file, written before the rename into place
)


def checkpoint_dirs(trainer: Trainer) -> list[Path]:
    """The folders this run's checkpoints go to, and those of its earlier versions (existing or not)."""
    dirs: list[Path] = []
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    explicit = [Path(cb.dirpath) for cb in callbacks if cb.dirpath]
    dirs += explicit
    if len(explicit) < len(callbacks) or not callbacks:
        if trainer.loggers:
            logger = trainer.loggers[0]
            root = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name or "")
            dirs += sorted(root.glob("version_*/checkpoints")) or [root / "version_0" / "checkpoints"]
        else:
            dirs.append(Path(trainer.default_root_dir) / "checkpoints")
    return list(dict.fromkeys(d.resolve() for d in dirs))


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a finished checkpoint: a torch zip file, or a directory with its ``meta.pt``, whose
    manifest (if it has one) lists files that are all there at their sizes. The hashes are checked when it loads."""
    path = path.resolve()
    if path.is_dir():
        finished = (path / META_FILE).is_file()
    else:
        finished = path.is_file() and zipfile.is_zipfile(path)
    return finished and sizes_match(path) is not False


def newest_checkpoint(trainer: Trainer, pattern: str = "*.ckpt") -> Path | None:
    """The newest complete checkpoint matching ``pattern`` in the run's folders (:func:`checkpoint_dirs`), by
    modification time; None if there is none."""
    found = [p for d in checkpoint_dirs(trainer) if d.is_dir() for p in d.glob(pattern) if is_complete(p)]
    return max(found, key=lambda p: p.resolve().stat().st_mtime) if found else None


def elastic_restart_count() -> int:
    """How often torchelastic (``torchrun --max-restarts``) has restarted this job's workers: 0 on the first
    attempt and outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def find_last_checkpoint(trainer: Trainer) -> Path:
    """The newest complete ``last*.ckpt`` of the run (:func:`checkpoint_dirs`), by modification time.

    Raises:
        FileNotFoundError: none was found; the message lists the folders searched.
    """
    dirs = checkpoint_dirs(trainer)
    found = newest_checkpoint(trainer, "last*.ckpt")
    if found is None:
        searched = "\n  ".join(str(d) for d in dirs)
        raise FileNotFoundError(
            f"--ckpt_path last: no complete last*.ckpt in this run's checkpoint folders:\n  {searched}\n"
            "Pass a checkpoint path to --ckpt_path, or keep ModelCheckpoint(save_last=true) and the same "
            "trainer.default_root_dir / logger save_dir and name as the run to resume"
        )
    return found


def remove_stale_temporaries(dirs: Iterable[Path]) -> list[Path]:
    """Remove the hidden ``.<name>*.tmp`` files and directories of saves that were killed midway; return them.

    ``.<name>.old`` (a replaced directory checkpoint moved aside) is kept: after a crash between the two renames it
    is the only copy.
    """
    removed = []
    for folder in dirs:
        if not folder.is_dir():
            continue
        for stale in folder.glob(".*.tmp"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed

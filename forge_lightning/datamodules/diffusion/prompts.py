"""Prompts for ``forge predict`` of a video-diffusion model: a list in the YAML, a text file (one prompt a line)
or a JSONL file (``{"prompt": ..., "seed": ...}`` a line), each prompt with the seed of its noise.

A prompt without its own seed gets ``seed + its index``, so every video of a run differs and a re-run gives the
same videos. Batches are ``{"prompt": [str], "seed": [int], "index": [int]}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

RECORD_KEYS = ("prompt", "seed")


def _record(value: Any, index: int, where: str, seed: int) -> dict[str, Any]:
    """``{"prompt", "seed", "index"}`` of one entry (a string or a mapping of :data:`RECORD_KEYS`)."""
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}: a prompt is a string or a mapping with {', '.join(RECORD_KEYS)}, got {value!r}"
        )
    unknown = sorted(set(value) - set(RECORD_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; a prompt record has {', '.join(RECORD_KEYS)}")
    prompt = value.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    own = value.get("seed", seed + index)
    if not isinstance(own, int) or isinstance(own, bool):
        raise ValueError(f"{where}: 'seed' must be an integer, got {own!r}")
    return {"prompt": prompt, "seed": own, "index": index}


def read_prompts(
    prompts: Sequence[str | dict[str, Any]] | None = None, file: str | Path | None = None, *, seed: int = 0
) -> list[dict[str, Any]]:
    """The prompt records ``{"prompt", "seed", "index"}`` of a list or a file.

    Args:
        prompts: prompts, or mappings with ``prompt`` and optionally ``seed``.
        file: a ``.jsonl`` file of such mappings, or a text file of one prompt a line (blank lines skipped).
        seed: the seed of a prompt without its own is ``seed + its index``.
    """
    if (prompts is None) == (file is None):
        raise ValueError(
            "give prompts (a list) or file (a .txt or .jsonl file of prompts), not both or neither"
        )
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise FileNotFoundError(f"prompts file {path} does not exist")
        entries: list[tuple[Any, str]] = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path.name}:{number}"
            if path.suffix == ".jsonl":
                try:
                    entries.append((json.loads(line), where))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e})") from e
            else:
                entries.append((line.strip(), where))
        source = str(path)
    else:
        entries = [(value, f"prompts[{k}]") for k, value in enumerate(prompts or ())]
        source = "prompts"
    if not entries:
        raise ValueError(f"{source} holds no prompt")
    return [_record(value, k, where, seed) for k, (value, where) in enumerate(entries)]


class _Records(Dataset):
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.records[index]


def collate_prompts(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """A batch of prompt records: one list per key."""
    return {key: [r[key] for r in records] for key in ("prompt", "seed", "index")}


class VideoPromptDataModule(pl.LightningDataModule):
    """The prompts of ``forge predict`` for a video-diffusion module (``predict_step`` reads ``prompt`` and
    ``seed``; :class:`~forge_lightning.callbacks.VideoPredictionWriter` writes the videos).

    Args:
        prompts: prompts, or mappings with ``prompt`` and optionally ``seed``.
        file: a ``.jsonl`` file of such mappings, or a text file of one prompt a line; instead of ``prompts``.
        seed: the seed of a prompt without its own is ``seed + its index``.
        batch_size: prompts generated together.
    """

    def __init__(
        self,
        prompts: list[str | dict[str, Any]] | None = None,
        file: str | None = None,
        *,
        seed: int = 0,
        batch_size: int = 1,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be at least 1")
        self.records = read_prompts(prompts, file, seed=seed)
        self.batch_size = batch_size

    @override
    def predict_dataloader(self) -> DataLoader:
        return DataLoader(_Records(self.records), batch_size=self.batch_size, collate_fn=collate_prompts)

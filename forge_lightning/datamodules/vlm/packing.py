"""Packing of vision-language samples: several samples and their images per ``seq_length`` row::

    input_ids     [ sample a (images 1, 2) | sample b (text only) | sample c (image 3) | padding ]
    document_ids  [ 0 ...                  | 1 ...                | 2 ...              | 3 ...   ]
    position_ids  each sample's own (Qwen2-VL: [3, S] multimodal RoPE positions restarting per sample), the
                  padding's 0 .. p-1
    pixel_values  images 1, 2, 3 concatenated in order; image_grid_thw likewise; videos (pixel_values_videos,
                  video_grid_thw, second_per_grid_ts) the same

Bins come from :func:`~forge_lightning.datamodules.packing.best_fit_pack` (tokens per row, optionally vision patches
per row too), online at setup or read from a bins file written offline by ``forge-data vlm-pack``.

The bins file is JSON lines: a header, then one line per packed row::

    {"format": "forge-vlm-pack", "version": 1, "seq_length": 2048, "max_patches_per_row": null, "pack_buffer": 64,
     "seed": 1234, "files": ["train.jsonl"], "samples": 1000, "rows": 120, "padding": 0.021}
    {"samples": [17, 3], "sources": ["train.jsonl:18", "train.jsonl:4"], "tokens": [1500, 530], "patches": 2304}

``samples`` are indices into the scanned samples of ``files`` (their order: file by file, record by record, bad
records left out), ``sources`` and ``tokens`` are checked against them when the file is read, so a bins file of
other data, tokenizer or image settings is refused with the row and record named.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from forge_lightning.atomic_io import write_file
from forge_lightning.datamodules.packing import PackedDataset, shuffled_best_fit_pack
from forge_lightning.datamodules.vlm.dataset import VLMDataset, cat_pixel_inputs, vlm_collate
from forge_lightning.datamodules.vlm.scan import VLMSample

BINS_FORMAT, BINS_VERSION = "forge-vlm-pack", 1
PACKED_KEYS = ("input_ids", "labels", "position_ids", "document_ids")


class VLMPackedDataset(PackedDataset):
    """Packed rows of a :class:`~forge_lightning.datamodules.vlm.dataset.VLMDataset`: the samples of each bin
    one after another, then padding (a document of its own), with their pixel inputs concatenated in order and
    each sample's LLM positions computed here, on the host, once per sample.

    Args:
        dataset: the samples.
        bins: sample indices per row.
        seq_length: tokens per row.
        pad_id: token id of the padding.
        ignore_index: label of the padding.
    """

    dataset: VLMDataset

    def __init__(
        self,
        dataset: VLMDataset,
        bins: list[list[int]],
        seq_length: int,
        *,
        pad_id: int,
        ignore_index: int = -100,
    ) -> None:
        super().__init__(dataset, bins, seq_length, pad_id=pad_id, ignore_index=ignore_index)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        samples = [self.dataset[i] for i in self.bins[index]]
        row = self.pack(samples, index)
        positions = [self.dataset.vision.positions(s["input_ids"], s) for s in samples]
        if positions and positions[0] is not None:  # multimodal RoPE: [axes, n] per sample, padding as text
            padding_P = row["position_ids"][sum(len(s["input_ids"]) for s in samples) :]
            row["position_ids"] = torch.cat([*positions, padding_P.expand(len(positions[0]), -1)], dim=1)
        return {**row, **cat_pixel_inputs(samples, PACKED_KEYS)}

    def documents(self, index: int) -> tuple[list[int], list[VLMSample]]:
        """Token counts of row ``index``'s documents (the padding's last) and its samples."""
        samples = [self.dataset.samples[i] for i in self.bins[index]]
        lengths = [s.length for s in samples]
        return [*lengths, self.seq_length - sum(lengths)], samples


def packed_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack packed rows (``position_ids`` to ``[3, B, S]`` when they are multimodal) and concatenate their pixel
    inputs in row order."""
    batch = {key: torch.stack([r[key] for r in rows]) for key in PACKED_KEYS}
    if batch["position_ids"].ndim == 3:
        batch["position_ids"] = batch["position_ids"].movedim(1, 0)  # [B, 3, S] -> [3, B, S]
    return {**batch, **cat_pixel_inputs(rows, PACKED_KEYS)}


def vlm_batch_collate(samples: list[dict[str, torch.Tensor]], *, pad_id: int) -> dict[str, torch.Tensor]:
    """:func:`packed_collate` for packed rows (training), :func:`vlm_collate` for samples (evaluation)."""
    return packed_collate(samples) if "document_ids" in samples[0] else vlm_collate(samples, pad_id=pad_id)


def pack_bins(
    dataset: VLMDataset,
    seq_length: int,
    *,
    seed: int,
    buffer_size: int = 64,
    max_patches_per_row: int | None = None,
) -> list[list[int]]:
    """Best-fit bins of ``dataset``'s samples (taken in a seeded random order) of at most ``seq_length`` tokens
    and, with ``max_patches_per_row``, at most that many vision-encoder patches.

    Raises:
        ValueError: a sample alone has more patches than ``max_patches_per_row`` (named).
    """
    extra: dict[str, Any] = {}
    if max_patches_per_row is not None:
        if max_patches_per_row < 1:
            raise ValueError(f"max_patches_per_row ({max_patches_per_row}) must be positive")
        for sample in dataset.samples:
            if sample.num_patches > max_patches_per_row:
                raise ValueError(
                    f"{sample.source}: its images have {sample.num_patches} vision patches, more than "
                    f"max_patches_per_row ({max_patches_per_row}): raise the cap or lower max_pixels"
                )
        extra = {"extra_sizes": dataset.num_patches, "extra_capacity": max_patches_per_row}
    return shuffled_best_fit_pack(dataset.lengths, seq_length, seed=seed, buffer_size=buffer_size, **extra)


def padding_fraction(dataset: VLMDataset, bins: list[list[int]], seq_length: int) -> float:
    """The share of padding tokens in the packed rows."""
    lengths = dataset.lengths
    return 1 - sum(lengths[i] for b in bins for i in b) / max(1, len(bins) * seq_length)


def write_bins(path: str | Path, dataset: VLMDataset, bins: list[list[int]], header: dict[str, Any]) -> None:
    """Write ``bins`` of ``dataset``'s samples as a bins file (format in this module's docstring); ``header``:
    ``seq_length``, ``max_patches_per_row``, ``pack_buffer``, ``seed``, ``files``."""
    head = {"format": BINS_FORMAT, "version": BINS_VERSION, **header}
    head |= {"samples": len(dataset), "rows": len(bins)}
    head["padding"] = round(padding_fraction(dataset, bins, header["seq_length"]), 6)
    lines = [json.dumps(head)]
    for b in bins:
        samples = [dataset.samples[i] for i in b]
        lines.append(
            json.dumps(
                {
                    "samples": b,
                    "sources": [s.source for s in samples],
                    "tokens": [s.length for s in samples],
                    "patches": sum(s.num_patches for s in samples),
                }
            )
        )
    content = ("\n".join(lines) + "\n").encode()
    write_file(path, lambda stream: stream.write(content))


def read_bins(path: str | Path, dataset: VLMDataset, seq_length: int) -> list[list[int]]:
    """The bins of a bins file, checked against the scanned ``dataset`` and ``seq_length``.

    Raises:
        ValueError: not a bins file, another ``seq_length`` or sample count, or a row whose samples are not the
            scanned ones (named by ``path:line`` and the record).
    """
    lines = Path(path).read_text().splitlines()
    try:
        head = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        head = {}
    if head.get("format") != BINS_FORMAT or head.get("version") != BINS_VERSION:
        raise ValueError(
            f"{path}: not a {BINS_FORMAT} v{BINS_VERSION} bins file (write one with forge-data vlm-pack)"
        )
    for key, expected in (("seq_length", seq_length), ("samples", len(dataset))):
        if head[key] != expected:
            raise ValueError(
                f"{path}: packed for {key} {head[key]}, but this run has {expected}: rerun forge-data vlm-pack "
                "with this run's data and options"
            )
    bins, seen = [], set()
    for number, line in enumerate(lines[1:], start=2):
        row = json.loads(line)
        _check_row(f"{path}:{number}", row, dataset.samples, seq_length, seen)
        bins.append([int(i) for i in row["samples"]])
    return bins


def _check_row(where: str, row: dict, samples: Sequence[VLMSample], seq_length: int, seen: set[int]) -> None:
    for index, source, tokens in zip(row["samples"], row["sources"], row["tokens"], strict=True):
        if not 0 <= index < len(samples) or index in seen:
            raise ValueError(f"{where}: sample {index} is out of range or in two rows")
        sample = samples[index]
        # The file part of a source may be written relative or absolute: compare the file name and the record.
        if (Path(sample.source).name, sample.length) != (Path(source).name, tokens):
            raise ValueError(
                f"{where}: sample {index} was {source} with {tokens} tokens when packed but is {sample.source} with "
                f"{sample.length} tokens now: the data, tokenizer or image options changed; rerun forge-data vlm-pack"
            )
        seen.add(index)
    if sum(row["tokens"]) > seq_length:
        raise ValueError(f"{where}: {sum(row['tokens'])} tokens do not fit seq_length {seq_length}")

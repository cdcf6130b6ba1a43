"""``forge-data vlm-pack``: offline packing of vision-language data.

``forge-data vlm-pack --input train.jsonl --tokenizer TOK --output bins.jsonl [--seq-length N] [--processor ...]``
scans the records as ``VLMDataModule`` does (lengths after image expansion, patches per image), packs them best-fit
into ``seq_length`` rows (optionally at most ``--max-patches-per-row`` vision patches each) and writes a bins file
(format: :mod:`forge_lightning.datamodules.vlm.packing`). Train on it with ``data.packed_bins: bins.jsonl`` and the
same data options; the bins are those the online packer gives for the same seed and buffer.
"""

from __future__ import annotations

import argparse
import json

# Data options of VLMDataModule that shape the samples (so the scan here equals the training run's).
_SAMPLE_OPTIONS = ("image_root", "template", "train_on", "processor", "on_bad_sample")
_VISION_OPTIONS = (
    "min_pixels",
    "max_pixels",
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "image_size",
    "video_num_frames",
    "video_min_frames",
    "video_max_frames",
    "video_min_pixels",
    "video_max_pixels",
)
_FLOAT_OPTIONS = ("video_fps",)
_FLAG_OPTIONS = ("video_cap_pixels_per_frame",)
# llava_onevision's tile geometry: a name, and the pinpoints as JSON ("[[384, 384], [384, 768]]").
_TEXT_OPTIONS = ("vision_aspect_ratio",)
_JSON_OPTIONS = ("image_grid_pinpoints",)


def vlm_pack(args: argparse.Namespace) -> None:
    """Scan ``args.input``, pack the samples and write the bins file ``args.output``."""
    from forge_lightning.datamodules.vlm import VLMDataModule
    from forge_lightning.datamodules.vlm.packing import padding_fraction, write_bins

    options = {
        k: getattr(args, k)
        for k in (
            *_SAMPLE_OPTIONS,
            *_VISION_OPTIONS,
            *_FLOAT_OPTIONS,
            *_FLAG_OPTIONS,
            *_TEXT_OPTIONS,
            *_JSON_OPTIONS,
        )
        if getattr(args, k) is not None
    }
    dm = VLMDataModule(
        args.input,
        args.tokenizer,
        seq_length=args.seq_length,
        pack=True,  # the data module's own packer: the bins are those training would make online
        pack_buffer=args.pack_buffer,
        max_patches_per_row=args.max_patches_per_row,
        seed=args.seed,
        num_workers=0,
        **options,
    )
    try:
        dm.setup("fit")
    except ValueError as error:
        raise SystemExit(f"forge-data vlm-pack: error: {error}") from None
    dataset, bins = dm.train_dataset.dataset, dm.train_dataset.bins
    header = {
        "seq_length": args.seq_length,
        "max_patches_per_row": args.max_patches_per_row,
        "pack_buffer": args.pack_buffer,
        "seed": args.seed,
        "files": list(args.input),
    }
    write_bins(args.output, dataset, bins, header)
    print(
        f"wrote {args.output}: {len(dataset)} samples in {len(bins)} rows of {args.seq_length} "
        f"({padding_fraction(dataset, bins, args.seq_length):.1%} padding)"
    )


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``vlm-pack`` on ``forge-data``'s subparsers."""
    p = subparsers.add_parser("vlm-pack", help="pack image + text records into seq_length rows (a bins file)")
    p.add_argument("--input", nargs="+", required=True, help="data file(s) of records, as data.train_files")
    p.add_argument("--tokenizer", required=True, help="the model's Hugging Face tokenizer directory")
    p.add_argument("--output", required=True, help="the bins file to write (.jsonl)")
    p.add_argument("--seq-length", type=int, default=2048, help="tokens per packed row (default: 2048)")
    p.add_argument(
        "--pack-buffer", type=int, default=64, help="open rows of the best-fit packer (default: 64)"
    )
    p.add_argument("--max-patches-per-row", type=int, default=None, help="most vision patches per row")
    p.add_argument(
        "--seed", type=int, default=1234, help="seed of the packing order, as data.seed (default: 1234)"
    )
    for name in _SAMPLE_OPTIONS:
        p.add_argument(f"--{name.replace('_', '-')}", default=None, help=f"as data.{name}")
    for name in _VISION_OPTIONS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"as data.{name}")
    for name in _FLOAT_OPTIONS:
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=None, help=f"as data.{name}")
    p.add_argument(
        "--video-cap-pixels-per-frame",
        action="store_true",
        default=None,
        help="as data.video_cap_pixels_per_frame (qwen3_vl)",
    )
    for name in _TEXT_OPTIONS:
        p.add_argument(f"--{name.replace('_', '-')}", default=None, help=f"as data.{name}")
    for name in _JSON_OPTIONS:
        p.add_argument(
            f"--{name.replace('_', '-')}", type=json.loads, default=None, help=f"as data.{name} (JSON)"
        )
    p.set_defaults(func=vlm_pack)

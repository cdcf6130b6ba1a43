"""Supervised fine-tuning data of vision-language models: image / video + text conversations, loss-masked, in padded
batches of the inputs ``VisionLanguageModel`` takes."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset
from typing_extensions import override

from forge_lightning.datamodules.base import TokenDataModule
from forge_lightning.datamodules.chat import ChatEncoder
from forge_lightning.datamodules.loader import StepLoader
from forge_lightning.datamodules.sft import GenerationReference
from forge_lightning.datamodules.vlm.balance import BalancedStepLoader, CostModel, item_costs
from forge_lightning.datamodules.vlm.dataset import VLMDataset, media_inputs
from forge_lightning.datamodules.vlm.encoding import VLMEncoder
from forge_lightning.datamodules.vlm.packing import (
    VLMPackedDataset,
    pack_bins,
    padding_fraction,
    read_bins,
    vlm_batch_collate,
)
from forge_lightning.datamodules.vlm.scan import ON_BAD_SAMPLE, ScanReport, VLMSample, scan_files
from forge_lightning.datamodules.vlm.vision_inputs import PROCESSORS, VisionInputs


class VLMDataModule(TokenDataModule):
    """Image / video + text chat fine-tuning data from ``.json`` / ``.jsonl`` files, WebDataset shards or
    Energon-prepared datasets (``sources.py``; records in LLaVA, ShareGPT with images / videos, OpenAI content parts;
    text-only records too), rendered with a chat template, images and videos expanded to vision tokens.

    ``setup`` scans every record first (image headers, video headers, ``<image>`` / ``<video>`` counts, lengths
    after expansion, assistant turns); bad ones are skipped and counted in one summary line, or raised
    (``on_bad_sample="error"``). Batches are right-padded: ``input_ids``, ``attention_mask``, ``labels`` (shifted
    next tokens, -100 where not trained, as in SFT), plus ``pixel_values`` (and ``image_grid_thw`` for ``qwen2_vl`` /
    ``qwen3_vl``, ``image_sizes`` and ``batch_num_images`` for ``llava_onevision``) when a sample of the batch has an
    image, and ``pixel_values_videos`` (and ``video_grid_thw`` for ``qwen2_vl`` / ``qwen3_vl``,
    ``second_per_grid_ts`` for ``qwen2_vl``) when one has a video.
    With ``pack``, training batches are packed rows instead (see :mod:`~forge_lightning.datamodules.vlm.packing`):
    ``input_ids``, ``labels``, ``document_ids``, ``position_ids`` ``[B, seq_length]`` (``[3, B, seq_length]``
    positions for ``qwen2_vl`` / ``qwen3_vl``) and the rows' pixel inputs; with ``balance``, each global micro-batch is split over
    the data-parallel ranks by estimated compute (see :mod:`~forge_lightning.datamodules.vlm.balance`).

    Args:
        train_files: data file(s) of training records: ``.json`` / ``.jsonl``, ``.tar`` shards or brace patterns,
            or energon-prepared directories (their ``train`` part; ``val_files`` read the ``val`` part).
        tokenizer: the model's Hugging Face tokenizer directory (it must have the processor's image tokens, and
            ``<|video_pad|>`` for videos).
        val_files: data file(s) of validation records (masked loss and generation references).
        image_root: the directory relative image paths start from (default: each data file's directory).
        template: ``None`` for the tokenizer's own chat template, a built-in name or a ``.jinja`` file.
        train_on: ``assistant``, ``last_assistant`` or ``all``.
        seq_length: most training positions of a sample after image expansion; longer samples are bad.
        processor: ``qwen2_vl`` (Qwen2-VL / Qwen2.5-VL dynamic resolution), ``qwen3_vl`` (Qwen3-VL: 16-pixel
            patches, mean / std 0.5, timestamped video frames), ``fixed`` (one square size, e.g. SigLIP) or
            ``llava_onevision`` (any-resolution tiles, videos of ``video_num_frames`` frames).
        min_pixels: ``qwen2_vl`` / ``qwen3_vl``: the least pixels of a resized image (default 3136).
        max_pixels: ``qwen2_vl`` / ``qwen3_vl``: the most pixels of a resized image (default 1003520).
        patch_size: side of a vision-encoder patch (default: the processor's, 14; 16 for ``qwen3_vl``).
        merge_size: ``qwen2_vl`` / ``qwen3_vl``: side of the square of patches merged into one token (default 2).
        temporal_patch_size: ``qwen2_vl`` / ``qwen3_vl``: frames per temporal patch (default 2).
        image_size: ``fixed``: side of the square images are resized to; ``llava_onevision``: side of a tile
            (default 384 for both).
        image_grid_pinpoints: ``llava_onevision``: the ``[height, width]`` resolutions an image may be tiled at
            (the model's ``image_grid_pinpoints``; default 1 to 6 tiles a side).
        vision_aspect_ratio: ``llava_onevision``: the model's ``vision_aspect_ratio`` (default ``anyres_max_9``).
        video_fps: ``qwen2_vl`` / ``qwen3_vl``: frames sampled per second of video (default 2.0; not with
            ``video_num_frames``).
        video_num_frames: a fixed number of frames sampled per video instead (``qwen2_vl``: rounded to a
            multiple of ``temporal_patch_size``); ``llava_onevision``: the frames of every video (default 32).
        video_min_frames: ``qwen2_vl`` / ``qwen3_vl``: the least frames sampled at ``video_fps`` (default 4).
        video_max_frames: ``qwen2_vl`` / ``qwen3_vl``: the most frames sampled at ``video_fps`` (default 768).
        video_min_pixels: ``qwen2_vl``: the least pixels of a resized video frame (default 100352); ``qwen3_vl``:
            of all the sampled frames together (default 131072).
        video_max_pixels: ``qwen2_vl``: the most pixels of a resized video frame (default 602112); ``qwen3_vl``:
            of all the sampled frames together (default 786432).
        video_cap_pixels_per_frame: ``qwen3_vl``: cap each frame's pixels as qwen-vl-utils does (transformers'
            ``cap_pixels_per_frame``; default off, transformers' current default).
        tokens_per_second: ``qwen2_vl``: temporal positions per second of video, for the positions of packed rows:
            the model's ``vision_config.tokens_per_second`` (default 2, Qwen2.5-VL's).
        on_bad_sample: ``skip`` (count and leave out) or ``error`` (raise the first bad record).
        verify_pixels: decode every image at setup too (slow; finds truncated JPEGs that ``verify()`` misses).
        pack: pack training samples into ``seq_length`` rows (best fit over a buffer, in a seeded order).
        pack_buffer: open rows the online packer keeps.
        max_patches_per_row: with ``pack``, the most vision-encoder patches of a row (bounds the encoder's memory).
        packed_bins: a bins file of ``forge-data vlm-pack`` to pack by (implies ``pack``; the packer options are
            the file's).
        balance: split each global micro-batch over the data-parallel ranks by estimated compute.
        balance_cost: the cost model of ``balance`` (default: Qwen2.5-VL-7B's sizes).
        batch_size: micro-batch per data-parallel rank.
        seed: seed of the per-epoch sample order.
        num_workers: DataLoader workers per rank.
        pin_memory: pin host memory (useful on CUDA).
    """

    def __init__(
        self,
        train_files: str | list[str],
        tokenizer: str,
        *,
        val_files: str | list[str] | None = None,
        image_root: str | None = None,
        template: str | None = None,
        train_on: str = "assistant",
        seq_length: int = 2048,
        processor: str = "qwen2_vl",
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        patch_size: int | None = None,
        merge_size: int | None = None,
        temporal_patch_size: int | None = None,
        image_size: int | None = None,
        image_grid_pinpoints: list[list[int]] | None = None,
        vision_aspect_ratio: str | None = None,
        video_fps: float | None = None,
        video_num_frames: int | None = None,
        video_min_frames: int | None = None,
        video_max_frames: int | None = None,
        video_min_pixels: int | None = None,
        video_max_pixels: int | None = None,
        video_cap_pixels_per_frame: bool | None = None,
        tokens_per_second: float | None = None,
        on_bad_sample: str = "skip",
        verify_pixels: bool = False,
        pack: bool = False,
        pack_buffer: int = 64,
        max_patches_per_row: int | None = None,
        packed_bins: str | None = None,
        balance: bool = False,
        balance_cost: CostModel | None = None,
        batch_size: int = 8,
        seed: int = 1234,
        num_workers: int = 2,
        pin_memory: bool = True,
    ) -> None:
        super().__init__(
            tokenizer, batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=pin_memory
        )
        if processor not in PROCESSORS:
            raise ValueError(f"processor ({processor!r}) must be one of {', '.join(PROCESSORS)}")
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ValueError(f"on_bad_sample ({on_bad_sample!r}) must be one of {', '.join(ON_BAD_SAMPLE)}")
        if seq_length < 1 or pack_buffer < 1:
            raise ValueError(f"seq_length ({seq_length}) and pack_buffer ({pack_buffer}) must be positive")
        if max_patches_per_row is not None and not (pack or packed_bins):
            raise ValueError("max_patches_per_row caps packed rows: set pack too, or leave it unset")
        given = {
            "min_pixels": min_pixels,
            "max_pixels": max_pixels,
            "patch_size": patch_size,
            "merge_size": merge_size,
            "temporal_patch_size": temporal_patch_size,
            "image_size": image_size,
            "image_grid_pinpoints": image_grid_pinpoints,
            "vision_aspect_ratio": vision_aspect_ratio,
            "video_fps": video_fps,
            "video_num_frames": video_num_frames,
            "video_min_frames": video_min_frames,
            "video_max_frames": video_max_frames,
            "video_min_pixels": video_min_pixels,
            "video_max_pixels": video_max_pixels,
            "video_cap_pixels_per_frame": video_cap_pixels_per_frame,
            "tokens_per_second": tokens_per_second,
        }
        self.vision_options = {k: v for k, v in given.items() if v is not None}
        allowed = PROCESSORS[processor].options
        if wrong := [k for k in self.vision_options if k not in allowed]:
            raise ValueError(
                f"{', '.join(wrong)} do(es) not apply to processor {processor!r} (its options: "
                f"{', '.join(allowed)}): remove it, or choose the processor it belongs to"
            )
        self.train_files = [train_files] if isinstance(train_files, str) else list(train_files)
        self.val_files = [val_files] if isinstance(val_files, str) else list(val_files or [])
        self.image_root = image_root
        self.template = template
        self.train_on = train_on
        self.seq_length = seq_length
        self.processor = processor
        self.on_bad_sample = on_bad_sample
        self.verify_pixels = verify_pixels
        self.pack = pack or packed_bins is not None
        self.pack_buffer = pack_buffer
        self.max_patches_per_row = max_patches_per_row
        self.packed_bins = packed_bins
        self.balance = balance
        self.balance_cost = balance_cost or CostModel()
        self.reports: dict[str, ScanReport] = {}
        self._encoder: VLMEncoder | None = None
        self._val_samples: list[VLMSample] = []

    @property
    def encoder(self) -> VLMEncoder:
        """Renders, tokenizes and expands records (built on first use; checks the tokenizer's image tokens).

        Raises:
            ValueError: the tokenizer lacks a special token the processor needs.
        """
        if self._encoder is None:
            backend = self.tokenizer.backend
            vision = PROCESSORS[self.processor].from_tokenizer(backend, **self.vision_options)
            self._encoder = VLMEncoder(ChatEncoder(backend, self.template, train_on=self.train_on), vision)
        return self._encoder

    @property
    def vision(self) -> VisionInputs:
        """The image tokens and pixel inputs of the chosen processor."""
        return self.encoder.vision

    @property
    def special_token_ids(self) -> dict[str, int]:
        """The tokenizer's ids of the image tokens, by config name (``image_token_id``, and for ``qwen2_vl`` /
        ``qwen3_vl`` ``vision_start_token_id`` / ``vision_end_token_id``, and ``video_token_id`` where the tokenizer has
        ``<|video_pad|>``): the model's config must agree."""
        return self.vision.special_token_ids

    @property
    def vision_settings(self) -> dict[str, float | None]:
        """``tokens_per_second``, the video positions packed rows get on the host: the rate for ``qwen2_vl``, ``None``
        for ``qwen3_vl`` (its video time is text): the model's config must agree; nothing for ``fixed``."""
        vision = self.vision
        return {} if vision.video_token is None else {"tokens_per_second": vision.tokens_per_second}

    @property
    def pad_id(self) -> int:
        """Token id used for padding (masked out by ``attention_mask``, never trained)."""
        return self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0

    def _load(self, files: list[str], split: str) -> tuple[VLMDataset, list[VLMSample]]:
        samples, report = scan_files(
            files,
            self.encoder,
            seq_length=self.seq_length,
            image_root=self.image_root,
            on_bad_sample=self.on_bad_sample,
            verify_pixels=self.verify_pixels,
            split=split,
        )
        self.reports[split] = report
        if not samples:
            raise ValueError(f"no usable {split} sample: {report.describe()}")
        rank_zero_info(report.describe())
        return VLMDataset(samples, self.vision), samples

    @override
    def setup(self, stage: str) -> None:
        self.encoder  # noqa: B018 -- checks the tokenizer's image tokens before any file is read
        self.collate_fn = functools.partial(vlm_batch_collate, pad_id=self.pad_id)
        if stage == "fit" and self.train_dataset is None:
            train, _ = self._load(self.train_files, "train")
            self.train_dataset = self._packed(train) if self.pack else train
        if self.val_files and self.val_dataset is None:
            self.val_dataset, self._val_samples = self._load(self.val_files, "val")

    def _packed(self, dataset: VLMDataset) -> VLMPackedDataset:
        if self.packed_bins is not None:
            bins = read_bins(self.packed_bins, dataset, self.seq_length)
        else:
            bins = pack_bins(
                dataset,
                self.seq_length,
                seed=self.seed,
                buffer_size=self.pack_buffer,
                max_patches_per_row=self.max_patches_per_row,
            )
        rank_zero_info(
            f"VLM packing: {sum(map(len, bins))} samples into {len(bins)} rows of {self.seq_length} "
            f"({padding_fraction(dataset, bins, self.seq_length):.1%} padding)"
        )
        return VLMPackedDataset(dataset, bins, self.seq_length, pad_id=self.pad_id)

    @override
    def _make_train_loader(self, dataset: Dataset, **options: Any) -> StepLoader:
        if not self.balance:
            return super()._make_train_loader(dataset, **options)
        return BalancedStepLoader(dataset, costs=item_costs(dataset, self.balance_cost), **options)

    def generation_references(self, split: str = "val") -> list[GenerationReference]:
        """Prompts (the conversation before its last assistant turn, image and video tokens expanded, with the
        pixel inputs of the images and videos it holds as ``inputs``) and that turn's text, for generation metrics
        such as exact match."""
        if split != "val":
            raise ValueError(f"generation references exist for split 'val' only, got {split!r}")
        if not self._val_samples and self.val_files:
            self.setup("validate")
        references = []
        for sample in self._val_samples:
            prompt, answer, num_images, num_videos = self.encoder.prompt_and_answer(
                sample.conversation, sample.sizes, [v.info for v in sample.videos]
            )
            inputs = media_inputs(sample, self.vision, num_images, num_videos) or None
            references.append(GenerationReference(prompt, answer, sample.source, inputs))
        return references

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end a generated answer."""
        return self.encoder.chat.stop_token_ids()

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(ids)

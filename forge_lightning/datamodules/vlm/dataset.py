"""Scanned vision-language samples as model inputs, and their collation into padded batches::

sample  input_ids [n]   labels [n] (next token where trained, else -100)   pixel inputs of its images and videos
batch   input_ids [B, L] (pad id)   attention_mask [B, L] (0 at padding)   labels [B, L] (-100)
        pixel_values: the samples' concatenated in order; image_grid_thw likewise (no image: neither key);
        pixel_values_videos, video_grid_thw, second_per_grid_ts: the same for videos
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from forge_lightning.datamodules.vlm.scan import VLMSample
from forge_lightning.datamodules.vlm.video import VideoSampling, read_video
from forge_lightning.datamodules.vlm.vision_inputs import VideoInputs, VisionInputs

TEXT_KEYS = ("input_ids", "labels")


class VLMDataset(Dataset):
    """Next-token samples of scanned records: ``labels[i]`` is ``input_ids[i + 1]``'s token where trained (as in
    SFT: labels come shifted), else ``ignore_index``; images and videos are decoded and processed when a sample is
    read.

    Args:
        samples: the scanned samples.
        vision: makes the pixel inputs of a sample's images.
        ignore_index: label of tokens that are not trained.
    """

    def __init__(
        self, samples: Sequence[VLMSample], vision: VisionInputs, *, ignore_index: int = -100
    ) -> None:
        self.samples = list(samples)
        self.vision = vision
        self.ignore_index = ignore_index

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> list[int]:
        """Training positions of each sample (``len(input_ids)``), vision tokens included."""
        return [s.length for s in self.samples]

    @property
    def num_patches(self) -> list[int]:
        """Vision-encoder patches of each sample's images and videos."""
        return [s.num_patches for s in self.samples]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.samples[index]
        tokens = torch.from_numpy(sample.tokens.astype(np.int64))
        trained = torch.from_numpy(sample.trainable[1:])
        item = {
            "input_ids": tokens[:-1],
            "labels": torch.where(trained, tokens[1:], torch.full_like(tokens[1:], self.ignore_index)),
        }
        return {**item, **media_inputs(sample, self.vision)}


def media_inputs(
    sample: VLMSample, vision: VisionInputs, num_images: int | None = None, num_videos: int | None = None
) -> dict[str, torch.Tensor]:
    """The pixel inputs of the first ``num_images`` (all) images and ``num_videos`` (all) videos of ``sample``
    (no keys for none)."""
    images = load_images(sample, num_images) if sample.images else []
    inputs = vision.process(images) if images else {}
    videos = sample.videos[:num_videos]
    if videos:
        video = cast(VideoInputs, vision)
        frames = load_videos(sample, video.sampling, num_videos)
        inputs |= video.process_videos(frames, [v.info for v in videos])
    return inputs


def load_images(sample: VLMSample, count: int | None = None) -> list[Any]:
    """The first ``count`` (all) decoded RGB images of ``sample``.

    Raises:
        ValueError: an image no longer decodes, or has another size than at the scan (the file changed since).
    """
    images = []
    for image, size in list(zip(sample.images, sample.sizes))[:count]:
        try:
            decoded = image.load()
        except Exception as error:  # Pillow's many kinds; the scan's verify() cannot catch every truncation
            raise ValueError(
                f"{sample.source}: {image.ref} cannot be decoded ({error}); set verify_pixels to find such images "
                "at setup"
            ) from error
        if decoded.size != size:
            raise ValueError(
                f"{sample.source}: {image.ref} is {decoded.size} (width, height) but was {size} at setup: the file "
                "changed since; rerun setup"
            )
        images.append(decoded)
    return images


def load_videos(sample: VLMSample, sampling: VideoSampling, count: int | None = None) -> list[np.ndarray]:
    """The sampled frames (uint8 ``[T, H, W, 3]``) of the first ``count`` (all) videos of ``sample``.

    Raises:
        ValueError: a video no longer decodes, or gives other frames than at the scan (the file changed since).
    """
    videos = []
    for video in sample.videos[:count]:
        try:
            frames_THWC = read_video(video.path, sampling)
        except Exception as error:  # FFmpeg's errors and missing frames alike
            raise ValueError(
                f"{sample.source}: {video.ref} cannot be decoded ({error}); set verify_pixels to find such videos "
                "at setup"
            ) from error
        info = video.info
        expected = (len(sampling.indices(info)), info.height, info.width, 3)
        if frames_THWC.shape != expected:
            raise ValueError(
                f"{sample.source}: {video.ref} gives frames {list(frames_THWC.shape)} but {list(expected)} at setup: "
                "the file changed since; rerun setup"
            )
        videos.append(frames_THWC)
    return videos


def vlm_collate(
    samples: list[dict[str, torch.Tensor]], *, pad_id: int, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """Right-pad the text of ``samples`` to the longest and concatenate their pixel inputs in sample order.

    Args:
        samples: items of :class:`VLMDataset`.
        pad_id: token id of the padding.
        ignore_index: label of the padding.

    Returns:
        ``input_ids``, ``attention_mask``, ``labels`` ``[B, L]``, and each pixel input (``pixel_values``,
        ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``) that any sample
        has, concatenated along dim 0.
    """
    longest = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), longest), ignore_index, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n] = sample["input_ids"]
        labels[row, :n] = sample["labels"]
        attention_mask[row, :n] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return {**batch, **cat_pixel_inputs(samples)}


def cat_pixel_inputs(
    samples: Sequence[dict[str, torch.Tensor]], text_keys: Sequence[str] = TEXT_KEYS
) -> dict:
    """Each pixel input (every key but ``text_keys``) that any of ``samples`` has, concatenated in order along
    dim 0."""
    keys = dict.fromkeys(k for s in samples for k in s if k not in text_keys)
    return {key: torch.cat([s[key] for s in samples if key in s]) for key in keys}

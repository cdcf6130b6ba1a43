"""``LeRobotDataModule``: one or several LeRobot datasets, split by episode, mixed by weight, resumable.

root A ──split episodes──> train A ─┐                         ┌─> StepLoader (train, resumable) ─┐
root B ──split episodes──> train B ─┴─ BlendedDataset(weights) ┘                                  ├─> device ─> cameras
                           val A, val B ──── ConcatDataset ────> ShardedLoader (validation) ──────┘

cameras (``on_after_batch_transfer``, on the batch's device): resized to ``image_size`` in every stage,
augmented (``augment``) in training only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import ConcatDataset, Dataset
from typing_extensions import override

from forge_lightning.datamodules.base import StepDataModule
from forge_lightning.datamodules.gpt_dataset import BlendedDataset
from forge_lightning.datamodules.lerobot.augment import (
    ImageAugment,
    ImageAugmentConfig,
    rank_seed,
    resize_frames,
)
from forge_lightning.datamodules.lerobot.dataset import LeRobotDataset
from forge_lightning.datamodules.lerobot.meta import LeRobotMeta
from forge_lightning.datamodules.lerobot.video import VIDEO_BACKENDS


def split_episodes(episodes: Sequence[int], val_fraction: float, *, seed: int) -> tuple[list[int], list[int]]:
    """Splits episodes into (train, val) by a seeded shuffle; a positive fraction keeps at least one of each.

    Raises:
        ValueError: If ``val_fraction`` is outside ``[0, 1)`` or there are too few episodes to split.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction ({val_fraction}) must be in [0, 1)")
    episodes = sorted(episodes)
    if val_fraction == 0:
        return episodes, []
    if len(episodes) < 2:
        raise ValueError(f"val_fraction ({val_fraction}) needs at least 2 episodes, got {len(episodes)}")
    num_val = min(max(1, round(len(episodes) * val_fraction)), len(episodes) - 1)
    order = np.random.default_rng(seed).permutation(len(episodes))
    val = sorted(episodes[i] for i in order[:num_val])
    return [e for e in episodes if e not in val], val


@dataclass(kw_only=True)
class LeRobotDataConfig:
    """What the data module reads (validated on construction).

    Args:
        roots: dataset roots (one or several).
        weights: mixing weights, one per root (default: proportional to training frames).
        delta_timestamps: per feature, offsets in seconds (history, action chunk).
        normalization: per feature, ``mean_std``, ``min_max``, ``quantiles``, ``quantile10`` or ``identity``.
        val_fraction: fraction of each dataset's episodes held out for validation.
        num_train_samples: training samples per epoch (default: all training frames).
        video_backend: ``pyav`` or ``torchcodec``.
        image_size: resize camera frames on the device to ``[height, width]`` in every stage (default: as stored).
        augment: train-time camera augmentation (a dict of :class:`ImageAugmentConfig` options is accepted).
    """

    roots: list[str]
    weights: list[float] | None = None
    delta_timestamps: dict[str, list[float]] = field(default_factory=dict)
    normalization: dict[str, str] = field(default_factory=dict)
    val_fraction: float = 0.0
    num_train_samples: int | None = None
    video_backend: str = "pyav"
    image_size: list[int] | None = None
    augment: ImageAugmentConfig = field(default_factory=ImageAugmentConfig)

    def __post_init__(self) -> None:
        if not self.roots:
            raise ValueError("roots is empty: give at least one LeRobot dataset root")
        if self.weights is not None and len(self.weights) != len(self.roots):
            raise ValueError(f"weights has {len(self.weights)} entries but roots has {len(self.roots)}")
        if self.weights is not None and any(not w > 0 for w in self.weights):
            raise ValueError(f"weights ({self.weights}) must all be positive")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction ({self.val_fraction}) must be in [0, 1)")
        if self.num_train_samples is not None and self.num_train_samples < 1:
            raise ValueError(f"num_train_samples ({self.num_train_samples}) must be positive")
        if self.video_backend not in VIDEO_BACKENDS:
            raise ValueError(f"video_backend ({self.video_backend!r}) must be one of {VIDEO_BACKENDS}")
        if self.image_size is not None and (len(self.image_size) != 2 or min(self.image_size) < 1):
            raise ValueError(f"image_size ({self.image_size}) must be [height, width], both positive")
        if isinstance(self.augment, Mapping):
            self.augment = ImageAugmentConfig.from_dict(self.augment)


class LeRobotDataModule(StepDataModule):
    """Training / validation frames from LeRobot datasets, resumable mid-epoch.

    The training loader is a :class:`StepLoader`, whose ``state_dict`` Lightning saves in checkpoints, so a
    resumed run sees exactly the frames the uninterrupted run would have seen. Camera frames are resized and
    augmented in ``on_after_batch_transfer``, on the device the batch was copied to (the augmentation generator's
    state is saved with the data module's).

    Args:
        roots: dataset root or roots.
        weights: mixing weights, one per root.
        delta_timestamps: per feature, offsets in seconds (``observation.state: [-0.1, 0]``, ``action: [0, 0.1]``).
        normalization: per feature normalisation mode (each dataset normalised with its own stats).
        val_fraction: fraction of each dataset's episodes held out for validation.
        num_train_samples: training samples per epoch (default: all training frames).
        batch_size: micro-batch per data-parallel rank.
        seed: seed of the episode split, the mix and the per-epoch order.
        num_workers: DataLoader workers per rank (each opens its own video decoders).
        pin_memory: pin host memory (useful on CUDA).
        video_backend: ``pyav`` or ``torchcodec``.
        image_size: resize camera frames on the device to ``[height, width]`` (bilinear, antialiased) in every
            stage (default: as stored).
        augment: train-time camera augmentation on the device, off by default (:class:`ImageAugmentConfig` or a
            dict of its options).
    """

    label_key = None  # samples are frames and actions: no token labels to count

    def __init__(
        self,
        roots: str | list[str],
        *,
        weights: list[float] | None = None,
        delta_timestamps: dict[str, list[float]] | None = None,
        normalization: dict[str, str] | None = None,
        val_fraction: float = 0.0,
        num_train_samples: int | None = None,
        batch_size: int = 8,
        seed: int = 1234,
        num_workers: int = 2,
        pin_memory: bool = True,
        video_backend: str = "pyav",
        image_size: list[int] | None = None,
        augment: ImageAugmentConfig | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=pin_memory)
        self.config = LeRobotDataConfig(
            roots=[roots] if isinstance(roots, str) else list(roots),
            weights=weights,
            delta_timestamps=dict(delta_timestamps or {}),
            normalization=dict(normalization or {}),
            val_fraction=val_fraction,
            num_train_samples=num_train_samples,
            video_backend=video_backend,
            image_size=None if image_size is None else list(image_size),
            augment=ImageAugmentConfig() if augment is None else augment,
        )
        self.camera_keys: list[str] = []
        self.augmenter: ImageAugment | None = None
        self._augment_state: dict[str, Any] = {}

    def _open(self, root: str, episodes: list[int]) -> LeRobotDataset:
        return LeRobotDataset(
            root,
            episodes=episodes,
            delta_timestamps=self.config.delta_timestamps,
            normalization=self.config.normalization,
            video_backend=self.config.video_backend,
        )

    @override
    def setup(self, stage: str) -> None:
        if self.train_dataset is not None:
            return
        trains, vals = [], []
        for position, root in enumerate(self.config.roots):
            episodes = sorted(LeRobotMeta(root).episodes)
            train, val = split_episodes(episodes, self.config.val_fraction, seed=self.seed + position)
            trains.append(self._open(root, train))
            if val:
                vals.append(self._open(root, val))
        self.camera_keys = sorted({key for d in trains for key in d.meta.video_keys})
        self._setup_augment()
        self.train_dataset = self._mix(trains)
        self.val_dataset = ConcatDataset(vals) if vals else None
        rank_zero_info(
            f"lerobot data: {len(self.train_dataset)} train / "
            f"{0 if self.val_dataset is None else len(self.val_dataset)} val frames from "
            f"{len(self.config.roots)} dataset(s)"
        )

    def _mix(self, parts: list[LeRobotDataset]) -> Dataset:
        if len(parts) == 1 and self.config.num_train_samples is None:
            return parts[0]
        weights = self.config.weights or [float(len(p)) for p in parts]
        total = self.config.num_train_samples or sum(len(p) for p in parts)
        return BlendedDataset(parts, weights, total, seed=self.seed)

    def _setup_augment(self) -> None:
        augment = self.config.augment
        unknown = sorted(set(augment.cameras or ()) - set(self.camera_keys))
        if unknown:
            raise ValueError(f"augment.cameras {unknown} are not cameras of the datasets: {self.camera_keys}")
        if not augment.enable:
            return
        normalization = self.config.normalization
        normalized = [k for k in self.camera_keys if normalization.get(k, "identity") != "identity"]
        if normalized:
            raise ValueError(
                f"augment needs camera frames in [0, 1], but normalization maps {normalized}: leave cameras "
                "unnormalised (the model normalises them) or disable augment"
            )
        seed = self.seed if augment.seed is None else augment.seed  # one stream per data-parallel rank
        self.augmenter = ImageAugment(augment, seed=rank_seed(seed, self._dp()[1]))
        self.augmenter.load_state_dict(self._augment_state)

    def transform_cameras(self, batch: dict[str, Any], *, training: bool) -> dict[str, Any]:
        """Resizes the batch's camera frames to ``image_size`` and, when ``training``, augments them."""
        cameras = self.config.augment.cameras
        augmented = self.camera_keys if cameras is None else cameras
        for key in [k for k in self.camera_keys if k in batch]:
            if self.config.image_size is not None:
                batch[key] = resize_frames(batch[key], self.config.image_size)
            if training and self.augmenter is not None and key in augmented:
                batch[key] = self.augmenter(batch[key])
        return batch

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        batch = super().on_after_batch_transfer(batch, dataloader_idx)
        training = self.trainer is not None and self.trainer.training
        return self.transform_cameras(batch, training=training) if isinstance(batch, dict) else batch

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"augment": self.augmenter.state_dict()} if self.augmenter is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._augment_state = dict(state_dict.get("augment", {}))
        if self.augmenter is not None:
            self.augmenter.load_state_dict(self._augment_state)

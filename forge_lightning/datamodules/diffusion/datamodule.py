"""Training data of video diffusion: video-caption samples decoded online, or the frozen encoders' features read
from a cache of ``forge-data precompute``; either way in batches of one bucket."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset
from typing_extensions import override

from forge_lightning.datamodules.base import StepDataModule
from forge_lightning.datamodules.diffusion.dataset import video_caption_collate
from forge_lightning.datamodules.diffusion.loader import GroupedStepLoader
from forge_lightning.datamodules.diffusion.precompute import VideoCaptionConfig, load_precompute_config
from forge_lightning.datamodules.feature_cache import FeatureCacheDataset, cache_collate
from forge_lightning.datamodules.loader import StepLoader


class VideoDiffusionDataModule(StepDataModule):
    """Video-caption training batches: ``video [B, 3, F, H, W]`` in ``[-1, 1]`` and ``caption`` decoded online
    (``data``), or the cached features (``cache``: the stored outputs such as ``latents``, ``text_embeddings``,
    and the kept fields such as ``caption``). Each batch holds samples of one bucket.

    Args:
        data: the video-caption data; with ``cache``, the data the cache must have been computed from (checked by
            its fingerprint, which scans the videos' headers; leave it out to skip the check).
        cache: a feature cache directory written by ``forge-data precompute``.
        cache_config: the precompute YAML the cache was built with: its frozen modules must match the cache's
            (configs and weight files), else the cache is refused with the command that rebuilds it.
        batch_size: micro-batch per data-parallel rank.
        seed: seed of the per-epoch sample order.
        num_workers: DataLoader workers per rank.
        pin_memory: pin host memory (useful on CUDA).
    """

    label_key = None

    def __init__(
        self,
        data: VideoCaptionConfig | None = None,
        *,
        cache: str | None = None,
        cache_config: str | None = None,
        batch_size: int = 1,
        seed: int = 1234,
        num_workers: int = 2,
        pin_memory: bool = True,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=pin_memory)
        if data is None and cache is None:
            raise ValueError("give data (videos decoded online) or cache (features of forge-data precompute)")
        if (cache is None) != (cache_config is None):
            raise ValueError(
                "cache and cache_config go together: cache_config is the precompute YAML the cache was built with"
            )
        self.data = data
        self.cache = cache
        self.cache_config = cache_config

    @override
    def setup(self, stage: str) -> None:
        if self.train_dataset is not None:
            return
        online = None
        if self.data is not None:
            online, report = self.data.load()
            rank_zero_info(report.describe())
        if self.cache is None:
            self.train_dataset, self.collate_fn = online, video_caption_collate
            return
        assert self.cache_config is not None
        modules = load_precompute_config(self.cache_config).modules
        self.train_dataset = FeatureCacheDataset(self.cache, modules=modules, dataset=online)
        self.collate_fn = cache_collate

    @override
    def _make_train_loader(self, dataset: Dataset, **options: Any) -> StepLoader:
        return GroupedStepLoader(dataset, **options)

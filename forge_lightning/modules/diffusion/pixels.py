"""Pixel space as the latent space: for tiny models (the quick start) that train a DiT on the frames themselves."""

from __future__ import annotations

from torch import Tensor, nn


class PixelLatents(nn.Module):
    """The identity "VAE" of pixel-space diffusion: latents are the frames in ``[-1, 1]`` (3 channels, no temporal or
    spatial compression). A ``forge-data precompute`` target (``method: encode``, ``outputs: {latents: ""}``); pass
    ``compression=(1, 1)`` to :meth:`WanDiffusionModule.generate` for its latent sizes."""

    scale_factor_temporal = 1
    scale_factor_spatial = 1

    def encode(self, video_BCFHW: Tensor) -> Tensor:
        """The video ``[B, 3, F, H, W]`` clamped to ``[-1, 1]``."""
        if video_BCFHW.ndim != 5 or video_BCFHW.shape[1] != 3:
            raise ValueError(f"video must be [B, 3, F, H, W]; got {list(video_BCFHW.shape)}")
        return video_BCFHW.clamp(-1, 1)

    def decode(self, latents_BCFHW: Tensor) -> Tensor:
        """The latents are the video."""
        return latents_BCFHW.clamp(-1, 1)

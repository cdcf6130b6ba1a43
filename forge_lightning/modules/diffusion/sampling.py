"""Euler flow-matching sampling with classifier-free guidance, the schedule of diffusers'
``FlowMatchEulerDiscreteScheduler`` with Wan's shift.

::

    x = noise;  for sigma, sigma_next in schedule:
        v = v_uncond + g * (v_cond - v_uncond)        (v_cond alone without guidance)
        x = x + (sigma_next - sigma) * v              (fp32, cast back to the latents' dtype)
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from forge_lightning.modules.diffusion.flow_matching import per_token_timesteps


class Denoiser(Protocol):
    """The velocity model: ``(latents [B, C, F, H, W], timestep [B] or [B, tokens], text [B, L, D]) -> velocity``
    of the latents' shape. A Wan DiT wrapped in a small function fits."""

    def __call__(self, latents: Tensor, timestep: Tensor, text: Tensor) -> Tensor: ...


@dataclasses.dataclass(kw_only=True)
class VideoGenerationConfig:
    """What ``predict`` generates per prompt (the defaults are Wan 2.1 T2V's: 81 frames of 480 x 832).

    Args:
        num_frames: video frames (``1 + 4k`` for the Wan VAE).
        height: video height in pixels.
        width: video width in pixels.
        num_inference_steps: Euler steps.
        guidance_scale: classifier-free guidance scale (1: no guidance, one forward per step).
        shift: the schedule's shift (``None``: the module's ``flow_matching.shift``).
    """

    num_frames: int = 81
    height: int = 480
    width: int = 832
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    shift: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_frames", "height", "width", "num_inference_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be at least 1")
        if self.shift is not None and not self.shift > 0:
            raise ValueError(f"shift ({self.shift}) must be positive (1 disables the shift)")


def flow_match_sigmas(num_inference_steps: int, shift: float, num_train_timesteps: int = 1000) -> Tensor:
    """The ``num_inference_steps + 1`` noise levels (fp32, last one 0) that ``FlowMatchEulerDiscreteScheduler(shift=
    shift).set_timesteps(num_inference_steps)`` uses.

    Like diffusers, the end points are the shifted training range ``[shift(1), shift(1 / T)]``, spaced linearly,
    then shifted again.
    """
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps ({num_inference_steps}) must be at least 1")
    if not shift > 0:
        raise ValueError(f"shift ({shift}) must be positive (1 disables the shift)")
    # The training table in fp32 as diffusers builds it; its ends fix the inference range.
    train = torch.tensor([1.0, 1.0 / num_train_timesteps], dtype=torch.float32)
    train = shift * train / (1 + (shift - 1) * train)
    t = np.linspace(
        train[0].item() * num_train_timesteps, train[1].item() * num_train_timesteps, num_inference_steps
    )
    sigmas = t / num_train_timesteps
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return torch.cat([torch.from_numpy(sigmas).float(), torch.zeros(1)])


@torch.no_grad()
def sample_euler(
    denoiser: Denoiser,
    noise_BCFHW: Tensor,
    text_BLD: Tensor,
    *,
    num_inference_steps: int,
    shift: float,
    guidance_scale: float = 1.0,
    negative_text_BLD: Tensor | None = None,
    num_train_timesteps: int = 1000,
    condition_BCFHW: Tensor | None = None,
    patch_size: tuple[int, int, int] = (1, 2, 2),
) -> Tensor:
    """Generate latents from noise with the Euler flow-matching sampler.

    Args:
        denoiser: the velocity model.
        noise_BCFHW: the starting latents (pure noise).
        text_BLD: the prompt embeddings.
        num_inference_steps: number of Euler steps.
        shift: Wan's schedule shift (the model card gives it per model and resolution).
        guidance_scale: CFG scale ``g``; guidance runs when it is not 1.
        negative_text_BLD: the negative / empty prompt's embeddings; required when ``guidance_scale != 1``.
        num_train_timesteps: the DiT's timestep is ``sigma * num_train_timesteps``.
        condition_BCFHW: Wan 2.2 TI2V image-to-video: normalised latents whose first frame is kept fixed
            (per-token timesteps 0 there), as ``WanImageToVideoPipeline`` with ``expand_timesteps``.
        patch_size: the DiT's patch size, for per-token timesteps.

    Returns:
        The final latents, in ``noise_BCFHW``'s dtype.
    """
    guided = guidance_scale != 1.0
    if guided and negative_text_BLD is None:
        raise ValueError(
            f"guidance_scale ({guidance_scale}) needs negative_text_BLD (the empty prompt's embeddings)"
        )
    sigmas = flow_match_sigmas(num_inference_steps, shift, num_train_timesteps).to(noise_BCFHW.device)
    latents = noise_BCFHW
    mask = None
    if condition_BCFHW is not None:
        mask = torch.ones_like(latents[:, :1])
        mask[:, :, 0] = 0
        condition_BCFHW = condition_BCFHW.to(latents.dtype)
    B = latents.shape[0]
    for i in range(num_inference_steps):
        t = sigmas[i] * num_train_timesteps
        x = latents if mask is None else (1 - mask) * condition_BCFHW + mask * latents
        timestep = t.expand(B) if mask is None else per_token_timesteps(t.expand(B), mask, patch_size)
        v = denoiser(x, timestep, text_BLD)
        if guided:
            v_uncond = denoiser(x, timestep, negative_text_BLD)
            v = v_uncond + guidance_scale * (v - v_uncond)
        latents = (latents.float() + (sigmas[i + 1] - sigmas[i]) * v.float()).to(v.dtype)
    if mask is not None:
        latents = (1 - mask) * condition_BCFHW + mask * latents
    return latents.to(noise_BCFHW.dtype)

"""Rectified-flow training targets as Wan trains (Wan team, 2025; Esser et al., 2024, "SD3").

A clean latent ``x0`` and Gaussian noise ``eps`` are mixed at a noise level ``sigma`` in ``[0, 1]``::

    x_t = (1 - sigma) * x0 + sigma * eps          the DiT sees x_t and timestep = sigma * 1000
    v   = eps - x0                                the velocity it must predict

``sigma`` is drawn per sample (uniform, logit-normal or SD3's "mode" density), then shifted towards noise by Wan's
``shift``. For Wan 2.2 TI2V image-to-video the first latent frame stays clean: its tokens get timestep 0 and no
loss (:func:`first_frame_mask`, :func:`per_token_timesteps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

TIMESTEP_SAMPLINGS = ("uniform", "logit_normal", "mode")
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


@dataclass(kw_only=True)
class FlowMatchingConfig:
    """How training noise levels are drawn and the loss weighted.

    Args:
        timestep_sampling: density of ``u`` in ``[0, 1]`` before the shift: ``uniform``, ``logit_normal``
            (``sigmoid(N(logit_mean, logit_std))``) or ``mode`` (SD3's mode sampling with ``mode_scale``).
        shift: Wan's shift ``sigma = shift * u / (1 + (shift - 1) * u)``; 1 keeps ``u``, larger values favour
            noisier levels.
        logit_mean: mean of the logit-normal density.
        logit_std: standard deviation of the logit-normal density.
        mode_scale: scale of the mode density (SD3 uses 1.29); within ``[-1, 2/(pi-2)]`` it stays in ``[0, 1]``.
        loss_weighting: per-sample weight of the loss: ``none``, ``sigma_sqrt`` (``sigma**-2``) or ``cosmap``.
        num_train_timesteps: the DiT's timestep is ``sigma * num_train_timesteps``.
        text_dropout: probability of replacing a sample's text embedding by the empty prompt's (for CFG).
    """

    timestep_sampling: str = "uniform"
    shift: float = 5.0
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    loss_weighting: str = "none"
    num_train_timesteps: int = 1000
    text_dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.timestep_sampling not in TIMESTEP_SAMPLINGS:
            raise ValueError(
                f"timestep_sampling ({self.timestep_sampling!r}) must be one of {', '.join(TIMESTEP_SAMPLINGS)}"
            )
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(
                f"loss_weighting ({self.loss_weighting!r}) must be one of {', '.join(LOSS_WEIGHTINGS)}"
            )
        if not self.shift > 0:
            raise ValueError(f"shift ({self.shift}) must be positive (1 disables the shift)")
        if not self.logit_std > 0:
            raise ValueError(f"logit_std ({self.logit_std}) must be positive")
        mode_max = 2 / (math.pi - 2)
        if not -1 <= self.mode_scale <= mode_max:
            raise ValueError(
                f"mode_scale ({self.mode_scale}) must be within [-1, {mode_max:.4f}] for the mode density to stay "
                "in [0, 1]"
            )
        if self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps ({self.num_train_timesteps}) must be at least 1")
        if not 0 <= self.text_dropout < 1:
            raise ValueError(f"text_dropout ({self.text_dropout}) must be in [0, 1)")


def shift_sigmas(sigma: Tensor, shift: float) -> Tensor:
    """Wan's (and diffusers' ``FlowMatchEulerDiscreteScheduler``'s) static shift of noise levels."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def sample_u(
    config: FlowMatchingConfig, batch_size: int, *, generator: torch.Generator | None = None, device=None
) -> Tensor:
    """Unshifted levels ``u`` ``[B]`` (fp32) from the config's density; the same draws as diffusers'
    ``compute_density_for_timestep_sampling`` for the same generator."""
    if config.timestep_sampling == "logit_normal":
        z = torch.normal(
            config.logit_mean, config.logit_std, (batch_size,), generator=generator, device=device
        )
        return torch.sigmoid(z)
    u = torch.rand((batch_size,), generator=generator, device=device)
    if config.timestep_sampling == "mode":
        u = 1 - u - config.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def sample_sigmas(
    config: FlowMatchingConfig, batch_size: int, *, generator: torch.Generator | None = None, device=None
) -> Tensor:
    """Training noise levels ``sigma`` ``[B]`` (fp32): :func:`sample_u` then the shift."""
    return shift_sigmas(sample_u(config, batch_size, generator=generator, device=device), config.shift)


def loss_weights(config: FlowMatchingConfig, sigma_B: Tensor) -> Tensor:
    """Per-sample loss weights ``[B]``, as diffusers' ``compute_loss_weighting_for_sd3``."""
    if config.loss_weighting == "sigma_sqrt":
        return sigma_B.float() ** -2.0
    if config.loss_weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma_B + 2 * sigma_B**2))
    return torch.ones_like(sigma_B)


def _per_sample(sigma_B: Tensor, like: Tensor) -> Tensor:
    return sigma_B.to(like.dtype).view(-1, *([1] * (like.ndim - 1)))


def add_noise(x0: Tensor, noise: Tensor, sigma_B: Tensor) -> Tensor:
    """``x_t = (1 - sigma) x0 + sigma eps`` with one ``sigma`` per sample."""
    sigma = _per_sample(sigma_B, x0)
    return (1 - sigma) * x0 + sigma * noise


def velocity_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The rectified-flow velocity ``eps - x0`` (``d x_t / d sigma``)."""
    return noise - x0


def dit_timesteps(sigma: Tensor, num_train_timesteps: int = 1000) -> Tensor:
    """The timestep value the Wan DiT takes: ``sigma * num_train_timesteps`` (as the Wan pipelines pass it)."""
    return sigma * num_train_timesteps


def drop_text(
    text_BLD: Tensor, empty_LD: Tensor, p: float, *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Replace each sample's text embedding by the empty prompt's with probability ``p`` (classifier-free guidance
    training). Returns the embeddings and the ``[B]`` bool mask of dropped samples.

    Args:
        text_BLD: text embeddings ``[B, L, D]``.
        empty_LD: the empty prompt's embedding ``[L, D]`` (or ``[1, L, D]``).
        p: drop probability.
        generator: seeds the draw (one uniform per sample, on the generator's device).
    """
    if empty_LD.shape[-2:] != text_BLD.shape[-2:]:
        raise ValueError(
            f"the empty prompt's embedding {tuple(empty_LD.shape)} does not match the text embeddings' "
            f"[L, D] {tuple(text_BLD.shape[-2:])}; encode it with the same text encoder and max length"
        )
    device = generator.device if generator is not None else text_BLD.device
    dropped_B = (torch.rand((text_BLD.shape[0],), generator=generator, device=device) < p).to(text_BLD.device)
    empty = empty_LD.reshape(1, *text_BLD.shape[-2:]).to(text_BLD.dtype)
    return torch.where(dropped_B.view(-1, 1, 1), empty, text_BLD), dropped_B


def first_frame_mask(latents_BCFHW: Tensor) -> Tensor:
    """Wan 2.2 TI2V's mask ``[B, 1, F, H, W]``: 0 on the first latent frame (kept clean), 1 elsewhere; as
    ``WanImageToVideoPipeline.prepare_latents`` builds it with ``expand_timesteps``."""
    B, _, F, H, W = latents_BCFHW.shape
    mask = torch.ones(B, 1, F, H, W, dtype=latents_BCFHW.dtype, device=latents_BCFHW.device)
    mask[:, :, 0] = 0
    return mask


def per_token_timesteps(timestep_B: Tensor, mask_B1FHW: Tensor, patch_size: tuple[int, int, int]) -> Tensor:
    """Per-token DiT timesteps ``[B, F/pt * H/ph * W/pw]``: the mask at each patch's first element times the
    sample's timestep, flattened in the DiT's (frame, height, width) token order, as the Wan pipelines do with
    ``expand_timesteps``.

    Args:
        timestep_B: each sample's timestep (``sigma * 1000``).
        mask_B1FHW: 0 where latents are kept clean, 1 where they are noised.
        patch_size: the DiT's ``(pt, ph, pw)`` patch size.
    """
    pt, ph, pw = patch_size
    mask_BFHW = mask_B1FHW[:, 0, ::pt, ::ph, ::pw]
    return (mask_BFHW * timestep_B.to(mask_BFHW.dtype).view(-1, 1, 1, 1)).flatten(1)


@dataclass
class FlowMatchingSample:
    """One training batch's noised inputs and targets (see :meth:`FlowMatching.prepare`)."""

    x_t: Tensor  # [B, C, F, H, W] the DiT's input
    target: Tensor  # [B, C, F, H, W] velocity eps - x0
    sigma: Tensor  # [B]
    timestep: Tensor  # [B] or [B, tokens] (per-token, TI2V)
    weight: Tensor  # [B] loss weights
    loss_mask: Tensor | None  # [B, 1, F, H, W] 1 where the loss counts; None: everywhere


class FlowMatching:
    """Draws noise levels and noise, builds the DiT inputs and the weighted velocity loss.

    Args:
        config: the flow-matching settings.
    """

    def __init__(self, config: FlowMatchingConfig) -> None:
        self.config = config

    def prepare(
        self,
        x0_BCFHW: Tensor,
        *,
        generator: torch.Generator | None = None,
        clean_first_frame: bool = False,
        patch_size: tuple[int, int, int] = (1, 2, 2),
    ) -> FlowMatchingSample:
        """Noise a batch of clean latents.

        Args:
            x0_BCFHW: normalised clean latents.
            generator: seeds sigma and noise (drawn on its device, then moved to the latents').
            clean_first_frame: Wan 2.2 TI2V image-to-video: keep the first latent frame clean, per-token timesteps
                (0 there), no loss there.
            patch_size: the DiT's patch size, for per-token timesteps.
        """
        device = generator.device if generator is not None else x0_BCFHW.device
        B = x0_BCFHW.shape[0]
        sigma_B = sample_sigmas(self.config, B, generator=generator, device=device).to(x0_BCFHW.device)
        noise = torch.randn(x0_BCFHW.shape, generator=generator, device=device, dtype=torch.float32)
        noise = noise.to(x0_BCFHW.device, x0_BCFHW.dtype)
        x_t = add_noise(x0_BCFHW, noise, sigma_B)
        timestep = dit_timesteps(sigma_B, self.config.num_train_timesteps)
        loss_mask = None
        if clean_first_frame:
            loss_mask = first_frame_mask(x0_BCFHW)
            x_t = (1 - loss_mask) * x0_BCFHW + loss_mask * x_t
            timestep = per_token_timesteps(timestep, loss_mask, patch_size)
        weight = loss_weights(self.config, sigma_B)
        return FlowMatchingSample(x_t, velocity_target(x0_BCFHW, noise), sigma_B, timestep, weight, loss_mask)

    def loss(self, pred_BCFHW: Tensor, sample: FlowMatchingSample) -> Tensor:
        """Per-sample weighted mean squared velocity error ``[B]`` (fp32) over the elements the loss counts."""
        err = (pred_BCFHW.float() - sample.target.float()) ** 2
        if sample.loss_mask is None:
            per_sample = err.flatten(1).mean(1)
        else:
            mask = sample.loss_mask.float().expand_as(err)
            per_sample = (err * mask).flatten(1).sum(1) / mask.flatten(1).sum(1).clamp_min(1)
        return per_sample * sample.weight.float()

    def drop_text(
        self, text_BLD: Tensor, empty_LD: Tensor, *, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """:func:`drop_text` with the config's ``text_dropout``."""
        return drop_text(text_BLD, empty_LD, self.config.text_dropout, generator=generator)

"""The frozen encoders of Wan video diffusion: the Wan VAE (diffusers' ``AutoencoderKLWan``), the UMT5 text
encoder (transformers' ``UMT5EncoderModel``) and, for Wan 2.1 image-to-video, the CLIP image encoder (transformers'
``CLIPVisionModel``), loaded from a user's Hugging Face-format directories.

Both wrappers stay in eval mode with gradients off (``.train()`` keeps them in eval) and compute what the Wan
pipelines compute::

    video [B, 3, F, H, W] in [-1, 1] ── AutoencoderKLWan.encode ── (mode - latents_mean) / latents_std ── latents
    latents ── * latents_std + latents_mean ── AutoencoderKLWan.decode ── video in [-1, 1]
    prompts ── clean ── tokenize (pad / truncate to 512) ── UMT5 ── zeros after each prompt's tokens ── [B, 512, D]
    first frame [B, 3, H, W] ── CLIPImageProcessor ── CLIPVisionModel ── penultimate hidden states ── [B, N, E]
    first frame, zeros for frames 1.. ── VAE encode, normalise ── [first-frame mask (4), condition latents (C)]
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

WAN_TEXT_MAX_LENGTH = 512


def _component_dir(path: str | Path, subfolder: str, what: str) -> Path:
    """``path`` itself when it holds a ``config.json``, else its ``subfolder`` (a Wan diffusers checkpoint's root)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{what} directory {path} does not exist")
    if (path / "config.json").is_file():
        return path
    if (path / subfolder / "config.json").is_file():
        return path / subfolder
    raise FileNotFoundError(
        f"no config.json in {path} nor in {path / subfolder}: pass the {what} folder (the `{subfolder}` folder of a "
        "Wan diffusers checkpoint) or the checkpoint's root"
    )


def _read_config(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{directory / 'config.json'} is not valid JSON: {e}") from e


class _Frozen(nn.Module):
    """A module that stays in eval mode with gradients off."""

    def freeze(self) -> None:
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> _Frozen:
        return super().train(False)


class WanVAE(_Frozen):
    """The frozen Wan VAE with the Wan pipelines' latent normalisation.

    Wan 2.1's VAE has 16 latent channels (8x spatial, 4x temporal compression); Wan 2.2's TI2V VAE has 48 (16x
    spatial via a 2x2 patchify, 4x temporal). Frames must number ``1 + 4k``.

    Args:
        vae: a diffusers ``AutoencoderKLWan``.
    """

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae
        config = vae.config
        z_dim = config.z_dim
        for key in ("latents_mean", "latents_std"):
            if len(config[key]) != z_dim:
                raise ValueError(
                    f"the VAE config's {key} has {len(config[key])} entries, not z_dim ({z_dim})"
                )
        self.register_buffer("latents_mean", torch.tensor(config.latents_mean).view(1, z_dim, 1, 1, 1), False)
        # the pipelines multiply by 1 / std (and divide by it to undo), which rounds differently from dividing
        self.register_buffer(
            "inv_latents_std", 1.0 / torch.tensor(config.latents_std).view(1, z_dim, 1, 1, 1), False
        )
        self.freeze()

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, z_dim: int | None = None
    ) -> WanVAE:
        """Load an ``AutoencoderKLWan`` from ``path`` (its folder, or a Wan diffusers checkpoint's root with a
        ``vae/`` folder).

        Args:
            path: the directory.
            dtype: the VAE's parameter dtype (the Wan pipelines use fp32).
            z_dim: the expected number of latent channels (16 for Wan 2.1, 48 for Wan 2.2 TI2V); None accepts any.
        """
        from diffusers import AutoencoderKLWan

        directory = _component_dir(path, "vae", "Wan VAE")
        config = _read_config(directory)
        if config.get("_class_name") != "AutoencoderKLWan":
            raise ValueError(
                f"{directory / 'config.json'} describes a {config.get('_class_name')!r}, not an AutoencoderKLWan; "
                "pass the `vae` folder of a Wan diffusers checkpoint"
            )
        if z_dim is not None and config.get("z_dim") != z_dim:
            raise ValueError(
                f"the VAE in {directory} has z_dim {config.get('z_dim')}, expected {z_dim} (Wan 2.1: 16, Wan 2.2 "
                "TI2V: 48); check that the VAE matches the DiT"
            )
        return cls(AutoencoderKLWan.from_pretrained(directory, torch_dtype=dtype))

    @property
    def z_dim(self) -> int:
        return self.vae.config.z_dim

    @property
    def scale_factor_temporal(self) -> int:
        return self.vae.config.scale_factor_temporal

    @property
    def scale_factor_spatial(self) -> int:
        return self.vae.config.scale_factor_spatial

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    def _check_video(self, video: Tensor) -> None:
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"video must be [B, 3, F, H, W] in [-1, 1], got shape {tuple(video.shape)}")
        F, H, W = video.shape[2:]
        t, s = self.scale_factor_temporal, self.scale_factor_spatial
        if (F - 1) % t or H % s or W % s:
            raise ValueError(
                f"video of {F} frames of {H}x{W}: the Wan VAE needs 1 + {t}k frames and height / width divisible "
                f"by {s}"
            )

    @torch.no_grad()
    def encode(
        self, video_BCFHW: Tensor, *, sample: bool = False, generator: torch.Generator | None = None
    ) -> Tensor:
        """Normalised latents ``[B, z_dim, 1 + (F - 1) / 4, H / s, W / s]`` (fp32) of a video in ``[-1, 1]``.

        Args:
            video_BCFHW: RGB video.
            sample: draw from the posterior instead of taking its mode (the pipelines take the mode).
            generator: seeds the draw.
        """
        self._check_video(video_BCFHW)
        posterior = self.vae.encode(video_BCFHW.to(self.latents_mean.device, self.dtype)).latent_dist
        latents = posterior.sample(generator) if sample else posterior.mode()
        return (latents.float() - self.latents_mean) * self.inv_latents_std

    @torch.no_grad()
    def image_condition(self, image_B3HW: Tensor, num_frames: int) -> Tensor:
        """Wan 2.1 I2V's condition ``[B, t + z_dim, f, H / s, W / s]`` (fp32; ``t`` = the temporal factor, 4) of
        a first frame in ``[-1, 1]`` for a video of ``num_frames`` frames, as ``WanImageToVideoPipeline.
        prepare_latents`` builds it: the first-frame mask (:func:`first_frame_condition_mask`) and the normalised
        latents of the video ``[image, zeros, ...]``.

        Args:
            image_B3HW: the first frames.
            num_frames: the video's frame count (``1 + 4k``).
        """
        if image_B3HW.ndim != 4 or image_B3HW.shape[1] != 3:
            raise ValueError(f"image must be [B, 3, H, W] in [-1, 1], got shape {tuple(image_B3HW.shape)}")
        B, _, H, W = image_B3HW.shape
        video_B3FHW = torch.cat(
            [image_B3HW[:, :, None], image_B3HW.new_zeros(B, 3, num_frames - 1, H, W)], dim=2
        )
        latents = self.encode(video_B3FHW)
        mask = first_frame_condition_mask(latents, self.scale_factor_temporal)
        return torch.cat([mask, latents], dim=1)

    def video_condition(self, video_BCFHW: Tensor) -> Tensor:
        """:meth:`image_condition` of a training video's first frame (for the feature cache and online batches)."""
        self._check_video(video_BCFHW)
        return self.image_condition(video_BCFHW[:, :, 0], video_BCFHW.shape[2])

    @torch.no_grad()
    def decode(self, latents_BCFHW: Tensor) -> Tensor:
        """The video ``[B, 3, F, H, W]`` in ``[-1, 1]`` (fp32) of normalised latents."""
        if latents_BCFHW.ndim != 5 or latents_BCFHW.shape[1] != self.z_dim:
            raise ValueError(
                f"latents must be [B, {self.z_dim}, F, H, W], got shape {tuple(latents_BCFHW.shape)}"
            )
        latents = (
            latents_BCFHW.to(self.latents_mean.device).float() / self.inv_latents_std + self.latents_mean
        )
        return self.vae.decode(latents.to(self.dtype), return_dict=False)[0].float()


def first_frame_condition_mask(latents_BCFHW: Tensor, scale_factor_temporal: int) -> Tensor:
    """Wan 2.1 I2V's first-frame mask ``[B, t, f, h, w]`` (``t = scale_factor_temporal``) for latents of ``f``
    frames: a per-video-frame mask (1 on frame 0, 0 on frames 1 .. 4 (f - 1)) with frame 0 repeated ``t`` times,
    then folded into ``t`` channels, so latent frame 0 is all ones and the others zeros."""
    B, _, f, h, w = latents_BCFHW.shape
    t = scale_factor_temporal
    mask_B1Vhw = latents_BCFHW.new_zeros(
        B, 1, t * f, h, w
    )  # V = t + t (f - 1) video frames, frame 0 repeated
    mask_B1Vhw[:, :, :t] = 1
    return mask_B1Vhw.view(B, f, t, h, w).transpose(1, 2)


def clean_prompt(text: str) -> str:
    """The Wan pipelines' prompt cleaning: ftfy's fixes when ftfy is installed, HTML entities unescaped (twice),
    runs of whitespace collapsed, ends stripped."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class WanTextEncoder(_Frozen):
    """The frozen UMT5 text encoder and its tokenizer, as the Wan pipelines encode prompts.

    Args:
        encoder: a transformers ``UMT5EncoderModel``.
        tokenizer: its tokenizer.
        max_length: prompts are padded / truncated to this many tokens (Wan: 512); embeddings after each prompt's
            real tokens are zeros.
    """

    def __init__(self, encoder: nn.Module, tokenizer: Any, *, max_length: int = WAN_TEXT_MAX_LENGTH) -> None:
        super().__init__()
        if max_length < 1:
            raise ValueError(f"max_length ({max_length}) must be at least 1")
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer has no pad token; the Wan text encoder pads prompts to max_length"
            )
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.freeze()

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.bfloat16, max_length: int = WAN_TEXT_MAX_LENGTH
    ) -> WanTextEncoder:
        """Load ``UMT5EncoderModel`` and its tokenizer from ``path``: a Wan diffusers checkpoint's root (with
        ``text_encoder/`` and ``tokenizer/``) or one folder holding both.

        Args:
            path: the directory.
            dtype: the encoder's parameter dtype (the Wan pipelines use bf16).
            max_length: padded prompt length.
        """
        from transformers import AutoTokenizer, UMT5EncoderModel

        directory = _component_dir(path, "text_encoder", "Wan text encoder")
        config = _read_config(directory)
        if config.get("model_type") != "umt5":
            raise ValueError(
                f"{directory / 'config.json'} describes model_type {config.get('model_type')!r}, not 'umt5'; pass "
                "the `text_encoder` folder of a Wan diffusers checkpoint"
            )
        tokenizer_dir = Path(path) / "tokenizer"
        if not tokenizer_dir.is_dir():
            tokenizer_dir = directory
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(
                f"no tokenizer in {tokenizer_dir}: put the UMT5 tokenizer in a `tokenizer` folder beside "
                f"`text_encoder` or in the encoder's folder ({e})"
            ) from e
        encoder = UMT5EncoderModel.from_pretrained(directory, dtype=dtype)
        return cls(encoder, tokenizer, max_length=max_length)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.encoder.parameters()).dtype

    @torch.no_grad()
    def encode(self, prompts: str | list[str]) -> Tensor:
        """Prompt embeddings ``[B, max_length, D]`` in the encoder's dtype, zeros after each prompt's tokens."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        tokens = self.tokenizer(
            [clean_prompt(p) for p in prompts],
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        device = next(self.encoder.parameters()).device
        mask_BL = tokens.attention_mask.to(device)
        hidden_BLD = self.encoder(tokens.input_ids.to(device), mask_BL).last_hidden_state
        # the pipelines keep each prompt's first len tokens and zero the rest
        lengths_B = mask_BL.gt(0).sum(1)
        keep_BL = torch.arange(hidden_BLD.shape[1], device=device)[None] < lengths_B[:, None]
        return torch.where(
            keep_BL[..., None], hidden_BLD, torch.zeros((), dtype=hidden_BLD.dtype, device=device)
        )

    def forward(self, prompts: str | list[str]) -> Tensor:
        return self.encode(prompts)


class WanImageEncoder(_Frozen):
    """The frozen CLIP image encoder of Wan 2.1 I2V: ``CLIPImageProcessor`` then ``CLIPVisionModel``, whose
    penultimate hidden states ``[B, N, E]`` (Wan 2.1 I2V: 257 tokens of 1280) the DiT's image branch reads, as
    ``WanImageToVideoPipeline.encode_image``.

    Args:
        encoder: a transformers ``CLIPVisionModel``.
        processor: its ``CLIPImageProcessor``.
    """

    def __init__(self, encoder: nn.Module, processor: Any) -> None:
        super().__init__()
        self.encoder = encoder
        self.processor = processor
        self.freeze()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32) -> WanImageEncoder:
        """Load ``CLIPVisionModel`` and ``CLIPImageProcessor`` from ``path``: a Wan I2V diffusers checkpoint's
        root (with ``image_encoder/`` and ``image_processor/``) or one folder holding both.

        Args:
            path: the directory.
            dtype: the encoder's parameter dtype (the Wan I2V pipelines use fp32).
        """
        from transformers import CLIPImageProcessor, CLIPVisionModel

        directory = _component_dir(path, "image_encoder", "Wan image encoder")
        config = _read_config(directory)
        if config.get("model_type") not in ("clip_vision_model", "clip"):
            raise ValueError(
                f"{directory / 'config.json'} describes model_type {config.get('model_type')!r}, not "
                "'clip_vision_model'; pass the `image_encoder` folder of a Wan I2V diffusers checkpoint"
            )
        processor_dir = Path(path) / "image_processor"
        if not (processor_dir / "preprocessor_config.json").is_file():
            processor_dir = directory
        if not (processor_dir / "preprocessor_config.json").is_file():
            raise FileNotFoundError(
                f"no preprocessor_config.json in {processor_dir}: put the CLIPImageProcessor in an "
                "`image_processor` folder beside `image_encoder` or in the encoder's folder"
            )
        processor = CLIPImageProcessor.from_pretrained(processor_dir)
        return cls(CLIPVisionModel.from_pretrained(directory, dtype=dtype), processor)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.encoder.parameters()).dtype

    @torch.no_grad()
    def encode(self, images: Tensor | Any) -> Tensor:
        """Image embeddings ``[B, N, E]`` (the penultimate hidden states) of images: a tensor ``[B, 3, H, W]`` in
        ``[-1, 1]`` (rounded to 8-bit RGB, what a decoded frame or a PIL image holds), or what the processor
        takes (PIL images)."""
        if isinstance(images, Tensor):
            if images.ndim != 4 or images.shape[1] != 3:
                raise ValueError(f"images must be [B, 3, H, W] in [-1, 1], got shape {tuple(images.shape)}")
            rgb_BHW3 = ((images.float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
            images = list(rgb_BHW3.permute(0, 2, 3, 1).numpy())
        device = next(self.encoder.parameters()).device
        pixels = self.processor(images=images, return_tensors="pt").pixel_values
        out = self.encoder(pixel_values=pixels.to(device, self.dtype), output_hidden_states=True)
        return out.hidden_states[-2]

    def encode_first_frame(self, video_BCFHW: Tensor) -> Tensor:
        """:meth:`encode` of each video's first frame (for the feature cache and online batches)."""
        if video_BCFHW.ndim != 5 or video_BCFHW.shape[1] != 3:
            raise ValueError(
                f"video must be [B, 3, F, H, W] in [-1, 1], got shape {tuple(video_BCFHW.shape)}"
            )
        return self.encode(video_BCFHW[:, :, 0])

    def forward(self, images: Tensor | Any) -> Tensor:
        return self.encode(images)

"""Wan DiT configuration and its diffusers ``config.json`` mapping (``WanTransformer3DModel``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forge_lightning.modules.layers.attention import check_attention_backend

DIFFUSERS_CLASS = "WanTransformer3DModel"

# Our field -> the diffusers config key; the others are named alike.
_RENAMED = {"num_heads": "num_attention_heads", "head_dim": "attention_head_dim"}
# Ours only: how the model runs, not what it computes, so never written to config.json.
_RUNTIME_FIELDS = ("attention_backend",)
# diffusers' bookkeeping keys, ignored on read.
_BOOKKEEPING = ("_class_name", "_diffusers_version", "_name_or_path", "_use_default_values")
QK_NORMS = ("rms_norm_across_heads",)


@dataclass(kw_only=True)
class WanDiTConfig:
    """A Wan 2.1 / 2.2 video DiT (T2V, I2V with the image branch, TI2V with per-token timesteps).

    Field meanings follow diffusers' ``WanTransformer3DModel``; ``num_heads`` / ``head_dim`` are its
    ``num_attention_heads`` / ``attention_head_dim``.

    Args:
        patch_size: ``(t, h, w)`` of the Conv3d patch embedding.
        num_heads: attention heads; the width is ``num_heads * head_dim``.
        head_dim: size of one head; RoPE gives ``2 * (head_dim // 6)`` channels each to height and width and the
            rest to frames.
        in_channels: latent channels in.
        out_channels: latent channels out (``None``: ``in_channels``).
        text_dim: width of the text encoder's embeddings (umT5: 4096).
        freq_dim: size of the sinusoidal timestep embedding.
        ffn_dim: hidden size of each block's feed-forward layer.
        num_layers: transformer blocks.
        cross_attn_norm: affine LayerNorm before the cross-attention.
        qk_norm: ``rms_norm_across_heads`` (RMSNorm over all heads of q and k, before they are split into heads).
        eps: epsilon of the blocks' norms.
        image_dim: width of the image encoder's embeddings (CLIP: 1280) for I2V; ``None``: no image branch.
        added_kv_proj_dim: input width of the cross-attention's image key / value projections (the model width in
            Wan 2.1 I2V); set together with ``image_dim``.
        rope_max_seq_len: positions per axis RoPE covers (frames, height and width patches).
        pos_embed_seq_len: learned position embedding of the image tokens (FLF2V: two images); ``None``: none.
        attention_backend: self-attention kernel of packed sequences (see
            :data:`~forge_lightning.modules.layers.ATTENTION_BACKENDS`); not part of ``config.json``.
    """

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_heads: int = 40
    head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(
                f"patch_size ({self.patch_size}) must be three positive sizes (frames, height, width)"
            )
        if self.out_channels is None:
            self.out_channels = self.in_channels
        if self.head_dim % 2 or self.head_dim // 6 == 0:
            raise ValueError(
                f"head_dim ({self.head_dim}) must be even and at least 6 (RoPE splits it in 3 axes)"
            )
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm ({self.qk_norm!r}) must be one of {QK_NORMS}: the only norm Wan uses")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError(
                f"image_dim ({self.image_dim}) and added_kv_proj_dim ({self.added_kv_proj_dim}) come together: set "
                "both for an I2V model (image branch), neither for T2V / TI2V"
            )
        if self.pos_embed_seq_len is not None and self.image_dim is None:
            raise ValueError(
                f"pos_embed_seq_len ({self.pos_embed_seq_len}) needs the image branch (image_dim)"
            )
        check_attention_backend(self.attention_backend)

    @property
    def dim(self) -> int:
        """Model width."""
        return self.num_heads * self.head_dim

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """Head channels RoPE rotates by the frame, row and column index (Wan's split)."""
        spatial = 2 * (self.head_dim // 6)
        return self.head_dim - 2 * spatial, spatial, spatial

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any], **overrides: Any) -> WanDiTConfig:
        """Read a diffusers ``WanTransformer3DModel`` ``config.json`` dict.

        Args:
            config: the dict.
            overrides: fields of ours to set besides (``attention_backend``).

        Raises:
            ValueError: another class, or keys this model does not know (named).
        """
        name = config.get("_class_name", DIFFUSERS_CLASS)
        if name != DIFFUSERS_CLASS:
            raise ValueError(f"config.json describes a {name}, not a {DIFFUSERS_CLASS}")
        known = {_RENAMED.get(f.name, f.name): f.name for f in dataclasses.fields(cls)}
        for runtime in _RUNTIME_FIELDS:
            known.pop(runtime)
        unknown = sorted(k for k in config if k not in known and k not in _BOOKKEEPING)
        if unknown:
            raise ValueError(f"config.json has keys a Wan DiT does not know: {unknown}")
        values = {known[k]: v for k, v in config.items() if k in known}
        if "patch_size" in values:
            values["patch_size"] = tuple(values["patch_size"])
        return cls(**values, **overrides)

    def to_diffusers(self) -> dict[str, Any]:
        """The diffusers ``config.json`` dict (with ``_class_name``)."""
        out: dict[str, Any] = {"_class_name": DIFFUSERS_CLASS}
        for f in dataclasses.fields(self):
            if f.name in _RUNTIME_FIELDS:
                continue
            value = getattr(self, f.name)
            out[_RENAMED.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
        return out


PRESETS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/Wan-AI/Wan2.1-T2V-1.3B-Diffusers/blob/main/transformer/config.json
    "wan2.1-t2v-1.3b": {"num_heads": 12, "head_dim": 128, "ffn_dim": 8960, "num_layers": 30},
    # https://huggingface.co/Wan-AI/Wan2.1-I2V-14B-480P-Diffusers/blob/main/transformer/config.json
    "wan2.1-i2v-14b": {
        "num_heads": 40,
        "head_dim": 128,
        "in_channels": 36,
        "ffn_dim": 13824,
        "num_layers": 40,
        "image_dim": 1280,
        "added_kv_proj_dim": 5120,
    },
    # https://huggingface.co/Wan-AI/Wan2.2-TI2V-5B-Diffusers/blob/main/transformer/config.json
    "wan2.2-ti2v-5b": {
        "num_heads": 24,
        "head_dim": 128,
        "in_channels": 48,
        "out_channels": 48,
        "ffn_dim": 14336,
        "num_layers": 30,
    },
    "debug": {"num_heads": 2, "head_dim": 12, "text_dim": 16, "freq_dim": 16, "ffn_dim": 32, "num_layers": 2},
}
"""Named configurations (fields of :class:`WanDiTConfig`)."""


def preset(name: str, **overrides: Any) -> WanDiTConfig:
    """The :data:`PRESETS` entry ``name`` with ``overrides``.

    Raises:
        KeyError: an unknown name (the known ones are listed).
    """
    if name not in PRESETS:
        raise KeyError(f"no Wan DiT preset {name!r}; known: {', '.join(PRESETS)}")
    return WanDiTConfig(**{**PRESETS[name], **overrides})

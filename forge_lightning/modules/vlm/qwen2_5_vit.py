"""The Qwen2.5-VL vision encoder (Qwen team 2025, arXiv:2502.13923): a ViT over native-resolution patch grids with
window attention, 2-D RoPE and a patch merger into the language model's width. Its configuration and weight mapping
live here too.

::

    pixel_values [N, C*T*P*P], grid_thw [n, 3]
      ─ patch_embed (one C x T x P x P patch per row) ─ [N, hidden] ─ reorder into windows
      ─ [VisionBlock] x num_layers:  x + attn(norm1(x)); x + mlp(norm2(x))     (2-D RoPE on queries and keys)
      ─ merger: ln_q ─ view [N/m², m²·hidden] ─ Linear ─ GELU ─ Linear ─ back to input order
      ─ [N/m², out_hidden_size]                                               (m = spatial_merge_size)

Attention never crosses a frame: the blocks at ``full_attention_layers`` attend within each frame (an image, or
one temporal patch of a video), the others within windows of ``window_size`` pixels. Both are segments of one
packed row, expressed as bidirectional :class:`~forge_lightning.modules.layers.DocumentMask` s over segment ids, so
the kernel (an SDPA mask on CPU, FlexAttention or FlashAttention varlen on CUDA) is chosen in one place. The
patches are put in window order once before the first block (windows then are contiguous segments) and the merged
tokens back in input order after the merger, as in the reference implementation.

Parameter names below the encoder are transformers' names below ``visual.`` (``patch_embed.proj``,
``blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.*}``, ``merger.{ln_q,mlp.0,mlp.2}``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.modules.layers import (
    AxialRotaryEmbedding,
    DocumentMask,
    GatedMLP,
    RMSNorm,
    apply_rotary,
    attention,
    init_linear,
)
from forge_lightning.modules.layers.attention import check_attention_backend
from forge_lightning.modules.layers.init import reset_owned_parameters
from forge_lightning.modules.layers.state_dict import load_exact
from forge_lightning.modules.vlm.patches import check_grids, frame_ids, patch_positions, window_order

NORM_EPS = 1e-6
"""Epsilon of every RMSNorm of the encoder (fixed by the architecture, not in ``config.json``)."""

HF_PREFIXES = ("model.visual.", "visual.")
"""Prefixes of the vision weights in transformers Qwen2.5-VL state dicts: ``model.visual.`` (transformers 5 in
memory), ``visual.`` (published checkpoints, transformers 4)."""

# HF `vision_config` keys and their fields here; the rest keep their names.
_HF_RENAMES = {"depth": "num_layers", "fullatt_block_indexes": "full_attention_layers"}
_HF_REQUIRED = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
_POSITIVE_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "out_hidden_size",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "window_size",
)


class QwenViTShape:
    """The derived sizes of a Qwen-VL ViT config (one with ``hidden_size``, ``num_heads``, ``in_channels`` and the
    patch sizes)."""

    hidden_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch, the width of a ``pixel_values`` row: ``in_channels * temporal_patch_size *
        patch_size ** 2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(kw_only=True)
class Qwen25VisionConfig(QwenViTShape):
    """Architecture of the Qwen2.5-VL vision encoder (the ``vision_config`` of a Qwen2.5-VL ``config.json``).

    Args:
        hidden_size: width of the vision transformer.
        intermediate_size: width of the SwiGLU hidden layer of each block.
        num_layers: transformer blocks (``depth`` in ``config.json``).
        num_heads: attention heads; ``hidden_size / num_heads`` must be a multiple of 4 (2-D RoPE).
        out_hidden_size: width of the merged tokens, the language model's hidden size.
        full_attention_layers: blocks that attend over whole frames; the others attend within windows
            (``fullatt_block_indexes``).
        in_channels: image channels (``in_channels``; ``in_chans`` in older files).
        patch_size: side of a square patch in pixels.
        temporal_patch_size: video frames per patch (the processor repeats an image's frame to fill them).
        spatial_merge_size: side of the square of patches the merger fuses into one token.
        window_size: side of an attention window in pixels; a window covers
            ``window_size // (spatial_merge_size * patch_size)`` merged tokens per side (:attr:`window_units`).
        hidden_act: activation of the gated MLP; only ``silu`` (the SwiGLU of every released checkpoint).
        rope_theta: base wavelength of the 2-D RoPE.
        initializer_range: standard deviation of the normal initialisation of the linear and patch weights.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    out_hidden_size: int
    full_attention_layers: list[int]
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        check_vit_shape(self, _POSITIVE_INTS)
        self.full_attention_layers = check_block_indices(
            self.full_attention_layers, self.num_layers, "full_attention_layers"
        )
        if self.window_units < 1:
            raise ValueError(
                f"vision.window_size ({self.window_size}) must cover at least one merged token: "
                f"spatial_merge_size * patch_size ({self.spatial_merge_size * self.patch_size}) pixels"
            )
        if self.hidden_act != "silu":
            raise ValueError(
                f"vision.hidden_act ({self.hidden_act!r}) is not supported; only 'silu' (SwiGLU) is"
            )

    @property
    def window_units(self) -> int:
        """Side of an attention window in merged tokens."""
        return self.window_size // (self.spatial_merge_size * self.patch_size)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> Qwen25VisionConfig:
        """Build ``PRESETS[name]`` with ``overrides`` applied."""
        if name not in PRESETS:
            raise KeyError(f"unknown vision preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Qwen25VisionConfig:
        """Read the ``vision_config`` dict of a Qwen2.5-VL ``config.json`` (or the whole dict, which holds one).

        Keys that do not shape the encoder (``tokens_per_second``, transformers' bookkeeping) are ignored.

        Raises:
            ValueError: a required field is missing, ``in_channels`` and ``in_chans`` disagree, the rope type is
                not ``axial``, or a value fails the checks of :class:`Qwen25VisionConfig`.
        """
        return cls(**vit_fields_from_hf(cls, hf.get("vision_config", hf), _HF_RENAMES, _HF_REQUIRED))

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` dict transformers builds this encoder from (``in_chans`` written too)."""
        values = dataclasses.asdict(self)
        hf = {key: values[_HF_RENAMES.get(key, key)] for key in _HF_KEYS}
        hf["in_chans"] = self.in_channels
        hf["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        return hf


def check_vit_shape(config: Any, positive_ints: tuple[str, ...]) -> None:
    """The checks every Qwen-VL ViT config shares: ``positive_ints`` are positive integers, the heads split for the
    2-D RoPE, ``rope_theta`` and ``initializer_range`` in range.

    Raises:
        ValueError: naming the field and its value.
    """
    for name in positive_ints:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"vision.{name} ({value!r}) must be a positive integer")
    if config.hidden_size % config.num_heads or (config.hidden_size // config.num_heads) % 4:
        raise ValueError(
            f"vision.num_heads ({config.num_heads}) must divide vision.hidden_size ({config.hidden_size}) into "
            "heads of a multiple of 4 (the 2-D RoPE rotates half of each head by the row, half by the column)"
        )
    if not config.rope_theta > 0:
        raise ValueError(f"vision.rope_theta ({config.rope_theta}) must be positive")
    if config.initializer_range < 0:
        raise ValueError(f"vision.initializer_range ({config.initializer_range}) must be non-negative")


def check_block_indices(indices: Any, num_layers: int, field: str) -> list[int]:
    """``indices`` as a list, if they are distinct block indices in ``[0, num_layers)``.

    Raises:
        ValueError: naming ``vision.<field>``, the range and the indices out of it.
    """
    indices = list(indices)
    bad = [i for i in indices if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad or len(set(indices)) != len(indices):
        raise ValueError(
            f"vision.{field} ({indices}) must be distinct block indices in [0, {num_layers}) (vision.num_layers "
            f"is {num_layers}); out of range: {bad}"
        )
    return indices


def vit_fields_from_hf(
    cls: type, hf: Mapping[str, Any], renames: Mapping[str, str], required: tuple[str, ...]
) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` in a Qwen-VL ``vision_config`` dict: keys renamed by ``renames``, the
    legacy ``in_chans`` and the axial ``rope_parameters`` read; keys that are no field are ignored.

    Raises:
        ValueError: a ``required`` key is missing, ``in_channels`` and ``in_chans`` disagree, or the rope type is
            not ``axial``.
    """
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"vision_config lacks required fields: {', '.join(missing)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {renames.get(k, k): v for k, v in hf.items() if renames.get(k, k) in fields}
    if "in_chans" in hf:
        if hf.get("in_channels", hf["in_chans"]) != hf["in_chans"]:
            raise ValueError(
                f"vision_config in_channels ({hf['in_channels']}) and in_chans ({hf['in_chans']}) disagree"
            )
        values["in_channels"] = hf["in_chans"]
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config rope_type ({rope['rope_type']!r}) is not supported; only 'axial' is")
    if "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    return values


_HF_KEYS = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "out_hidden_size",
    "fullatt_block_indexes",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "window_size",
    "hidden_act",
    "initializer_range",
)

_RELEASED = {
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_layers": 32,
    "num_heads": 16,
    "full_attention_layers": [7, 15, 23, 31],
}

PRESETS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct/blob/main/config.json (and -7B, -32B, -72B): one
    # encoder, projected to the width of each language model.
    "qwen2.5-vl-3b": {**_RELEASED, "out_hidden_size": 2048},
    "qwen2.5-vl-7b": {**_RELEASED, "out_hidden_size": 3584},
    "qwen2.5-vl-32b": {**_RELEASED, "out_hidden_size": 5120},
    "qwen2.5-vl-72b": {**_RELEASED, "out_hidden_size": 8192},
    # Two merged tokens per window side, so a few-patch image already splits into several windows.
    "debug": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 4,
        "num_heads": 2,
        "out_hidden_size": 48,
        "full_attention_layers": [1, 3],
        "window_size": 56,
    },
}
"""Vision encoder sizes by name (``Qwen25VisionConfig.from_preset``)."""


class PatchEmbed(nn.Module):
    """Linear embedding of flattened ``C x T x P x P`` patches, stored as transformers' ``Conv3d`` (bias-free in
    Qwen2.5-VL, biased in Qwen3-VL).

    Args:
        config: the encoder's configuration (``in_channels``, ``hidden_size``, the patch sizes).
        bias: whether the projection has a bias.
    """

    def __init__(self, config: Any, *, bias: bool = False) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, mean=0.0, std=self.init_std)
        if self.proj.bias is not None:
            nn.init.zeros_(self.proj.bias)

    def forward(self, pixel_values_NP: Tensor) -> Tensor:
        """``[N, C*T*P*P]`` patches (``C, T, P, P`` row-major, as the processor writes them) to ``[N, hidden]``."""
        # A convolution whose kernel covers its whole input is a matrix product: F.linear on the flattened kernel
        # gives the same numbers without the slow Conv3d kernels.
        weight = self.proj.weight
        return F.linear(pixel_values_NP.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention with a fused, biased ``qkv`` projection and 2-D RoPE.

    Args:
        hidden_size: width.
        num_heads: attention heads.
        init_std: standard deviation of the normal initialisation of the projection weights.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.init_std = num_heads, hidden_size // num_heads, init_std
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def reset_parameters(self) -> None:
        init_linear(self.qkv, self.init_std)
        init_linear(self.proj, self.init_std)

    def matrix_parts(self) -> dict[str, tuple[int, ...]]:
        """``qkv`` fuses the query, key and value rows."""
        width = self.qkv.in_features
        return {"qkv.weight": (width, width, width)}

    def forward(self, x_ND: Tensor, rope: tuple[Tensor, Tensor], segments: DocumentMask) -> Tensor:
        """Attend the ``[N, hidden]`` patches within their segments; ``rope`` is ``(cos, sin)`` ``[1, N, D/2]``."""
        N = x_ND.shape[0]
        q_NHD, k_NHD, v_NHD = self.qkv(x_ND).view(N, 3, self.num_heads, self.head_dim).unbind(1)
        q_1NHD, k_1NHD = apply_rotary(q_NHD[None], *rope), apply_rotary(k_NHD[None], *rope)
        q, k, v = (x.transpose(1, 2) for x in (q_1NHD, k_1NHD, v_NHD[None]))  # [1, heads, N, D]
        out_1HND = attention(q, k, v, causal=False, documents=segments)
        return self.proj(out_1HND.transpose(1, 2).reshape(N, -1))


class VisionBlock(nn.Module):
    """Pre-RMSNorm ViT block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))`` (biased SwiGLU MLP).

    Subclasses change the norms and the MLP through :meth:`build_norm` and :meth:`build_mlp`.

    Args:
        config: the encoder's configuration.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = self.build_norm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads, init_std=config.initializer_range)
        self.norm2 = self.build_norm(config.hidden_size)
        self.mlp = self.build_mlp(config)

    def build_norm(self, hidden_size: int) -> nn.Module:
        """``norm1`` / ``norm2``."""
        return RMSNorm(hidden_size, NORM_EPS)

    def build_mlp(self, config: Any) -> nn.Module:
        """``mlp``."""
        return GatedMLP(
            config.hidden_size, config.intermediate_size, bias=True, init_std=config.initializer_range
        )

    def forward(self, x_ND: Tensor, rope: tuple[Tensor, Tensor], segments: DocumentMask) -> Tensor:
        x_ND = x_ND + self.attn(self.norm1(x_ND), rope, segments)
        return x_ND + self.mlp(self.norm2(x_ND))


class PatchMerger(nn.Module):
    """Fuses each ``m x m`` block of patches into one token: RMSNorm, concatenation, a GELU MLP to ``out_size``.

    Args:
        hidden_size: width of the patches.
        out_size: width of the merged tokens.
        spatial_merge_size: side ``m`` of a merged block.
        init_std: standard deviation of the normal initialisation of the linear weights.
    """

    def __init__(
        self, hidden_size: int, out_size: int, spatial_merge_size: int, *, init_std: float = 0.02
    ) -> None:
        super().__init__()
        self.init_std = init_std
        self.merged_size = hidden_size * spatial_merge_size**2
        self.ln_q = RMSNorm(hidden_size, NORM_EPS)
        # An nn.Sequential for the checkpoints' names: mlp.0 and mlp.2.
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_size, self.merged_size), nn.GELU(), nn.Linear(self.merged_size, out_size)
        )

    def reset_parameters(self) -> None:
        init_linear(self.mlp[0], self.init_std)
        init_linear(self.mlp[2], self.init_std)

    def forward(self, x_ND: Tensor) -> Tensor:
        """``[N, hidden]`` patches, each block's ``m²`` consecutive, to ``[N / m², out_size]``."""
        return self.mlp(self.ln_q(x_ND).view(-1, self.merged_size))


class Qwen25VisionTransformer(nn.Module):
    """The Qwen2.5-VL vision encoder: images and videos of any grid in, merged tokens for the language model out.

    Build on the meta device for large sizes, then ``to_empty(device=...)`` and :meth:`init_weights`.

    Args:
        config: the encoder's configuration.
        attention_backend: kernel for the per-frame and per-window attention: ``auto``, ``sdpa``, ``flex`` or
            ``varlen`` (see ``forge_lightning.modules.layers.attention``).
    """

    def __init__(self, config: Qwen25VisionConfig, *, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.attention_backend = check_attention_backend(attention_backend)
        self.patch_embed = PatchEmbed(config)
        self.rotary_pos_emb = AxialRotaryEmbedding(config.head_dim, num_axes=2, theta=config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.merger = PatchMerger(
            config.hidden_size,
            config.out_hidden_size,
            config.spatial_merge_size,
            init_std=config.initializer_range,
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and rebuild the RoPE buffer, e.g. after ``to_empty``.

        Linear and patch weights are drawn from ``N(0, initializer_range)`` and biases zeroed by the module that
        owns them; norms are set to one.
        """
        reset_owned_parameters(self.modules())

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        """Merged tokens of the images and videos, in input order.

        Args:
            pixel_values: ``[num_patches, in_channels * temporal_patch_size * patch_size ** 2]`` flattened patches,
                image after image, each in block-major order (as transformers' Qwen2.5-VL processor writes them).
            grid_thw: ``[num_images, 3]`` integer ``(t, h, w)`` patch grid of each image or video.

        Returns:
            ``[num_patches / spatial_merge_size ** 2, out_hidden_size]``.

        Raises:
            ValueError: the patch width is not :attr:`Qwen25VisionConfig.patch_dim`, or the grids do not match the
                patches (see :func:`~forge_lightning.modules.vlm.patches.check_grids`).
        """
        c, device = self.config, pixel_values.device
        if pixel_values.ndim != 2 or pixel_values.shape[1] != c.patch_dim:
            raise ValueError(
                f"pixel_values must be [num_patches, {c.patch_dim}] (in_channels * temporal_patch_size * "
                f"patch_size ** 2), got {list(pixel_values.shape)}"
            )
        grids = check_grids(grid_thw, pixel_values.shape[0], c.spatial_merge_size)
        unit_order, unit_windows = window_order(grids, c.spatial_merge_size, c.window_units, device=device)
        unit_size = c.spatial_merge_size**2
        # The patches of the reordered units, each unit's m² patches in their input order.
        order = (unit_order[:, None] * unit_size + torch.arange(unit_size, device=device)).flatten()
        x_ND = self.patch_embed(pixel_values)[order]  # [N, hidden], in window order
        cos, sin = self.rotary_pos_emb(patch_positions(grids, c.spatial_merge_size, device=device)[order])
        rope = (cos[None], sin[None])  # [1, N, head_dim / 2]
        # Window order keeps the frames contiguous and in input order: their ids need no reordering.
        frames = DocumentMask.build(
            frame_ids(grids, device=device)[None], self.attention_backend, causal=False, varying_shapes=True
        )
        windows = DocumentMask.build(
            unit_windows.repeat_interleave(unit_size)[None],
            self.attention_backend,
            causal=False,
            varying_shapes=True,
        )
        full = set(c.full_attention_layers)
        for i, block in enumerate(self.blocks):
            x_ND = block(x_ND, rope, frames if i in full else windows)
        return self.merger(x_ND)[torch.argsort(unit_order)]  # [N / m², out_hidden_size], in input order


def from_hf_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The vision encoder's entries of a transformers Qwen2.5-VL state dict, named as in
    :class:`Qwen25VisionTransformer` (the prefix in :data:`HF_PREFIXES` removed; other entries are left out).

    Raises:
        ValueError: no key has a vision prefix, or both prefixes occur.
    """
    found = {prefix: [k for k in state if k.startswith(prefix)] for prefix in HF_PREFIXES}
    used = [prefix for prefix, keys in found.items() if keys]
    if len(used) != 1:
        what = "none" if not used else "both"
        raise ValueError(
            f"a Qwen2.5-VL state dict holds its vision weights under one of {', '.join(HF_PREFIXES)}; {what} found"
        )
    (prefix,) = used
    # Rotary frequencies are rebuilt from the config; a few old exports saved them.
    return {k[len(prefix) :]: state[k] for k in found[prefix] if not k.endswith("rotary_pos_emb.inv_freq")}


def to_hf_state_dict(encoder: Qwen25VisionTransformer, *, prefix: str = "visual.") -> dict[str, Tensor]:
    """The encoder's weights under transformers' names: ``visual.`` (the published checkpoints' layout, which every
    transformers version loads) or ``model.visual.`` (transformers 5's in-memory layout)."""
    if prefix not in HF_PREFIXES:
        raise ValueError(f"prefix ({prefix!r}) must be one of {', '.join(HF_PREFIXES)}")
    return {prefix + k: v for k, v in encoder.state_dict().items()}


def load_hf_vision_weights(
    encoder: Qwen25VisionTransformer, state: Mapping[str, Tensor]
) -> Qwen25VisionTransformer:
    """Copy the vision weights of a transformers Qwen2.5-VL state dict into ``encoder``; return it.

    Raises:
        ValueError: the state dict has no vision weights, or they do not match the encoder's parameters (missing,
            unexpected or differently shaped entries; the message names them).
    """
    load_exact(encoder, from_hf_state_dict(state), what="the vision weights")
    return encoder

"""The Qwen3-VL vision encoder (Qwen team 2025): a ViT over native-resolution patch grids with a learned position
grid resampled to each image, 2-D RoPE, full attention within each frame, a patch merger into the language model's
width and DeepStack mergers that hand features of earlier blocks to the first decoder layers. Its configuration
lives here too.

::

    pixel_values [N, C*T*P*P], grid_thw [n, 3]
      ─ patch_embed (biased) + pos_embed (the learned side x side grid, bilinear at each patch) ─ [N, hidden]
      ─ [VisionBlock] x num_layers:  x + attn(LN(x)); x + mlp(LN(x))           (2-D RoPE on queries and keys)
            └ after block deepstack_layers[k]: deepstack_merger_list[k] ─ [N/m², out_hidden_size]
      ─ merger: LN ─ view [N/m², m²·hidden] ─ Linear ─ GELU ─ Linear ─ [N/m², out_hidden_size]

Unlike Qwen2.5-VL there are no windows: every block attends within each frame (an image, or one temporal patch of a
video), a bidirectional :class:`~forge_lightning.modules.layers.DocumentMask` over frame ids, so the patches keep
their input order. Attention, RoPE, the patch embedding and the block are Qwen2.5-VL's
(:mod:`~forge_lightning.modules.vlm.qwen2_5_vit`) with LayerNorms and a plain MLP.

Parameter names below the encoder are transformers' names below ``visual.`` (``patch_embed.proj``, ``pos_embed``,
``blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.linear_fc1,mlp.linear_fc2}``, ``merger.{norm,linear_fc1,linear_fc2}``,
``deepstack_merger_list.K.*``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers import AxialRotaryEmbedding, DocumentMask, init_linear
from forge_lightning.modules.layers.activations import activation
from forge_lightning.modules.layers.attention import check_attention_backend
from forge_lightning.modules.layers.init import reset_owned_parameters
from forge_lightning.modules.vlm.patches import Grid, check_grids, frame_ids, patch_positions
from forge_lightning.modules.vlm.qwen2_5_vit import (
    NORM_EPS,
    PatchEmbed,
    QwenViTShape,
    VisionBlock,
    check_block_indices,
    check_vit_shape,
    vit_fields_from_hf,
)

_HF_RENAMES = {"depth": "num_layers", "deepstack_visual_indexes": "deepstack_layers"}
_HF_REQUIRED = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
_POSITIVE_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "out_hidden_size",
    "num_position_embeddings",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
)
_HF_KEYS = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "out_hidden_size",
    "deepstack_visual_indexes",
    "num_position_embeddings",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "hidden_act",
    "initializer_range",
)


@dataclass(kw_only=True)
class Qwen3VisionConfig(QwenViTShape):
    """Architecture of the Qwen3-VL vision encoder (the ``vision_config`` of a Qwen3-VL ``config.json``).

    Args:
        hidden_size: width of the vision transformer.
        intermediate_size: width of the hidden layer of each block's MLP.
        num_layers: transformer blocks (``depth`` in ``config.json``).
        num_heads: attention heads; ``hidden_size / num_heads`` must be a multiple of 4 (2-D RoPE).
        out_hidden_size: width of the merged tokens, the language model's hidden size.
        deepstack_layers: blocks whose output a DeepStack merger turns into features for the decoder layers
            ``0, 1, ...`` in this order (``deepstack_visual_indexes``).
        num_position_embeddings: entries of the learned position grid, a square number (``side * side``).
        in_channels: image channels.
        patch_size: side of a square patch in pixels.
        temporal_patch_size: video frames per patch (the processor repeats an image's frame to fill them).
        spatial_merge_size: side of the square of patches the merger fuses into one token.
        hidden_act: activation of the MLPs of the blocks (a name in
            :data:`~forge_lightning.modules.layers.activations.ACTIVATIONS`).
        rope_theta: base wavelength of the 2-D RoPE.
        initializer_range: standard deviation of the normal initialisation of the linear, patch and position
            weights.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    out_hidden_size: int
    deepstack_layers: list[int] = field(default_factory=list)
    num_position_embeddings: int = 2304
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        check_vit_shape(self, _POSITIVE_INTS)
        self.deepstack_layers = check_block_indices(
            self.deepstack_layers, self.num_layers, "deepstack_layers"
        )
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(
                f"vision.num_position_embeddings ({self.num_position_embeddings}) must be a square number: the "
                "learned positions are a side x side grid"
            )
        activation(self.hidden_act, "vision.hidden_act")  # refuses an unknown name now, not at build

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> Qwen3VisionConfig:
        """Build ``PRESETS[name]`` with ``overrides`` applied."""
        if name not in PRESETS:
            raise KeyError(f"unknown vision preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Qwen3VisionConfig:
        """Read the ``vision_config`` dict of a Qwen3-VL ``config.json`` (or the whole dict, which holds one).

        Raises:
            ValueError: a required field is missing, the rope type is not ``axial``, or a value fails the checks of
                :class:`Qwen3VisionConfig`.
        """
        return cls(**vit_fields_from_hf(cls, hf.get("vision_config", hf), _HF_RENAMES, _HF_REQUIRED))

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` dict transformers builds this encoder from."""
        hf = {key: getattr(self, _HF_RENAMES.get(key, key)) for key in _HF_KEYS}
        hf["deepstack_visual_indexes"] = list(self.deepstack_layers)
        hf["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        return hf


PRESETS: dict[str, dict[str, Any]] = {
    # Released sizes come with their checkpoints' config.json (VLMConfig.from_hf); this one is for tests.
    "debug": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 3,
        "num_heads": 2,
        "out_hidden_size": 48,
        "deepstack_layers": [0, 1],
        "num_position_embeddings": 16,
        "patch_size": 4,
    },
}
"""Vision encoder sizes by name (``Qwen3VisionConfig.from_preset``)."""


class VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))`` with biases.

    Args:
        config: the encoder's configuration.
    """

    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act, "vision.hidden_act")
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def reset_parameters(self) -> None:
        init_linear(self.linear_fc1, self.init_std)
        init_linear(self.linear_fc2, self.init_std)

    def forward(self, x_ND: Tensor) -> Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x_ND)))


class Qwen3VisionBlock(VisionBlock):
    """Qwen2.5-VL's block with pre-LayerNorms and :class:`VisionMLP`."""

    def build_norm(self, hidden_size: int) -> nn.Module:
        return nn.LayerNorm(hidden_size, eps=NORM_EPS)

    def build_mlp(self, config: Any) -> nn.Module:
        return VisionMLP(config)


class PatchMerger(nn.Module):
    """Fuses each ``m x m`` block of patches into one token: a LayerNorm over each patch (or, with
    ``postshuffle_norm``, over the concatenated block, as the DeepStack mergers do), a GELU MLP to ``out_size``.

    Args:
        hidden_size: width of the patches.
        out_size: width of the merged tokens.
        spatial_merge_size: side ``m`` of a merged block.
        postshuffle_norm: normalise after the concatenation instead of before.
        init_std: standard deviation of the normal initialisation of the linear weights.
    """

    def __init__(
        self,
        hidden_size: int,
        out_size: int,
        spatial_merge_size: int,
        *,
        postshuffle_norm: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.init_std, self.postshuffle_norm = init_std, postshuffle_norm
        self.merged_size = hidden_size * spatial_merge_size**2
        self.norm = nn.LayerNorm(self.merged_size if postshuffle_norm else hidden_size, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_size, out_size)

    def reset_parameters(self) -> None:
        init_linear(self.linear_fc1, self.init_std)
        init_linear(self.linear_fc2, self.init_std)

    def forward(self, x_ND: Tensor) -> Tensor:
        """``[N, hidden]`` patches, each block's ``m²`` consecutive, to ``[N / m², out_size]``."""
        x = x_ND.view(-1, self.merged_size) if self.postshuffle_norm else x_ND
        x_MK = self.norm(x).view(-1, self.merged_size)  # [N / m², m² * hidden]
        return self.linear_fc2(self.act(self.linear_fc1(x_MK)))


class Qwen3VisionTransformer(nn.Module):
    """The Qwen3-VL vision encoder: images and videos of any grid in; merged tokens and DeepStack features out.

    Build on the meta device for large sizes, then ``to_empty(device=...)`` and :meth:`init_weights`.

    Args:
        config: the encoder's configuration.
        attention_backend: kernel for the per-frame attention: ``auto``, ``sdpa``, ``flex`` or ``varlen`` (see
            ``forge_lightning.modules.layers.attention``).
    """

    def __init__(self, config: Qwen3VisionConfig, *, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.attention_backend = check_attention_backend(attention_backend)
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.rotary_pos_emb = AxialRotaryEmbedding(config.head_dim, num_axes=2, theta=config.rope_theta)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(config) for _ in range(config.num_layers))
        merger = dict(
            hidden_size=config.hidden_size,
            out_size=config.out_hidden_size,
            spatial_merge_size=config.spatial_merge_size,
            init_std=config.initializer_range,
        )
        self.merger = PatchMerger(**merger)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(**merger, postshuffle_norm=True) for _ in config.deepstack_layers
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and rebuild the RoPE buffer, e.g. after ``to_empty``.

        Linear, patch and position weights are drawn from ``N(0, initializer_range)`` and biases zeroed by the
        module that owns them; norms are set to one (LayerNorm biases to zero).
        """
        nn.init.normal_(self.pos_embed.weight, mean=0.0, std=self.config.initializer_range)
        reset_owned_parameters(self.modules())

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Merged tokens of the images and videos, in input order, and the DeepStack features.

        Args:
            pixel_values: ``[num_patches, in_channels * temporal_patch_size * patch_size ** 2]`` flattened patches,
                image after image, each in block-major order (as transformers' Qwen3-VL processor writes them).
            grid_thw: ``[num_images, 3]`` integer ``(t, h, w)`` patch grid of each image or video.

        Returns:
            ``(merged [num_patches / spatial_merge_size ** 2, out_hidden_size], deepstack)``: ``deepstack`` holds
            one tensor of the merged shape per entry of ``deepstack_layers``, in that order.

        Raises:
            ValueError: the patch width is not :attr:`Qwen3VisionConfig.patch_dim`, or the grids do not match the
                patches (see :func:`~forge_lightning.modules.vlm.patches.check_grids`).
        """
        c, device = self.config, pixel_values.device
        if pixel_values.ndim != 2 or pixel_values.shape[1] != c.patch_dim:
            raise ValueError(
                f"pixel_values must be [num_patches, {c.patch_dim}] (in_channels * temporal_patch_size * "
                f"patch_size ** 2), got {list(pixel_values.shape)}"
            )
        grids = check_grids(grid_thw, pixel_values.shape[0], c.spatial_merge_size)
        positions_N2 = patch_positions(grids, c.spatial_merge_size, device=device)
        x_ND = self.patch_embed(pixel_values)
        x_ND = x_ND + self._position_embedding(grids, positions_N2).to(x_ND.dtype)
        cos, sin = self.rotary_pos_emb(positions_N2)
        rope = (cos[None], sin[None])  # [1, N, head_dim / 2]
        frames = DocumentMask.build(
            frame_ids(grids, device=device)[None], self.attention_backend, causal=False, varying_shapes=True
        )
        deepstack = []
        for i, block in enumerate(self.blocks):
            x_ND = block(x_ND, rope, frames)
            if i in c.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[c.deepstack_layers.index(i)](x_ND))
        return self.merger(x_ND), deepstack

    def _position_embedding(self, grids: list[Grid], positions_N2: Tensor) -> Tensor:
        """``[N, hidden]``: the learned ``side x side`` grid sampled bilinearly at every patch, the corners of a
        frame's ``h x w`` patch grid on the corners of the learned one (``align_corners``)."""
        side = self.config.grid_side
        sizes_N2 = torch.cat(
            [torch.tensor([[h, w]], device=positions_N2.device).expand(t * h * w, 2) for t, h, w in grids]
        )
        src_N2 = positions_N2.float() * (side - 1) / (sizes_N2 - 1).clamp(min=1)
        low_N2 = src_N2.floor().long()
        high_N2 = (low_N2 + 1).clamp(max=side - 1)
        frac_N2 = src_N2 - low_N2  # the weight of the upper neighbour, per axis
        table = self.pos_embed.weight.view(side, side, -1)
        (r0, c0), (r1, c1) = low_N2.unbind(1), high_N2.unbind(1)
        wr, wc = frac_N2[:, :1], frac_N2[:, 1:]
        top = (1 - wc) * table[r0, c0] + wc * table[r0, c1]
        bottom = (1 - wc) * table[r1, c0] + wc * table[r1, c1]
        return (1 - wr) * top + wr * bottom

"""How each ``vision.type`` plugs into :class:`~forge_lightning.modules.vlm.model.VisionLanguageModel`: its
encoder, the inputs it takes, its placeholder tokens and the LLM positions it needs (:data:`TOWERS`).

The model itself is generic: embed the tokens, put the projected encoder features at the placeholders, run the LLM
at the tower's positions. A new encoder is a :class:`VisionTower` here and a config in
:data:`~forge_lightning.modules.vlm.config.VISION_TYPES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers.attention import document_positions
from forge_lightning.modules.vlm.positions import get_packed_rope_index, get_rope_index
from forge_lightning.modules.vlm.qwen2_5_vit import Qwen25VisionTransformer
from forge_lightning.modules.vlm.siglip import SiglipVisionTransformer


class VisionTower:
    """The contract of one encoder type with the composed model.

    Attributes:
        kinds: the media it encodes (``image``, ``video``); each has a ``<kind>_token_id`` in the config.
        inputs: the optional arguments of ``VisionLanguageModel.forward`` it takes (others must be ``None``).
    """

    kinds: tuple[str, ...] = ("image",)
    inputs: frozenset[str] = frozenset({"pixel_values"})

    def build(self, config: Any, attention_backend: str) -> nn.Module:
        """The encoder for the ``vision`` config."""
        raise NotImplementedError

    def placeholder(self, kind: str) -> str:
        """How the placeholder token of ``kind`` is written, for messages."""
        raise NotImplementedError

    def encode(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None, kind: str) -> Tensor:
        """The encoder's features of ``pixels``, one row per placeholder token: ``[num_tokens, out_hidden_size]``."""
        raise NotImplementedError

    def describe_count(self, config: Any, kind: str, pixels: Tensor, num_features: int) -> str:
        """Where ``num_features`` features of ``pixels`` come from, for the placeholder-count error."""
        raise NotImplementedError

    def positions(
        self,
        config: Any,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        second_per_grid_ts: Tensor | Sequence[float] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(position_ids, rope_deltas [B, 1])`` of a batch for the LLM."""
        raise NotImplementedError

    def packed_positions(
        self,
        config: Any,
        input_ids: Tensor,
        document_ids: Tensor,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        second_per_grid_ts: Tensor | Sequence[float] | None = None,
    ) -> Tensor:
        """LLM positions of packed rows (``document_ids [B, S]``), restarting at every document: by default the
        1-D ``[B, S]`` positions of :func:`~forge_lightning.modules.layers.attention.document_positions`."""
        return document_positions(document_ids)


class Qwen25VisionTower(VisionTower):
    """Qwen2.5-VL: patch rows with their grids, images and videos, multimodal RoPE positions
    (:func:`~forge_lightning.modules.vlm.positions.get_rope_index`)."""

    kinds = ("image", "video")
    inputs = frozenset(
        {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"}
    )

    def build(self, config: Any, attention_backend: str) -> nn.Module:
        return Qwen25VisionTransformer(config, attention_backend=attention_backend)

    def placeholder(self, kind: str) -> str:
        return f"<|{kind}_pad|>"

    def encode(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None, kind: str) -> Tensor:
        if grid_thw is None:
            raise ValueError(f"{kind} pixels need their {kind}_grid_thw")
        return encoder(pixels, grid_thw)

    def describe_count(self, config: Any, kind: str, pixels: Tensor, num_features: int) -> str:
        return (
            f"{kind}_grid_thw gives {num_features} merged {kind} tokens (t * h * w / spatial_merge_size ** 2 per "
            f"{kind})"
        )

    def positions(
        self,
        config: Any,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        second_per_grid_ts: Tensor | Sequence[float] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``[3, B, S]`` (temporal, height, width) positions and their rope deltas."""
        options = _rope_options(config, image_grid_thw, video_grid_thw, second_per_grid_ts)
        return get_rope_index(input_ids, attention_mask=attention_mask, **options)

    def packed_positions(
        self,
        config: Any,
        input_ids: Tensor,
        document_ids: Tensor,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        second_per_grid_ts: Tensor | Sequence[float] | None = None,
    ) -> Tensor:
        """``[3, B, S]`` positions of each document on its own (:func:`get_packed_rope_index`)."""
        options = _rope_options(config, image_grid_thw, video_grid_thw, second_per_grid_ts)
        return get_packed_rope_index(input_ids, document_ids, **options)


def _rope_options(
    config: Any,
    image_grid_thw: Tensor | None,
    video_grid_thw: Tensor | None,
    second_per_grid_ts: Tensor | Sequence[float] | None,
) -> dict[str, Any]:
    """The keyword arguments of :func:`get_rope_index` for a Qwen2.5-VL config and a batch's grids."""
    return {
        "image_token_id": config.image_token_id,
        "video_token_id": config.video_token_id,
        "spatial_merge_size": config.vision.spatial_merge_size,
        "image_grid_thw": image_grid_thw,
        "video_grid_thw": video_grid_thw,
        "second_per_grid_ts": second_per_grid_ts,
        "tokens_per_second": config.tokens_per_second if video_grid_thw is not None else None,
    }


class SiglipVisionTower(VisionTower):
    """LLaVA with SigLIP: whole fixed-size images ``[num_images, 3, H, W]``, ``tokens_per_image`` ``<image>``
    tokens each, 1-D positions ``0 .. S-1`` on every row (as transformers' LLaVA gives its LLM, padding or not)."""

    # image_sizes: what LLaVA processors return beside the pixels; every SigLIP image is resized to image_size and
    # gives the same tokens, so it changes nothing (accepted so that a processor's output can be passed whole).
    inputs = frozenset({"pixel_values", "image_sizes"})

    def build(self, config: Any, attention_backend: str) -> nn.Module:
        # Equal-size images are a dense batch: SDPA without a mask, so there is no attention backend to choose.
        return SiglipVisionTransformer(config)

    def placeholder(self, kind: str) -> str:
        return "<image>"

    def encode(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None, kind: str) -> Tensor:
        return encoder(pixels).flatten(0, 1)  # [num_images * tokens_per_image, out_hidden_size]

    def describe_count(self, config: Any, kind: str, pixels: Tensor, num_features: int) -> str:
        v = config.vision
        dropped = (
            " - 1 (vision.feature_select_strategy 'default')"
            if v.feature_select_strategy == "default"
            else ""
        )
        return (
            f"pixel_values give {num_features} image features ({pixels.shape[0]} images x {v.tokens_per_image}: "
            f"(image_size // patch_size) ** 2{dropped})"
        )

    def positions(
        self,
        config: Any,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        second_per_grid_ts: Tensor | Sequence[float] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``[B, S]`` positions ``0 .. S-1`` and zero deltas."""
        B, S = input_ids.shape
        positions_BS = torch.arange(S, device=input_ids.device).expand(B, S)
        return positions_BS, torch.zeros(B, 1, dtype=torch.long, device=input_ids.device)


TOWERS: dict[str, VisionTower] = {"qwen2_5_vit": Qwen25VisionTower(), "siglip": SiglipVisionTower()}
"""The tower of each ``vision.type`` (the keys of :data:`~forge_lightning.modules.vlm.config.VISION_TYPES`)."""

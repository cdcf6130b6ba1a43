"""How each ``vision.type`` plugs into :class:`~forge_lightning.modules.vlm.model.VisionLanguageModel`: its
encoder, the inputs it takes, its placeholder tokens and the LLM positions it needs (:data:`TOWERS`).

The model itself is generic: embed the tokens, put the projected encoder features at the placeholders, run the LLM
at the tower's positions. A new encoder is a :class:`VisionTower` here and a config in
:data:`~forge_lightning.modules.vlm.config.VISION_TYPES`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers.attention import document_positions
from forge_lightning.modules.vlm.anyres import (
    ImageLayout,
    image_layout,
    num_video_tokens,
    pack_image,
    pack_video,
    stack_tiles,
    tile_counts,
)
from forge_lightning.modules.vlm.clip import ClipVisionTransformer
from forge_lightning.modules.vlm.positions import get_packed_rope_index, get_rope_index
from forge_lightning.modules.vlm.qwen2_5_vit import Qwen25VisionTransformer
from forge_lightning.modules.vlm.qwen3_vit import Qwen3VisionTransformer
from forge_lightning.modules.vlm.siglip import SiglipVisionTransformer, check_layers


class VisionTower:
    """The contract of one encoder type with the composed model.

    Attributes:
        kinds: the media it encodes (``image``, ``video``); each has a ``<kind>_token_id`` in the config.
        inputs: the optional arguments of ``VisionLanguageModel.forward`` it takes (others must be ``None``).
        grid_inputs: the argument that lays out the pixels of each kind (the ``grid`` of :meth:`encode`).
        multimodal_rope: the LLM rotates by ``[3, B, S]`` (temporal, height, width) positions, not 1-D ones.
        fixed_image_tokens: every image gives the same number of tokens (``vision.tokens_per_image``).
    """

    kinds: tuple[str, ...] = ("image",)
    inputs: frozenset[str] = frozenset({"pixel_values"})
    grid_inputs: dict[str, str] = {"image": "image_grid_thw", "video": "video_grid_thw"}
    multimodal_rope: bool = False
    fixed_image_tokens: bool = True

    def build(self, config: Any, attention_backend: str) -> nn.Module:
        """The encoder for the ``vision`` config."""
        raise NotImplementedError

    def placeholder(self, kind: str) -> str:
        """How the placeholder token of ``kind`` is written, for messages."""
        raise NotImplementedError

    def layout(self, kind: str, inputs: Mapping[str, Any]) -> Any:
        """What lays out the pixels of ``kind`` in a batch (the ``grid`` of :meth:`encode`), from the model's
        inputs by name: the one :attr:`grid_inputs` names by default."""
        return inputs.get(self.grid_inputs.get(kind, ""))

    def encode(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None, kind: str) -> Tensor:
        """The encoder's features of ``pixels``, one row per placeholder token: ``[num_tokens, out_hidden_size]``
        (or features that :meth:`arrange` lays out after the projector)."""
        raise NotImplementedError

    def arrange(
        self, config: Any, projector: nn.Module, features: Tensor, grid: Tensor | None, kind: str
    ) -> Tensor:
        """The projected features of :meth:`encode` as ``[num_tokens, llm hidden]``, one row per placeholder
        token; as they are by default."""
        return features

    def encode_layers(
        self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None, kind: str
    ) -> tuple[Tensor, list[Tensor]]:
        """:meth:`encode`'s features and those the LLM adds after its first decoder layers at the placeholder
        tokens (DeepStack), one ``[num_tokens, llm hidden]`` tensor per layer; none by default."""
        return self.encode(encoder, pixels, grid_thw, kind), []

    def describe_count(self, config: Any, kind: str, pixels: Tensor, num_features: int) -> str:
        """Where ``num_features`` features of ``pixels`` come from, for the placeholder-count error."""
        raise NotImplementedError

    def blocks(self, encoder: nn.Module) -> list[nn.Module]:
        """The encoder's repeated transformer blocks, in forward order (the unit of wrapping, checkpointing and
        compilation)."""
        raise NotImplementedError

    def unused_modules(self, encoder: nn.Module) -> list[str]:
        """Names (relative to ``encoder``) of its submodules whose parameters never reach the features the LLM gets
        (e.g. layers after the deepest feature layer): they get no gradient, so the module keeps them frozen."""
        return []

    def training_flops(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None) -> float:
        """Training FLOPs (forward + backward) of encoding ``pixels``: ``6 x`` the weights each patch (or merged
        token) passes through, plus ``12 x width x length^2`` per layer and attention segment (``QK^T`` and
        ``AV``, forward and backward, as for the LLM)."""
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
    multimodal_rope = True
    fixed_image_tokens = False

    def build(self, config: Any, attention_backend: str) -> nn.Module:
        return Qwen25VisionTransformer(config, attention_backend=attention_backend)

    def placeholder(self, kind: str) -> str:
        return f"<|{kind}_pad|>"

    def encode(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None, kind: str) -> Tensor:
        return encoder(pixels, _grid(grid_thw, kind))

    def describe_count(self, config: Any, kind: str, pixels: Tensor, num_features: int) -> str:
        return (
            f"{kind}_grid_thw gives {num_features} merged {kind} tokens (t * h * w / spatial_merge_size ** 2 per "
            f"{kind})"
        )

    def blocks(self, encoder: nn.Module) -> list[nn.Module]:
        return list(encoder.blocks)

    def training_flops(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None) -> float:
        """Per frame, full-attention layers attend over its ``h x w`` patches and the others within windows of
        ``window_units`` merged tokens a side (cut short at the bottom and right edges); the merger runs once
        per merged token."""
        c = encoder.config
        m, units = c.spatial_merge_size, c.window_units
        merger = sum(p.numel() for p in encoder.merger.parameters())
        per_patch = sum(p.numel() for p in encoder.parameters()) - merger
        num_patches = pixels.shape[0]
        flops = 6.0 * (per_patch * num_patches + merger * num_patches / m**2)
        full_layers = len(c.full_attention_layers)
        window_layers = c.num_layers - full_layers
        for t, h, w in [] if grid_thw is None else grid_thw.tolist():
            frame = (h * w) ** 2
            windows = sum(
                (rows * cols * m * m) ** 2 for rows in _spans(h // m, units) for cols in _spans(w // m, units)
            )
            flops += 12.0 * c.hidden_size * t * (full_layers * frame + window_layers * windows)
        return flops

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
        options = self._rope_options(config, image_grid_thw, video_grid_thw, second_per_grid_ts)
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
        options = self._rope_options(config, image_grid_thw, video_grid_thw, second_per_grid_ts)
        return get_packed_rope_index(input_ids, document_ids, **options)

    def _rope_options(
        self,
        config: Any,
        image_grid_thw: Tensor | None,
        video_grid_thw: Tensor | None,
        second_per_grid_ts: Tensor | Sequence[float] | None,
    ) -> dict[str, Any]:
        """The keyword arguments of :func:`get_rope_index` for the config and a batch's grids."""
        return {
            "image_token_id": config.image_token_id,
            "video_token_id": config.video_token_id,
            "spatial_merge_size": config.vision.spatial_merge_size,
            "image_grid_thw": image_grid_thw,
            "video_grid_thw": video_grid_thw,
            "second_per_grid_ts": second_per_grid_ts,
            **self.video_timing(config, video_grid_thw),
        }

    def video_timing(self, config: Any, video_grid_thw: Tensor | None) -> dict[str, Any]:
        """How :func:`~forge_lightning.modules.vlm.positions.get_rope_index` spaces video frames: by
        ``tokens_per_second``."""
        return {"tokens_per_second": config.tokens_per_second if video_grid_thw is not None else None}


class Qwen3VisionTower(Qwen25VisionTower):
    """Qwen3-VL: Qwen2.5-VL's inputs and placeholders, DeepStack features, and interleaved M-RoPE positions in which
    every video frame is its own item (``split_video_frames``: the processor puts timestamp text between frames, so
    time advances through the text and there is no ``second_per_grid_ts``)."""

    inputs = frozenset({"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"})

    def build(self, config: Any, attention_backend: str) -> nn.Module:
        return Qwen3VisionTransformer(config, attention_backend=attention_backend)

    def encode(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None, kind: str) -> Tensor:
        return self.encode_layers(encoder, pixels, grid_thw, kind)[0]

    def encode_layers(
        self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None, kind: str
    ) -> tuple[Tensor, list[Tensor]]:
        return encoder(pixels, _grid(grid_thw, kind))

    def video_timing(self, config: Any, video_grid_thw: Tensor | None) -> dict[str, Any]:
        """Every frame its own item: time advances through the timestamp text."""
        return {"split_video_frames": True}

    def training_flops(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None) -> float:
        """Every block attends over whole frames; the merger and the DeepStack mergers run once per merged token,
        the position table is a lookup."""
        c = encoder.config
        mergers = [encoder.merger, *encoder.deepstack_merger_list]
        merger = sum(p.numel() for m in mergers for p in m.parameters())
        table = encoder.pos_embed.weight.numel()
        per_patch = sum(p.numel() for p in encoder.parameters()) - merger - table
        num_patches = pixels.shape[0]
        flops = 6.0 * (per_patch * num_patches + merger * num_patches / c.spatial_merge_size**2)
        for t, h, w in [] if grid_thw is None else grid_thw.tolist():
            flops += 12.0 * c.hidden_size * c.num_layers * t * (h * w) ** 2
        return flops


class SiglipVisionTower(VisionTower):
    """LLaVA with SigLIP: whole fixed-size images ``[num_images, 3, H, W]``, ``tokens_per_image`` ``<image>``
    tokens each, 1-D positions ``0 .. S-1`` on every row (as transformers' LLaVA gives its LLM, padding or not)."""

    # image_sizes: what LLaVA processors return beside the pixels; every SigLIP image is resized to image_size and
    # gives the same tokens, so it changes nothing (accepted so that a processor's output can be passed whole).
    inputs = frozenset({"pixel_values", "image_sizes"})

    def build(self, config: Any, attention_backend: str) -> nn.Module:
        # Equal-size images are a dense batch: SDPA without a mask, so there is no attention backend to choose.
        return SiglipVisionTransformer(config)

    def per_image(self, config: Any) -> str:
        """How one image's feature count is written, for the placeholder-count error."""
        v = config.vision
        class_token = " + 1 (the class token)" if v.CLASS_TOKEN else ""
        dropped = (
            " - 1 (vision.feature_select_strategy 'default')"
            if v.feature_select_strategy == "default"
            else ""
        )
        return f"(image_size // patch_size) ** 2{class_token}{dropped}"

    def placeholder(self, kind: str) -> str:
        return "<image>"

    def encode(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None, kind: str) -> Tensor:
        return encoder(pixels).flatten(0, 1)  # [num_images * tokens_per_image, out_hidden_size]

    def blocks(self, encoder: nn.Module) -> list[nn.Module]:
        return list(encoder.encoder.layers)

    def unused_modules(self, encoder: nn.Module) -> list[str]:
        """``post_layernorm`` and the layers after the deepest feature layer (LLaVA reads hidden states before the
        final norm)."""
        c = encoder.config
        deepest = max(check_layers(c.feature_layers, c.num_layers, "vision.feature_layer"))
        return ["post_layernorm", *(f"encoder.layers.{i}" for i in range(deepest, c.num_layers))]

    def training_flops(self, encoder: nn.Module, pixels: Tensor, grid_thw: Tensor | None) -> float:
        """Only the layers up to the deepest feature layer run; the position table is a lookup, not a matmul."""
        c = encoder.config
        layers = max(check_layers(c.feature_layers, c.num_layers, "vision.feature_layer"))
        per_layer = sum(p.numel() for p in encoder.encoder.layers[0].parameters())
        patch_embed = sum(p.numel() for p in encoder.embeddings.patch_embedding.parameters())
        tokens = pixels.shape[0] * c.num_tokens
        flops = 6.0 * (layers * per_layer + patch_embed) * tokens
        return flops + 12.0 * c.hidden_size * layers * c.num_tokens**2 * pixels.shape[0]

    def describe_count(self, config: Any, kind: str, pixels: Tensor, num_features: int) -> str:
        v = config.vision
        return (
            f"pixel_values give {num_features} image features ({pixels.shape[0]} images x {v.tokens_per_image}: "
            f"{self.per_image(config)})"
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


class ClipVisionTower(SiglipVisionTower):
    """LLaVA-1.5 with CLIP: SigLIP's inputs and positions; each image's tokens start with CLIP's class token, which
    ``feature_select_strategy: default`` drops."""

    def build(self, config: Any, attention_backend: str) -> nn.Module:
        return ClipVisionTransformer(config)


class AnyResVisionTower(SiglipVisionTower):
    """LLaVA-OneVision: the SigLIP tower over every image's tiles (``pixel_values`` ``[num_tiles, 3, S, S]``, or
    ``[num_images, max_tiles, 3, S, S]`` as its processor pads them) laid out by ``image_sizes`` and
    ``batch_num_images`` (the images of multi-image samples are their base tile alone); after the projector each
    image's features are packed with ``image_newline``
    (:func:`~forge_lightning.modules.vlm.anyres.pack_image`). Videos ``pixel_values_videos [videos, frames, 3, S,
    S]``: every frame through the tower and the projector, pooled 2 x 2, one ``image_newline`` per video
    (:func:`~forge_lightning.modules.vlm.anyres.pack_video`). 1-D positions, as LLaVA's."""

    kinds = ("image", "video")
    inputs = frozenset({"pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos"})
    fixed_image_tokens = False
    grid_inputs = {"image": "image_sizes"}

    def placeholder(self, kind: str) -> str:
        return f"<{kind}>"

    def layout(self, kind: str, inputs: Mapping[str, Any]) -> ImageLayout | int | None:
        """Images: their :class:`~forge_lightning.modules.vlm.anyres.ImageLayout` (``image_sizes`` and
        ``batch_num_images``); videos: their number (every frame is one tile)."""
        pixels = inputs.get(_PIXELS[kind])
        if pixels is None:
            return None
        if kind == "video":
            return pixels.shape[0]
        return image_layout(inputs.get("image_sizes"), inputs.get("batch_num_images"))

    def encode(self, encoder: nn.Module, pixels: Tensor, grid_thw: Any, kind: str) -> Tensor:
        tiles = self._tiles(encoder, pixels, grid_thw, kind)
        return encoder(tiles)  # [num_tiles or num_videos * num_frames, T, out_hidden_size]

    def _tiles(self, encoder: nn.Module, pixels: Tensor, layout: Any, kind: str) -> Tensor:
        """The ``[N, 3, S, S]`` tiles (images) or frames (videos) the tower encodes."""
        if kind == "image":
            return stack_tiles(encoder.config, pixels, layout)
        if pixels.ndim != 5:
            raise ValueError(
                f"pixel_values_videos must be [num_videos, num_frames, 3, image_size, image_size], got shape "
                f"{list(pixels.shape)}"
            )
        return pixels.flatten(0, 1)

    def arrange(self, config: Any, projector: nn.Module, features: Tensor, grid: Any, kind: str) -> Tensor:
        newline = projector.image_newline
        if kind == "video":  # grid: the number of videos, features [videos * frames, T, D]
            videos = features.unflatten(0, (grid, -1))
            return torch.cat([pack_video(config.vision, f, newline) for f in videos])
        images = features.split(tile_counts(config.vision, grid))
        return torch.cat(
            [
                pack_image(config.vision, f, size, newline, tiled)
                for f, size, tiled in zip(images, grid.sizes, grid.tiled)
            ]
        )

    def training_flops(self, encoder: nn.Module, pixels: Tensor, grid_thw: Any) -> float:
        """SigLIP's, over the tiles the images have (padding tiles are not encoded) or the videos' frames."""
        kind = "image" if isinstance(grid_thw, ImageLayout) else "video"
        return super().training_flops(encoder, self._tiles(encoder, pixels, grid_thw, kind), None)

    def describe_count(self, config: Any, kind: str, pixels: Tensor, num_features: int) -> str:
        if kind == "video":
            videos, frames = pixels.shape[:2]
            return (
                f"pixel_values_videos give {num_features} video features ({videos} video(s) of {frames} frames: "
                f"{num_video_tokens(config.vision, frames)} each, ceil((image_size // patch_size) / 2) ** 2 per "
                "frame and one image_newline)"
            )
        return (
            f"image_sizes give {num_features} image features (per image: the base tile's (image_size // "
            "patch_size) ** 2, then each row of its unpadded tile features and an image_newline; in samples of "
            "several images (batch_num_images) the base tile's and one image_newline)"
        )


_PIXELS = {"image": "pixel_values", "video": "pixel_values_videos"}


def _spans(length: int, size: int) -> list[int]:
    """Lengths of the pieces of ``length`` cut every ``size`` (the last one shorter)."""
    return [min(size, length - start) for start in range(0, length, size)]


def _grid(grid_thw: Tensor | None, kind: str) -> Tensor:
    if grid_thw is None:
        raise ValueError(f"{kind} pixels need their {kind}_grid_thw")
    return grid_thw


TOWERS: dict[str, VisionTower] = {
    "qwen2_5_vit": Qwen25VisionTower(),
    "qwen3_vit": Qwen3VisionTower(),
    "siglip": SiglipVisionTower(),
    "clip": ClipVisionTower(),
    "siglip_anyres": AnyResVisionTower(),
}
"""The tower of each ``vision.type`` (the keys of :data:`~forge_lightning.modules.vlm.config.VISION_TYPES`)."""

"""The vision-language model (Qwen2.5-VL) as a plain ``nn.Module``: the vision encoder's merged patch features
take the place of the placeholder tokens in the LLM's input embeddings::

    input_ids ─ llm.model.embed_tokens ─────────────┐
    pixel_values(_videos), grid_thw ─ vision ───────┴─ features at <|image_pad|> / <|video_pad|> ─ [B, S, D]
    input_ids, grids ─ get_rope_index ─ [3, B, S] ─────── llm (decoder layers, norm, lm_head) ─ logits [B, S, V]

Submodules: ``vision`` (the encoder, projector included: its patch merger maps to the LLM width) and ``llm``
(:class:`~forge_lightning.modules.llm.DecoderLM`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from forge_lightning.modules.llm.model import DecoderLM
from forge_lightning.modules.vlm.config import VLMConfig
from forge_lightning.modules.vlm.positions import get_rope_index
from forge_lightning.modules.vlm.qwen2_5_vit import Qwen25VisionTransformer

VISION_ENCODERS: dict[str, type[nn.Module]] = {"qwen2_5_vit": Qwen25VisionTransformer}
"""Encoder classes by ``vision.type`` (see :data:`forge_lightning.modules.vlm.config.VISION_TYPES`)."""


class VisionLanguageModel(nn.Module):
    """A vision encoder feeding a decoder LM (Qwen2.5-VL), with transformers' parameter layout below ``vision`` and
    ``llm`` (see :mod:`forge_lightning.modules.vlm.hf` for the checkpoint names).

    Args:
        config: the model's configuration.
        attention_backend: kernel for the encoder's and the LLM's attention (see
            ``forge_lightning.modules.layers.attention``).
    """

    def __init__(self, config: VLMConfig, *, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.vision = VISION_ENCODERS[config.vision_type](config.vision, attention_backend=attention_backend)
        self.llm = DecoderLM(config.llm, attention_backend=attention_backend)

    def position_ids(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        second_per_grid_ts: Tensor | Sequence[float] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(position_ids [3, B, S], rope_deltas [B, 1])`` of a batch (see
        :func:`~forge_lightning.modules.vlm.positions.get_rope_index`)."""
        c = self.config
        return get_rope_index(
            input_ids,
            image_token_id=c.image_token_id,
            video_token_id=c.video_token_id,
            spatial_merge_size=c.vision.spatial_merge_size,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
            tokens_per_second=c.tokens_per_second if video_grid_thw is not None else None,
            attention_mask=attention_mask,
        )

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        pixel_values_videos: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        second_per_grid_ts: Tensor | Sequence[float] | None = None,
    ) -> Tensor:
        """Logits ``[B, S, vocab]``; the arguments are those transformers' processor gives (see
        :meth:`hidden_states`)."""
        hidden_BSD = self.hidden_states(
            input_ids,
            attention_mask,
            pixel_values,
            image_grid_thw,
            pixel_values_videos,
            video_grid_thw,
            second_per_grid_ts,
        )
        return self.llm.lm_head(hidden_BSD)

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        pixel_values_videos: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        second_per_grid_ts: Tensor | Sequence[float] | None = None,
    ) -> Tensor:
        """The LLM's final hidden states ``[B, S, hidden]`` (after its last norm; the loss applies ``lm_head``).

        Args:
            input_ids: ``[B, S]`` tokens, one ``<|image_pad|>`` / ``<|video_pad|>`` per merged patch.
            attention_mask: ``[B, S]``, 0 at padding (left or right).
            pixel_values: ``[num_patches, patch_dim]`` patches of the images, in order over the batch.
            image_grid_thw: ``[num_images, 3]`` patch grids of the images.
            pixel_values_videos: ``[num_patches, patch_dim]`` patches of the videos.
            video_grid_thw: ``[num_videos, 3]`` patch grids of the videos.
            second_per_grid_ts: seconds per temporal grid step of each video (default 1).

        Raises:
            ValueError: the number of placeholder tokens differs from the number of features of their images or
                videos (both named).
        """
        c = self.config
        x_BSD = self.llm.model.embed_tokens(input_ids)
        x_BSD = self._insert(x_BSD, input_ids == c.image_token_id, pixel_values, image_grid_thw, "image")
        x_BSD = self._insert(
            x_BSD, input_ids == c.video_token_id, pixel_values_videos, video_grid_thw, "video"
        )
        position_ids_3BS, _ = self.position_ids(
            input_ids, attention_mask, image_grid_thw, video_grid_thw, second_per_grid_ts
        )
        mask_B11S = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        return self.llm.hidden_states(None, position_ids_3BS, inputs_embeds=x_BSD, attention_mask=mask_B11S)

    def _insert(
        self, x_BSD: Tensor, slots_BS: Tensor, pixels: Tensor | None, grid_thw: Tensor | None, kind: str
    ) -> Tensor:
        """``x_BSD`` with the encoder's features of ``pixels`` at the placeholder positions ``slots_BS``."""
        num_slots = int(slots_BS.sum())
        if pixels is None:
            if num_slots:
                raise ValueError(
                    f"input_ids hold {num_slots} <|{kind}_pad|> tokens but no {kind} pixels were given "
                    f"({'pixel_values' if kind == 'image' else 'pixel_values_videos'})"
                )
            return x_BSD
        if grid_thw is None:
            raise ValueError(f"{kind} pixels need their {kind}_grid_thw")
        features_ND = self.vision(pixels, grid_thw).to(x_BSD.dtype)
        if features_ND.shape[0] != num_slots:
            raise ValueError(
                f"{kind}_grid_thw gives {features_ND.shape[0]} merged {kind} tokens (t * h * w / "
                f"spatial_merge_size ** 2 per {kind}), so input_ids must hold {features_ND.shape[0]} "
                f"<|{kind}_pad|> tokens ({kind}_token_id), but {num_slots} were found"
            )
        return x_BSD.index_put((slots_BS,), features_ND)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise both components (e.g. after ``to_empty``)."""
        self.vision.init_weights()
        self.llm.init_weights()

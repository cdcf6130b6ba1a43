"""The vision-language model as a plain ``nn.Module``: the projected features of the vision encoder take the place
of the placeholder tokens in the LLM's input embeddings::

    input_ids ─ llm.model.embed_tokens ───────────────────────────┐
    pixels (+ grids) ─ vision ─ projector ─ features at the image / video placeholders ─ [B, S, D]
    input_ids (+ grids) ─ tower positions ─ [3, B, S] (Qwen-VL) or [B, S] ─ llm (layers, norm) ─ [B, S, D]
                                                                              ─ lm_head ─ logits [B, S, V]

Qwen3-VL's encoder also gives DeepStack features of earlier encoder blocks: they are added to the LLM's hidden
states at the same placeholders after each of its first decoder layers (``layer_residuals`` of
:meth:`~forge_lightning.modules.llm.DecoderLM.hidden_states`).

Submodules: ``vision`` (the encoder), ``projector`` (``nn.Identity`` when the encoder ends in the LLM's width, as
the Qwen-VL patch mergers do; LLaVA's MLP otherwise) and ``llm`` (:class:`~forge_lightning.modules.llm.DecoderLM`).
What differs between encoder types (inputs, placeholder tokens, positions) is their
:class:`~forge_lightning.modules.vlm.towers.VisionTower`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers.attention import KVCache
from forge_lightning.modules.llm.model import DecoderLM
from forge_lightning.modules.vlm.config import VLMConfig
from forge_lightning.modules.vlm.towers import TOWERS

_PIXELS = {"image": "pixel_values", "video": "pixel_values_videos"}


class VisionLanguageModel(nn.Module):
    """A vision encoder and projector feeding a decoder LM (Qwen2.5-VL, Qwen3-VL, LLaVA), with transformers'
    parameter layout below ``vision``, ``projector`` and ``llm`` (see :mod:`forge_lightning.modules.vlm.hf` for the
    checkpoint names).

    Args:
        config: the model's configuration.
        attention_backend: kernel for the LLM's and the Qwen-VL encoders' packed attention (see
            ``forge_lightning.modules.layers.attention``); SigLIP's dense image batches always run SDPA.
    """

    def __init__(self, config: VLMConfig, *, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.tower = TOWERS[config.vision_type]
        self.vision = self.tower.build(config.vision, attention_backend)
        self.projector = config.projector.build(
            config.vision.out_hidden_size, config.llm.hidden_size, init_std=config.llm.initializer_range
        )
        self.llm = DecoderLM(config.llm, attention_backend=attention_backend)

    def position_ids(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        second_per_grid_ts: Tensor | Sequence[float] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(position_ids, rope_deltas [B, 1])`` of a batch: ``[3, B, S]`` multimodal RoPE positions for Qwen2.5-VL
        (see :func:`~forge_lightning.modules.vlm.positions.get_rope_index`), ``[B, S]`` for LLaVA."""
        return self.tower.positions(
            self.config, input_ids, attention_mask, image_grid_thw, video_grid_thw, second_per_grid_ts
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
        image_sizes: Tensor | None = None,
        document_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        batch_num_images: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[B, S, vocab]``; the arguments are those transformers' processor gives, plus packed rows'
        ``document_ids`` / ``position_ids`` (see :meth:`hidden_states`)."""
        hidden_BSD = self.hidden_states(
            input_ids,
            attention_mask,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            pixel_values_videos=pixel_values_videos,
            video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
            image_sizes=image_sizes,
            document_ids=document_ids,
            position_ids=position_ids,
            batch_num_images=batch_num_images,
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
        image_sizes: Tensor | None = None,
        document_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: list[KVCache] | None = None,
        batch_num_images: Tensor | None = None,
    ) -> Tensor:
        """The LLM's final hidden states ``[B, S, hidden]`` (after its last norm; the loss applies ``lm_head``).

        Args:
            input_ids: ``[B, S]`` tokens, one image placeholder (``image_token_id``) per image feature and, for
                Qwen-VL, one ``<|video_pad|>`` per merged video patch (Qwen3-VL: in one run per frame, the runs
                separated by the processor's timestamp text).
            attention_mask: ``[B, S]``, 0 at padding (right padding is tested).
            pixel_values: the images, in order over the batch: Qwen-VL ``[num_patches, patch_dim]`` patches,
                LLaVA ``[num_images, 3, image_size, image_size]``.
            image_grid_thw: Qwen-VL: ``[num_images, 3]`` patch grids of the images.
            pixel_values_videos: Qwen-VL: ``[num_patches, patch_dim]`` patches of the videos; LLaVA-OneVision:
                ``[num_videos, num_frames, 3, image_size, image_size]`` frames.
            video_grid_thw: Qwen-VL: ``[num_videos, 3]`` patch grids of the videos.
            second_per_grid_ts: Qwen2.5-VL: seconds per temporal grid step of each video (default 1); Qwen3-VL
                times its frames with timestamp text instead and refuses it.
            image_sizes: LLaVA: ``[num_images, 2]`` (height, width) as its processors return it. LLaVA-OneVision
                tiles each image by it (and takes ``pixel_values`` as every image's tiles, see
                :class:`~forge_lightning.modules.vlm.towers.AnyResVisionTower`); for LLaVA every image is resized
                to ``image_size``, so it changes nothing (accepted so that a processor's output passes whole).
            document_ids: packed rows: ``[B, S]`` non-decreasing document index of each token; the LLM attends within
                each document and positions restart at each (the images and videos are those of the documents in
                order). Takes no ``attention_mask``: padding is a document of its own.
            position_ids: the LLM positions (``[3, B, S]`` Qwen-VL, ``[B, S]`` LLaVA), e.g. computed per sample
                by the data pipeline; default: computed here (per document when ``document_ids`` are given).
            batch_num_images: LLaVA-OneVision: ``[num_samples]`` images per sample, as its processor returns it: the
                images of samples with more than one are not tiled (their base tile alone, one newline).
            kv_cache: the LLM's empty per-layer caches (``llm.init_kv_cache``) to prefill with this prompt for
                generation; decoding then continues on ``llm`` at positions shifted by the rope deltas of
                :meth:`position_ids`.

        Raises:
            ValueError: an argument the encoder type does not take, or the number of placeholder tokens differs from
                the number of features of their images or videos (both named).
        """
        inputs = {
            "pixel_values": pixel_values,
            "image_grid_thw": image_grid_thw,
            "pixel_values_videos": pixel_values_videos,
            "video_grid_thw": video_grid_thw,
            "second_per_grid_ts": second_per_grid_ts,
            "image_sizes": image_sizes,
            "batch_num_images": batch_num_images,
        }
        self._check_inputs(**inputs)
        x_BSD = self.llm.model.embed_tokens(input_ids)
        deepstack: list[Tensor] = []  # [B, S, D] per decoder layer: zero but at the placeholders
        for kind in self.tower.kinds:
            pixels, grid = inputs[_PIXELS[kind]], self.tower.layout(kind, inputs)
            x_BSD, layers = self._insert(x_BSD, input_ids, kind, pixels, grid)
            if layers:  # image and video placeholders differ, so their sum holds each at its own tokens
                deepstack = [a + b for a, b in zip(deepstack, layers)] if deepstack else layers
        if document_ids is not None and attention_mask is not None:
            raise ValueError(
                "document_ids (packed rows) take no attention_mask: give the padding a document id of its own"
            )
        grids = (image_grid_thw, video_grid_thw, second_per_grid_ts)
        if position_ids is None and document_ids is not None:
            position_ids = self.tower.packed_positions(self.config, input_ids, document_ids, *grids)
        elif position_ids is None:
            position_ids, _ = self.position_ids(input_ids, attention_mask, *grids)
        mask_B11S = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        return self.llm.hidden_states(
            None,
            position_ids,
            inputs_embeds=x_BSD,
            attention_mask=mask_B11S,
            document_ids=document_ids,
            kv_cache=kv_cache,
            layer_residuals=deepstack or None,
        )

    def _check_inputs(self, **inputs: object) -> None:
        given = sorted(name for name, value in inputs.items() if value is not None)
        refused = [name for name in given if name not in self.tower.inputs]
        if refused:
            raise ValueError(
                f"vision.type {self.config.vision_type!r} does not take {', '.join(refused)}; it takes "
                f"{', '.join(sorted(self.tower.inputs))}"
            )

    def _insert(
        self, x_BSD: Tensor, input_ids: Tensor, kind: str, pixels: Tensor | None, grid_thw: Tensor | None
    ) -> tuple[Tensor, list[Tensor]]:
        """``x_BSD`` with the projected features of ``pixels`` at the placeholder tokens of ``kind``, and the
        tower's per-layer features (DeepStack) at the same tokens, ``[B, S, D]`` each, zero elsewhere."""
        slots_BS = input_ids == getattr(self.config, f"{kind}_token_id")
        num_slots, name = int(slots_BS.sum()), self.tower.placeholder(kind)
        if pixels is None:
            if num_slots:
                raise ValueError(
                    f"input_ids hold {num_slots} {name} tokens but no {kind} pixels were given ({_PIXELS[kind]})"
                )
            return x_BSD, []
        features, layers_ND = self.tower.encode_layers(self.vision, pixels, grid_thw, kind)
        features_ND = self.tower.arrange(
            self.config, self.projector, self.projector(features), grid_thw, kind
        )
        features_ND = features_ND.to(x_BSD.dtype)
        num_features = features_ND.shape[0]
        if num_features != num_slots:
            origin = self.tower.describe_count(self.config, kind, pixels, num_features)
            raise ValueError(
                f"{origin}, so input_ids must hold {num_features} {name} tokens ({kind}_token_id), but {num_slots} "
                "were found"
            )
        layers = [x_BSD.new_zeros(x_BSD.shape).index_put((slots_BS,), f.to(x_BSD.dtype)) for f in layers_ND]
        return x_BSD.index_put((slots_BS,), features_ND), layers

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every component (e.g. after ``to_empty``)."""
        self.vision.init_weights()
        if hasattr(self.projector, "reset_parameters"):
            self.projector.reset_parameters()
        self.llm.init_weights()

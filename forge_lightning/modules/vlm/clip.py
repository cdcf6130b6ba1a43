"""The CLIP vision tower (Radford et al. 2021, arXiv:2103.00020) as LLaVA-1.5 uses it: SigLIP's layers
(:mod:`~forge_lightning.modules.vlm.siglip`) behind another embedding::

    pixel_values [N, C, S, S]
      ─ embeddings: [class_embedding, Conv2d patches (no bias)] ─ [N, 1 + T, hidden] + learned positions
      ─ pre_layrnorm                                                        (transformers' hidden_states[0])
      ─ [EncoderLayer] x num_layers: SigLIP's, with quick_gelu by default

The class token leads each image's tokens, so ``feature_select_strategy: default`` (LLaVA-1.5's) drops exactly it.
``post_layernorm`` normalises only the pooled class token (``CLIPVisionModel.pooler_output``), which LLaVA does not
use; it is built so that checkpoints load exactly, and it gets no gradient. Parameter names are transformers'
``CLIPVisionModel`` names (``pre_layrnorm`` keeps its spelling); checkpoints of ``CLIPModel`` and transformers 4
keep them below ``vision_model.``, the text tower and projections are left out on load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from forge_lightning.modules.vlm.siglip import PRESETS as SIGLIP_PRESETS
from forge_lightning.modules.vlm.siglip import SiglipVisionConfig, SiglipVisionTransformer

HF_MODEL_TYPE = "clip_vision_model"

# transformers' CLIPVisionConfig defaults: old config.json files leave out the keys that have them.
_HF_DEFAULTS: dict[str, Any] = {
    **SiglipVisionConfig.HF_DEFAULTS,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}

PRESETS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/openai/clip-vit-large-patch14-336/blob/main/config.json (vision_config), LLaVA-1.5's
    "clip-vit-large-patch14-336": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_layers": 24,
        "num_heads": 16,
        "image_size": 336,
        "patch_size": 14,
    },
    "debug": SIGLIP_PRESETS["debug"],  # the tiny test tower: the same sizes
}
"""CLIP tower sizes by name (``ClipVisionConfig.from_preset``)."""


@dataclass(kw_only=True)
class ClipVisionConfig(SiglipVisionConfig):
    """Architecture of the CLIP vision tower (a ``clip_vision_model`` ``vision_config``) and the hidden states LLaVA
    takes from it.

    The fields are :class:`~forge_lightning.modules.vlm.siglip.SiglipVisionConfig`'s, with CLIP's defaults
    (``quick_gelu``, ``layer_norm_eps`` 1e-5) and LLaVA-1.5's selection (``feature_layer`` -2,
    ``feature_select_strategy`` ``default``: the class token dropped); each image has ``num_patches + 1`` tokens.
    """

    NAME: ClassVar[str] = "CLIP"
    HF_MODEL_TYPE: ClassVar[str] = HF_MODEL_TYPE
    HF_DEFAULTS: ClassVar[Mapping[str, Any]] = _HF_DEFAULTS
    HF_EXTRA: ClassVar[Mapping[str, Any]] = {}
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = PRESETS
    CLASS_TOKEN: ClassVar[bool] = True

    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    feature_layer: int | list[int] = -2
    feature_select_strategy: str = "default"


class ClipEmbeddings(nn.Module):
    """A learned class token before the patch embeddings (a strided ``Conv2d`` without bias), plus one learned
    position embedding per token.

    Args:
        config: the tower's configuration.
    """

    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.in_channels, config.hidden_size, config.patch_size, stride=config.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(config.num_tokens, config.hidden_size)

    def reset_parameters(self) -> None:
        # As transformers initialises CLIP (initializer_range 0.02 for the patches and positions).
        nn.init.normal_(self.class_embedding, std=self.class_embedding.numel() ** -0.5)
        nn.init.normal_(self.patch_embedding.weight, std=0.02)
        nn.init.normal_(self.position_embedding.weight, std=0.02)

    def forward(self, pixel_values_NCHW: Tensor) -> Tensor:
        """``[N, C, S, S]`` images to ``[N, 1 + T, hidden]``: the class token, then the patches in raster order."""
        weight = self.patch_embedding.weight
        patches_NTD = self.patch_embedding(pixel_values_NCHW.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls_N1D = self.class_embedding.to(patches_NTD.dtype).expand(patches_NTD.shape[0], 1, -1)
        return torch.cat([cls_N1D, patches_NTD], dim=1) + self.position_embedding.weight


class ClipVisionTransformer(SiglipVisionTransformer):
    """The CLIP vision tower: SigLIP's encoder layers after :class:`ClipEmbeddings` and ``pre_layrnorm``.

    Args:
        config: the tower's configuration.
        init: initialise the weights (:meth:`init_weights`).
    """

    embeddings_type = ClipEmbeddings

    def __init__(self, config: ClipVisionConfig, *, init: bool = True) -> None:
        super().__init__(config, init=False)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if init:
            self.init_weights()

    def embed(self, pixel_values: Tensor) -> Tensor:
        return self.pre_layrnorm(self.embeddings(pixel_values))

    def last_hidden_state(self, pixel_values: Tensor) -> Tensor:
        """The last layer's output ``[N, 1 + T, hidden]`` (``CLIPVisionModel``'s ``last_hidden_state``: CLIP applies
        ``post_layernorm`` to the pooled class token only)."""
        return self.hidden_states(pixel_values, [-1])[0]

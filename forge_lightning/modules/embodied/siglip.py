"""PaliGemma's image path in Pi0.5: image preprocessing, the SigLIP vision tower, a linear projector into the
backbone's width.

::

    image [B,3,H,W] in [0,1] ─ resize_with_pad ─ *2-1 ─ SigLIP tower (last layer, post_layernorm)
        ─ projector ─ tokens [B, num_patches, llm width]

The tower is the VLM family's :class:`~forge_lightning.modules.vlm.siglip.SiglipVisionTransformer` (written on the
shared attention kernel, with transformers' ``SiglipVisionModel`` parameter names below ``vision.tower.``), so the
checkpoint layout does not depend on the installed transformers release. The lerobot / openpi names are mapped in
:mod:`forge_lightning.modules.embodied.checkpoint`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.modules.embodied.config import SiglipConfig
from forge_lightning.modules.layers import init_linear
from forge_lightning.modules.vlm.siglip import SiglipVisionTransformer


def resize_with_pad(images_BCHW: Tensor, size: int) -> Tensor:
    """Fit float images in ``[0, 1]`` into ``size x size`` keeping their aspect ratio, padding with black.

    The longer side is scaled to ``size`` (bilinear), the shorter one rounded down, and the rest padded
    equally on both sides (one extra row / column at the bottom / right), as openpi prepares its images.

    Args:
        images_BCHW: ``[B, C, H, W]`` floats in ``[0, 1]``.
        size: side of the square output.
    """
    height, width = images_BCHW.shape[-2:]
    if (height, width) == (size, size):
        return images_BCHW
    ratio = max(width / size, height / size)
    new_h, new_w = int(height / ratio), int(width / ratio)
    resized = F.interpolate(images_BCHW, size=(new_h, new_w), mode="bilinear", align_corners=False)
    top, left = (size - new_h) // 2, (size - new_w) // 2
    return F.pad(resized.clamp(0.0, 1.0), (left, size - new_w - left, top, size - new_h - top), value=0.0)


def preprocess_images(images_BCHW: Tensor, size: int) -> Tensor:
    """Camera frames in ``[0, 1]`` to SigLIP's input: resized with padding to ``size`` and scaled to ``[-1, 1]``."""
    return resize_with_pad(images_BCHW.float(), size) * 2.0 - 1.0


class PaliGemmaVision(nn.Module):
    """The SigLIP tower (no pooling head) and the linear projector to the backbone's width: one token per patch.

    Initialised with openpi's scheme rather than SigLIP's own (see :meth:`reset_parameters`).

    Args:
        config: the tower's configuration.
        out_features: width of the backbone the tokens are fed to.
        init_std: standard deviation of the normal initialisation of the linear and position weights.
    """

    def __init__(self, config: SiglipConfig, out_features: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.config = config
        self.init_std = init_std
        self.tower = SiglipVisionTransformer(config, init=False)
        self.projector = nn.Linear(config.hidden_size, out_features)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every linear layer (the tower's and the projector) ``N(0, init_std)`` with a zero bias, the position
        embedding ``N(0, init_std)``; the patch embedding and the norms keep torch's initialisation."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                init_linear(module, self.init_std)
        nn.init.normal_(self.tower.embeddings.position_embedding.weight, std=self.init_std)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter, e.g. after ``to_empty``: :meth:`reset_parameters`, then torch's
        initialisation for the patch embedding and the norms."""
        self.reset_parameters()
        for module in self.tower.modules():
            if isinstance(module, (nn.Conv2d, nn.LayerNorm)):
                module.reset_parameters()

    def forward(self, images_BCHW: Tensor) -> Tensor:
        """Tokens ``[B, num_patches, out_features]`` of preprocessed images ``[B, 3, size, size]`` in ``[-1, 1]``."""
        return self.projector(self.tower.last_hidden_state(images_BCHW))

"""PaliGemma's image path: SigLIP vision tower, linear projector into the backbone's width, image preprocessing.

::

    image [B,3,H,W] in [0,1] ─ resize_with_pad ─ *2-1 ─ patch_embedding ─ + position_embedding
        ─ [SiglipLayer] x num_layers ─ post_layernorm ─ projector ─ tokens [B, num_patches, llm width]

Written on the shared attention kernel rather than taken from transformers: transformers renamed the modules of
``SiglipVisionModel`` between releases (``vision_model.encoder.layers`` in 5.5, ``encoder.layers`` in later
5.x), and the checkpoint layout must not depend on the installed version. Parameter names inside a layer
follow the checkpoints (``layer_norm1``, ``self_attn.{q,k,v,out}_proj``, ``layer_norm2``, ``mlp.fc1/fc2``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.modules.embodied.config import SiglipConfig
from forge_lightning.modules.layers import attention, init_linear


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


class SiglipAttention(nn.Module):
    """Bidirectional multi-head self-attention with biased projections (SigLIP).

    Args:
        hidden_size: width.
        num_heads: attention heads.
    """

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x_BSD: Tensor) -> Tensor:
        B, S, _ = x_BSD.shape
        q, k, v = (
            proj(x_BSD).view(B, S, -1, self.head_dim).transpose(1, 2)  # [B, heads, S, head_dim]
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out_BHSD = attention(q, k, v, causal=False)
        return self.out_proj(out_BHSD.transpose(1, 2).reshape(B, S, -1))


class SiglipMLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``.

    Args:
        hidden_size: width.
        intermediate_size: hidden width.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(nn.Module):
    """Pre-LayerNorm ViT block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Args:
        config: the tower's configuration.
    """

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config.hidden_size, config.num_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x_BSD: Tensor) -> Tensor:
        x_BSD = x_BSD + self.self_attn(self.layer_norm1(x_BSD))
        return x_BSD + self.mlp(self.layer_norm2(x_BSD))


class PaliGemmaVision(nn.Module):
    """SigLIP tower (no pooling head) and the linear projector to the backbone's width: one token per patch.

    Args:
        config: the tower's configuration.
        out_features: width of the backbone the tokens are fed to.
        init_std: standard deviation of the normal initialisation of the linear weights.
    """

    def __init__(self, config: SiglipConfig, out_features: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.config = config
        self.init_std = init_std
        width = config.hidden_size
        self.patch_embedding = nn.Conv2d(3, width, kernel_size=config.patch_size, stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.num_patches, width)
        self.layers = nn.ModuleList(SiglipLayer(config) for _ in range(config.num_layers))
        self.post_layernorm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.projector = nn.Linear(width, out_features)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                init_linear(module, self.init_std)
        nn.init.normal_(self.position_embedding.weight, std=self.init_std)

    def forward(self, images_BCHW: Tensor) -> Tensor:
        """Tokens ``[B, num_patches, out_features]`` of preprocessed images ``[B, 3, size, size]`` in ``[-1, 1]``."""
        dtype = self.patch_embedding.weight.dtype
        patches_BDhw = self.patch_embedding(images_BCHW.to(dtype))
        x_BTD = patches_BDhw.flatten(2).transpose(1, 2) + self.position_embedding.weight
        for layer in self.layers:
            x_BTD = layer(x_BTD)
        return self.projector(self.post_layernorm(x_BTD))

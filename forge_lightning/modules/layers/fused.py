"""Layers whose forward runs a Triton kernel from ``forge_lightning.kernels``, with the plain layers' parameters.

They are never built directly: the performance transform (``forge_lightning.performance.apply_kernels``) switches
the class of existing :class:`RMSNorm` / :class:`GatedMLP` / :class:`Attention` instances, so parameter names,
initialisation and checkpoints stay those of the plain layers, which remain the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from forge_lightning.kernels import apply_rope, rms_norm, swiglu
from forge_lightning.modules.layers.attention import Attention
from forge_lightning.modules.layers.mlp import GatedMLP
from forge_lightning.modules.layers.norms import RMSNorm


class FusedRMSNorm(RMSNorm):
    """:class:`RMSNorm` computed by the Triton RMSNorm kernel (one pass forward, one backward)."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, backend="triton")


class FusedGatedMLP(GatedMLP):
    """:class:`GatedMLP` whose ``silu(gate) * up`` is one Triton kernel (no saved ``silu(gate)``)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), backend="triton"))


class FusedRopeAttention(Attention):
    """:class:`Attention` whose rotary embedding of queries and keys is the Triton RoPE kernel."""

    def rotate(self, x_BSHD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # The layer's (cos, sin) cover one half of the head ([B, S, D/2]); the kernel takes the rotate-half
        # layout over the whole rotary width ([B, S, D]).
        return apply_rope(x_BSHD, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), backend="triton")


FUSED_LAYERS: dict[str, tuple[type, type]] = {
    "rms_norm": (RMSNorm, FusedRMSNorm),
    "swiglu": (GatedMLP, FusedGatedMLP),
    "rope": (Attention, FusedRopeAttention),
}
"""Kernel name -> (plain layer, its fused twin)."""

"""Triton kernels, each with a plain-torch reference and a dispatcher that picks one.

Every public function takes ``backend="auto" | "triton" | "torch"``: ``"auto"`` runs the Triton kernel on
CUDA tensors when triton imports and the torch reference elsewhere (CPU, XPU). See docs/kernels.md.
"""

from forge_lightning.kernels._dispatch import Backend, triton_available, use_triton
from forge_lightning.kernels.cross_entropy import fused_linear_cross_entropy
from forge_lightning.kernels.fp8 import dequantize_fp8, quantize_fp8
from forge_lightning.kernels.rms_norm import rms_norm
from forge_lightning.kernels.rope import apply_rope, rope_cos_sin
from forge_lightning.kernels.swiglu import swiglu

__all__ = [
    "Backend",
    "apply_rope",
    "dequantize_fp8",
    "fused_linear_cross_entropy",
    "quantize_fp8",
    "rms_norm",
    "rope_cos_sin",
    "swiglu",
    "triton_available",
    "use_triton",
]

"""Gradient clipping for fused optimizers under bf16 autocast."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer


class UnscaledGradientClipping:
    """LightningModule mixin: clip gradients with fused optimizers when nothing is loss-scaled.

    Lightning's mixed-precision plugin refuses to clip for any optimizer that can unscale gradients inside its
    ``step`` (fused AdamW), because under fp16 a ``GradScaler`` defers the unscale to that step and clipping
    before it would see scaled gradients. bf16 autocast has no scaler: the gradients are already true, so clipping
    them is exact. This runs the plugin's plain clipping in that case and Lightning's own path otherwise.
    """

    def configure_gradient_clipping(
        self,
        optimizer: Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        plugin = self.trainer.precision_plugin  # type: ignore[attr-defined]
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        self.clip_gradients(  # type: ignore[attr-defined]
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )

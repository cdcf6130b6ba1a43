"""``LMLoss``: the decoder LM's loss, defined once for the native model and its megatron-core twin.

Per trainable token (label != ``ignore_index``): the cross-entropy of the next token plus ``z_loss *
logsumexp(logits)^2``; per micro-batch: their sum and the number of trainable tokens, which
:class:`~forge_lightning.modules.objective.GlobalBatchLoss` turns into the global batch's token mean. The logits come
from the final hidden states and the output weight through the fused linear + cross-entropy kernel
(:func:`~forge_lightning.kernels.fused_linear_cross_entropy`), which never materialises the fp32 logits::

    native model, the twin at TP = 1     hidden [N, H], weight [V, H] ─ fused kernel ─ sum (or per token)
    the twin at TP > 1                   megatron's vocab-parallel cross-entropy + z_loss * lse^2, per token
                                         ─ LMLoss.reduce ─ sum over trainable tokens
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import Tensor

from forge_lightning.kernels import fused_linear_cross_entropy

if TYPE_CHECKING:
    from forge_lightning.performance import ResolvedPerformance


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMLoss:
    """Next-token cross-entropy (+ z-loss) over a micro-batch's trainable tokens.

    Args:
        ignore_index: label value of positions that predict nothing.
        z_loss: weight of ``logsumexp(logits)^2`` per trainable token.
        backend: the fused kernel's backend (``auto``, ``triton``, ``torch``: ``performance.kernels.cross_entropy``).
        fp8: the output head's GEMMs in FP8 (``performance.fp8.lm_head``).
        fast_accum: with ``fp8``, fast accumulation in the hidden-state gradient GEMM too.
    """

    ignore_index: int = -100
    z_loss: float = 0.0
    backend: str = "auto"
    fp8: bool = False
    fast_accum: bool = False

    @classmethod
    def for_run(
        cls, performance: ResolvedPerformance, *, ignore_index: int = -100, z_loss: float = 0.0
    ) -> LMLoss:
        """The loss with the run's resolved kernel settings (``performance.kernels.cross_entropy``,
        ``performance.fp8.lm_head`` / ``fast_accum``)."""
        fp8 = performance.fp8
        return cls(
            ignore_index=ignore_index,
            z_loss=z_loss,
            backend=performance.kernels["cross_entropy"],
            fp8=fp8 is not None and fp8.lm_head,
            fast_accum=fp8 is not None and fp8.fast_accum,
        )

    def __call__(self, hidden_NH: Tensor, weight_VH: Tensor, labels_N: Tensor) -> tuple[Tensor, Tensor]:
        """``(sum of the trainable tokens' losses, their count)`` from hidden states ``[N, H]``, the output weight
        ``[V, H]`` and labels ``[N]``."""
        loss = self._fused(hidden_NH, weight_VH, labels_N, "sum")
        return loss, (labels_N != self.ignore_index).sum()

    def per_token(self, hidden_NH: Tensor, weight_VH: Tensor, labels_N: Tensor) -> Tensor:
        """Each token's loss ``[N]`` (fp32; 0 where ``labels`` is ``ignore_index``)."""
        return self._fused(hidden_NH, weight_VH, labels_N, "none")

    def reduce(self, losses: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``(sum, count)`` of per-token ``losses`` over the positions whose ``labels`` are trainable (any shape,
        the same for both)."""
        mask = labels != self.ignore_index
        return (losses.float() * mask).sum(), mask.sum()

    def _fused(self, hidden_NH: Tensor, weight_VH: Tensor, labels_N: Tensor, reduction: str) -> Tensor:
        return fused_linear_cross_entropy(
            hidden_NH,
            weight_VH,
            labels_N,
            ignore_index=self.ignore_index,
            reduction=reduction,
            z_loss=self.z_loss,
            backend=self.backend,
            fp8=self.fp8,
            fast_accum=self.fast_accum,
        )

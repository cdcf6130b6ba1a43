"""DeepSeek-V3's multi-token prediction (MTP) loss (arXiv:2412.19437, sec. 2.2).

Depth ``k`` of ``D`` predicts the token ``k + 1`` ahead of each position from that position's depth-``k`` hidden
state (:meth:`~forge_lightning.modules.llm.model.DecoderLM.mtp_hidden_states`) through the shared output head::

    L_MTP = lambda / D * sum_k L_k,   L_k = CE(lm_head(h^k_i), t_{i+k+1}) summed over i, / T

``T`` is the main loss's trainable tokens (the paper's ``1 / T``; megatron-core divides by the same count), so
``L_MTP`` is normalised by the one batch rule exactly as the main loss: :func:`mtp_loss_sum` gives the micro-batch's
``sum_k sum_i CE`` and the module scales it as it scales the main loss's sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.model import DecoderLM


def mtp_labels(labels_BS: Tensor, k: int, document_ids: Tensor | None, ignore_index: int) -> Tensor:
    """Depth ``k``'s targets ``[B, S - k]``: ``t_{i+k+1}`` at position ``i`` (``labels[i + k]``, as ``labels[i]``
    is ``t_{i+1}``), ignored where the combined token ``t_{i+k}`` lies in another document of a packed row."""
    labels = labels_BS[:, k:]
    if document_ids is not None:
        crossed = document_ids[:, k:] != document_ids[:, : labels.shape[1]]
        labels = labels.masked_fill(crossed, ignore_index)
    return labels


def mtp_loss_sum(
    model: DecoderLM, hidden_BSD: Tensor, batch: dict[str, Tensor], loss: LMLoss
) -> tuple[Tensor, Tensor]:
    """``(sum over depths and positions of the MTP cross-entropies, per-depth sums [D])`` of a micro-batch.

    Args:
        model: the decoder with its MTP modules.
        hidden_BSD: its final-normed hidden states of ``batch["input_ids"]`` (``h^0``).
        batch: ``input_ids`` and ``labels`` ``[B, S]`` (next-token labels), optional ``position_ids`` and
            ``document_ids``.
        loss: the main loss (its ``ignore_index``, kernel and z-loss apply to every depth).
    """
    document_ids = batch.get("document_ids")
    depths = model.mtp_hidden_states(
        hidden_BSD, batch["input_ids"], position_ids=batch.get("position_ids"), document_ids=document_ids
    )
    sums = []
    for k, h_BSD in enumerate(depths, start=1):
        labels = mtp_labels(batch["labels"], k, document_ids, loss.ignore_index)
        total, _ = loss(h_BSD.reshape(-1, h_BSD.shape[-1]), model.lm_head.weight, labels.reshape(-1))
        sums.append(total)
    per_depth = torch.stack(sums)
    return per_depth.sum(), per_depth

"""Where a model's token sequence lives during a forward: whole on this process (:class:`WholeSequence`, the
default), or split over context-parallel ranks
(:class:`~forge_lightning.distributed.split_sequence.SplitSequence`, set by a strategy).

A model written against this interface stays plain: it splits its per-token tensors after embedding, runs
self-attention through :meth:`WholeSequence.attention` and gathers its output before the last reshape::

    tokens [B, S, D] ── split ──▶ [B, s, D] ── blocks (self-attention: layout.attention) ──▶ [B, s, P] ── gather ──▶ [B, S, P]

With the whole sequence ``s = S`` and each step is the identity (or plain attention).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from forge_lightning.modules.layers.attention import DocumentMask, attention


class WholeSequence:
    """The whole token sequence on this process: splitting and gathering are the identity, self-attention is
    :func:`~forge_lightning.modules.layers.attention.attention` (non-causal) with the packed-document mask."""

    def split(self, x: Tensor, dim: int, fill: float | bool = 0.0) -> Tensor:
        """This process's part of ``x`` along its sequence dimension ``dim`` (``fill``: the value of padding).

        Args:
            x: a per-token tensor (tokens, RoPE tables, per-token modulation, cross-attention masks).
            dim: its sequence dimension.
            fill: value of the positions a split pads the sequence with.
        """
        return x

    def gather(self, x: Tensor, dim: int, length: int) -> Tensor:
        """The whole sequence (``length`` positions along ``dim``) from this process's part ``x``."""
        return x

    def mask(self, x_BSD: Tensor, segments_BS: Tensor | None, backend: str) -> Any:
        """The self-attention mask of one forward (built once, passed to every layer).

        Args:
            x_BSD: the whole sequence's tokens (before :meth:`split`).
            segments_BS: non-decreasing segment (document, video) index of every token ``[B, S]``; ``None``: one
                segment per row.
            backend: the attention backend (see :data:`~forge_lightning.modules.layers.ATTENTION_BACKENDS`).
        """
        if segments_BS is None:
            return None
        return DocumentMask.build(segments_BS, backend, causal=False, varying_shapes=True)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Any) -> Tensor:
        """Non-causal self-attention of this process's queries ``[B, H, s, D]`` over the whole sequence's keys,
        within each segment of ``mask`` (from :meth:`mask`)."""
        return attention(q, k, v, causal=False, documents=mask)

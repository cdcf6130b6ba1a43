"""Rotary position embeddings (RoPE, Su et al. 2021) with the Hugging Face rope types we support.

Rotation convention: the head dimension is split into two halves ``(x1, x2)`` that are rotated as pairs
``(x1[i], x2[i])`` ("rotate half"), which is the layout of Hugging Face Llama / Qwen / Mistral checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
"""Rope types (Hugging Face ``rope_type``) this module implements."""

ROPE_SCALING_KEYS: dict[str, frozenset[str]] = {
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
}
"""Parameters each scaled rope type needs (besides ``rope_type``)."""

MROPE_KEYS: frozenset[str] = frozenset({"mrope_section", "mrope_interleaved"})
"""Hugging Face rope-parameter keys of multimodal RoPE (Qwen2-VL / Qwen2.5-VL / Qwen3-VL), beside the rope type."""


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, Any] | None = None,
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """Inverse frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim / 2``, scaled per rope type, in fp32.

    Args:
        head_dim: size of one attention head (even).
        theta: RoPE base wavelength.
        scaling: ``None`` for plain RoPE, else a dict with ``rope_type`` (``linear`` or ``llama3``) and the
            parameters in :data:`ROPE_SCALING_KEYS`.
        device: where to build the tensor.

    Returns:
        Tensor of shape ``[head_dim // 2]`` (fp32).
    """
    if scaling is not None and MROPE_KEYS & set(scaling):
        raise ValueError(
            f"rope scaling with {sorted(MROPE_KEYS & set(scaling))} (multimodal RoPE) rotates each frequency by "
            "one of several position axes: build MultimodalRotaryEmbedding, not 1-D frequencies"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_type ({rope_type!r}) is not supported; supported: {', '.join(ROPE_TYPES)}")


def _llama3_scaled(inv_freq: Tensor, scaling: Mapping[str, Any]) -> Tensor:
    # Llama 3.1 frequency scaling: wavelengths shorter than old_len / high_freq_factor keep their frequency,
    # those longer than old_len / low_freq_factor are divided by `factor`, and the band in between blends the
    # two linearly in old_len / wavelength (the clamp selects the two outer cases exactly).
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    """Produces the RoPE ``cos`` / ``sin`` tables for given positions, once per forward, shared by every layer.

    ``inv_freq`` is a non-persistent fp32 buffer (never in the state dict); it is rebuilt by
    :meth:`reset_parameters` (after ``to_empty``) and kept in fp32 when the module is cast to a lower precision.

    Args:
        head_dim: size of one attention head (even).
        theta: RoPE base wavelength.
        scaling: optional rope scaling, see :func:`rope_inv_freq`.
    """

    inv_freq: Tensor

    def __init__(
        self, head_dim: int, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling) if scaling is not None else None
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device=self.inv_freq.device)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``(cos, sin)`` of shape ``[B, S, head_dim // 2]`` in fp32 for ``position_ids`` ``[B, S]``."""
        angles_BSF = position_ids.float()[..., None] * self.inv_freq
        return angles_BSF.cos(), angles_BSF.sin()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> RotaryEmbedding:
        # `Module.to(dtype)` / `.half()` cast every floating buffer; RoPE angles need fp32 frequencies (bf16
        # frequencies shift long-range positions by whole radians), so rebuild them after such a cast.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.reset_parameters()
        return self

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"


class AxialRotaryEmbedding(RotaryEmbedding):
    """RoPE over several coordinates per token (2-D for image patches: row and column).

    The ``head_dim / 2`` rotated pairs are split evenly between the axes: axis ``a`` rotates pairs
    ``[a * F, (a + 1) * F)`` with ``F = head_dim / (2 * num_axes)`` by its coordinate, with the frequencies of a
    plain RoPE of head size ``head_dim / num_axes`` (the axial RoPE of Qwen2-VL / Qwen2.5-VL's vision towers).
    The tables plug into :func:`apply_rotary`. The inherited ``head_dim`` attribute is that per-axis size.

    Args:
        head_dim: size of one attention head (a multiple of ``2 * num_axes``).
        num_axes: coordinates per token.
        theta: RoPE base wavelength.
    """

    def __init__(self, head_dim: int, num_axes: int = 2, theta: float = 10000.0) -> None:
        if num_axes < 1 or head_dim % (2 * num_axes):
            raise ValueError(f"head_dim ({head_dim}) must be a multiple of 2 * num_axes ({num_axes})")
        super().__init__(head_dim // num_axes, theta)  # the frequencies of one axis
        self.num_axes = num_axes

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``(cos, sin)`` of shape ``[..., head_dim // 2]`` in fp32 for ``positions`` ``[..., num_axes]``."""
        angles = positions.float()[..., None] * self.inv_freq  # [..., num_axes, head_dim / (2 * num_axes)]
        angles = angles.flatten(-2)
        return angles.cos(), angles.sin()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim * self.num_axes}, num_axes={self.num_axes}, theta={self.theta}"


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (M-RoPE, Qwen2-VL arXiv:2409.12191): each rotated pair takes its angle from one of several
    position axes (temporal, height, width), so ``position_ids`` are ``[num_axes, B, S]``.

    ``mrope_section[a]`` frequencies (of the ``head_dim / 2``) follow axis ``a``. Chunked layout (Qwen2-VL /
    Qwen2.5-VL): the first ``section[0]`` frequencies follow axis 0, the next ``section[1]`` axis 1, and so on.
    Interleaved layout (Qwen3-VL): frequency ``i`` follows axis ``a = i % num_axes`` when ``a > 0`` and
    ``i < num_axes * section[a]``, else axis 0, which spreads every axis over low and high frequencies::

        section [2, 1, 1], 4 frequencies:  chunked  T T H W    interleaved  T H W T

    Text tokens carry the same position on every axis, where M-RoPE equals plain RoPE; ``[B, S]`` positions are
    taken as such. The tables plug into :func:`apply_rotary`.

    Args:
        head_dim: size of one attention head (even).
        mrope_section: frequencies per position axis; they sum to ``head_dim // 2``.
        theta: RoPE base wavelength.
        scaling: optional frequency scaling, see :func:`rope_inv_freq`.
        interleaved: the interleaved layout instead of the chunked one.
    """

    axis_of_freq: Tensor

    def __init__(
        self,
        head_dim: int,
        mrope_section: Sequence[int],
        theta: float = 10000.0,
        scaling: Mapping[str, Any] | None = None,
        *,
        interleaved: bool = False,
    ) -> None:
        self.mrope_section = [int(n) for n in mrope_section]
        self.interleaved = interleaved
        if any(n <= 0 for n in self.mrope_section) or sum(self.mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section ({self.mrope_section}) must be positive counts summing to head_dim // 2 "
                f"({head_dim // 2})"
            )
        super().__init__(head_dim, theta, scaling)

    @property
    def num_axes(self) -> int:
        """Position axes (the leading size of ``position_ids``)."""
        return len(self.mrope_section)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        axis = mrope_axis_of_freq(
            self.mrope_section, interleaved=self.interleaved, device=self.inv_freq.device
        )
        if "axis_of_freq" in self._buffers:
            self.axis_of_freq = axis
        else:  # first call, from __init__: a buffer follows the module's device, derived (not in the state dict)
            self.register_buffer("axis_of_freq", axis, persistent=False)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``(cos, sin)`` ``[B, S, head_dim // 2]`` (fp32) for ``position_ids`` ``[num_axes, B, S]`` or
        ``[B, S]`` (the same position on every axis)."""
        if position_ids.ndim == 2:
            return super().forward(position_ids)
        if position_ids.ndim != 3 or position_ids.shape[0] != self.num_axes:
            raise ValueError(
                f"position_ids of shape {list(position_ids.shape)} must be [{self.num_axes}, B, S] (one row per "
                f"mrope_section axis) or [B, S]"
            )
        positions_BSF = position_ids[self.axis_of_freq].movedim(0, -1)  # [F, B, S] -> [B, S, F]
        angles_BSF = positions_BSF.float() * self.inv_freq
        return angles_BSF.cos(), angles_BSF.sin()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={self.mrope_section}, interleaved={self.interleaved}"


def mrope_axis_of_freq(
    mrope_section: Sequence[int], *, interleaved: bool = False, device: torch.device | str | None = None
) -> Tensor:
    """The position axis each RoPE frequency follows under M-RoPE (see :class:`MultimodalRotaryEmbedding`).

    Args:
        mrope_section: frequencies per position axis.
        interleaved: the interleaved (Qwen3-VL) layout instead of the chunked one.
        device: where to build the tensor.

    Returns:
        Long tensor ``[sum(mrope_section)]`` of axis indices.
    """
    section, num_axes = list(mrope_section), len(mrope_section)
    if interleaved:  # plain Python: checked here, and independent of any default (e.g. meta) device
        axis = [
            i % num_axes if i % num_axes > 0 and i < num_axes * section[i % num_axes] else 0
            for i in range(sum(section))
        ]
        counts = [axis.count(a) for a in range(num_axes)]
        if counts != section:
            raise ValueError(
                f"mrope_section ({section}) cannot be interleaved over {sum(section)} frequencies: the layout "
                f"gives the axes {counts}"
            )
    else:
        axis = [a for a, n in enumerate(section) for _ in range(n)]
    return torch.tensor(axis, dtype=torch.long, device=device)


def apply_rotary(x_BSHD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate query or key heads by their positions' angles (computed in fp32, returned in ``x``'s dtype).

    Args:
        x_BSHD: queries or keys, ``[B, S, H, D]``.
        cos: ``[B, S, D // 2]`` from :class:`RotaryEmbedding`.
        sin: ``[B, S, D // 2]`` from :class:`RotaryEmbedding`.

    Returns:
        Tensor shaped like ``x_BSHD``.
    """
    x1, x2 = x_BSHD.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, D/2]: broadcast over heads
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x_BSHD.dtype)

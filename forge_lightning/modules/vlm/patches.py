"""Layout of the flattened patch sequences that Qwen-VL-style vision towers take: several images and videos in one
row, described by ``grid_thw``.

A processor cuts each image (a video: each group of ``temporal_patch_size`` frames) into a ``t x h x w`` grid of
patches and lists them frame by frame in *block-major* order: the ``m x m`` patches that the merger fuses into one
token (``m = spatial_merge_size``) are consecutive, row by row inside the block::

    one frame of h x w = 4 x 4 patches, m = 2         pixel_values rows of that frame
        a a b b
        a a b b      merged units a b c d             a a a a b b b b c c c c d d d d
        c c d d
        c c d d

The helpers here turn ``grid_thw`` into tensors over that sequence: the 2-D position of every patch (for the axial
RoPE), the frame each patch belongs to, and the reordering of the merged units into attention windows.
"""

from __future__ import annotations

import torch
from torch import Tensor

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

Grid = tuple[int, int, int]
"""``(t, h, w)`` of one image or video, in patches."""


def check_grids(grid_thw: Tensor, num_patches: int, spatial_merge_size: int) -> list[Grid]:
    """The ``(t, h, w)`` of every image / video, checked against the number of patches and the merge size.

    Args:
        grid_thw: ``[num_images, 3]`` integer grid of each image or video.
        num_patches: rows of ``pixel_values``.
        spatial_merge_size: side of the square of patches merged into one token; divides ``h`` and ``w``.

    Raises:
        ValueError: ``grid_thw`` is not a non-empty ``[n, 3]`` integer tensor of positive sizes, a grid's ``h``
            or ``w`` is not a multiple of ``spatial_merge_size``, or the grids do not add up to ``num_patches``.
    """
    if (
        grid_thw.ndim != 2
        or grid_thw.shape[1] != 3
        or grid_thw.shape[0] == 0
        or grid_thw.dtype not in _INTEGER_DTYPES
    ):
        raise ValueError(
            f"grid_thw must be an integer tensor [num_images, 3] of (t, h, w) with at least one row, got "
            f"{grid_thw.dtype} of shape {list(grid_thw.shape)}"
        )
    grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
    for i, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise ValueError(f"grid_thw[{i}] ({[t, h, w]}) must hold positive sizes")
        if h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(
                f"grid_thw[{i}] ({[t, h, w]}): h and w must be multiples of spatial_merge_size "
                f"({spatial_merge_size})"
            )
    described = sum(t * h * w for t, h, w in grids)
    if described != num_patches:
        raise ValueError(
            f"pixel_values holds {num_patches} patches but grid_thw ({[list(g) for g in grids]}) describes "
            f"{described}"
        )
    return grids


def patch_positions(
    grids: list[Grid], spatial_merge_size: int, *, device: torch.device | None = None
) -> Tensor:
    """``(row, column)`` of every patch in its frame, ``[num_patches, 2]`` (long), in block-major order.

    Args:
        grids: ``(t, h, w)`` per image / video (see :func:`check_grids`); every frame of a video repeats the grid.
        spatial_merge_size: side ``m`` of the merged blocks.
        device: where to build the tensor.
    """
    m = spatial_merge_size
    positions = []
    for t, h, w in grids:
        shape = (h // m, w // m, m, m)  # [block row, block column, row in block, column in block]
        rows = torch.arange(h, device=device).view(h // m, 1, m, 1).expand(shape)
        cols = torch.arange(w, device=device).view(1, w // m, 1, m).expand(shape)
        positions.append(torch.stack((rows.flatten(), cols.flatten()), dim=-1).repeat(t, 1))
    return torch.cat(positions)


def frame_ids(grids: list[Grid], *, device: torch.device | None = None) -> Tensor:
    """Index of the frame (over all images and videos; an image is one frame) of every patch, ``[num_patches]``."""
    frame_sizes = torch.tensor([h * w for t, h, w in grids for _ in range(t)], device=device)
    return torch.arange(len(frame_sizes), device=device).repeat_interleave(frame_sizes)


def window_order(
    grids: list[Grid], spatial_merge_size: int, window_units: int, *, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """The merged units reordered window by window, and the window each belongs to.

    Each frame's ``h/m x w/m`` grid of merged units is tiled by windows of ``window_units x window_units`` units
    (cut short at the bottom and right edges); frames follow each other, windows within a frame row by row, and
    the units of a window row by row. Frames stay contiguous and in input order.

    Args:
        grids: ``(t, h, w)`` per image / video (see :func:`check_grids`).
        spatial_merge_size: side ``m`` of a merged unit in patches.
        window_units: side of a window in merged units.
        device: where to build the tensors.

    Returns:
        ``order`` ``[num_units]``: ``units[order]`` lists the units in window order; ``window_ids`` ``[num_units]``:
        the non-decreasing window index (over all frames) of each unit in that order.
    """
    m, s = spatial_merge_size, window_units
    orders, windows = [], []
    num_units = num_windows = 0
    for t, h, w in grids:
        rows, cols = h // m, w // m
        windows_h, windows_w = -(-rows // s), -(-cols // s)
        frame = torch.arange(t, device=device).view(t, 1, 1)
        window_row = torch.arange(rows, device=device).view(1, rows, 1) // s
        window_col = torch.arange(cols, device=device).view(1, 1, cols) // s
        window_TRC = (frame * windows_h + window_row) * windows_w + window_col  # window of each unit
        window = window_TRC.flatten()
        # A stable sort keeps the units of one window in their row-major input order.
        order = torch.argsort(window, stable=True)
        orders.append(order + num_units)
        windows.append(window[order] + num_windows)
        num_units += window.numel()
        num_windows += t * windows_h * windows_w
    return torch.cat(orders), torch.cat(windows)

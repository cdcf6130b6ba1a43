"""Multimodal RoPE positions of a Qwen2.5-VL / Qwen3-VL token sequence: ``[3, B, S]`` (temporal, height, width).

Text tokens advance the three axes together. The ``t * (h / m) * (w / m)`` placeholder tokens of one image or
video (``<|image_pad|>`` / ``<|video_pad|>``, one per merged patch in raster order, ``m`` the spatial merge size)
take their patch's (frame, row, column) offset by the position where the item starts, and the text after it
resumes at that start plus the larger of the merged height and width. ``<|vision_start|>`` / ``<|vision_end|>``
are text tokens here::

    tokens  a  b  [image, merged grid 1 x 2 x 2]  c
    T       0  1  2  2  2  2                      4
    H       0  1  2  2  3  3                      4
    W       0  1  2  3  2  3                      4

Videos differ between the families. Qwen2.5-VL spaces frame ``k`` of a video at ``int(k * tokens_per_second *
second_per_grid_t)`` on the temporal axis; Qwen3-VL (``split_video_frames``) puts timestamp text between frames,
so each frame is an item of its own (``t = 1``) and time advances through the text.

``rope_deltas = max(position) + 1 - num_tokens`` per sample: token ``i`` decoded after the prompt is at
``i + rope_deltas`` on every axis.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor


class _Grids:
    """The ``[t, h, w]`` rows of one modality, consumed in order over the whole batch."""

    def __init__(self, name: str, grid_thw: Tensor | None) -> None:
        self.name = name
        self.rows = [] if grid_thw is None else list(grid_thw)
        self.used = 0

    def take(self, sample: int, token: int) -> tuple[int, Tensor]:
        if self.used == len(self.rows):
            raise ValueError(
                f"sample {sample}, token {token}: input_ids hold more placeholder runs than {self.name} has rows "
                f"({len(self.rows)})"
            )
        self.used += 1
        return self.used - 1, self.rows[self.used - 1]

    def check_all_used(self) -> None:
        if self.used != len(self.rows):
            raise ValueError(
                f"{self.name} has {len(self.rows)} rows but input_ids hold {self.used} placeholder runs for them"
            )


def get_rope_index(
    input_ids: Tensor,
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    image_grid_thw: Tensor | None = None,
    video_grid_thw: Tensor | None = None,
    second_per_grid_ts: Tensor | Sequence[float] | None = None,
    tokens_per_second: float | None = None,
    split_video_frames: bool = False,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """M-RoPE position ids and rope deltas of a batch (transformers' ``get_rope_index`` of Qwen2.5-VL / Qwen3-VL).

    Args:
        input_ids: token ids ``[B, S]``.
        image_token_id: the ``<|image_pad|>`` id.
        video_token_id: the ``<|video_pad|>`` id.
        spatial_merge_size: patches merged per side by the vision encoder's merger (2 for Qwen2.5-VL / Qwen3-VL).
        image_grid_thw: ``[num_images, 3]`` patch grids of the images, in order over the batch.
        video_grid_thw: ``[num_videos, 3]`` patch grids of the videos, in order over the batch.
        second_per_grid_ts: seconds per temporal grid step of each video (Qwen2.5-VL; default 1).
        tokens_per_second: temporal positions per second (Qwen2.5-VL ``vision_config.tokens_per_second``);
            needed for videos unless ``split_video_frames``.
        split_video_frames: each video frame is its own placeholder run (Qwen3-VL, frames separated by
            timestamps).
        attention_mask: ``[B, S]``, 0 at padding (left or right): padding is skipped and gets position 0.

    Returns:
        ``(position_ids [3, B, S], rope_deltas [B, 1])``; positions in ``input_ids``'s dtype, deltas int64.

    Raises:
        ValueError: a placeholder run that does not match its grid, grids left over or missing, or video timing
            arguments that the chosen layout does not use.
    """
    if split_video_frames and (tokens_per_second is not None or second_per_grid_ts is not None):
        raise ValueError(
            "tokens_per_second / second_per_grid_ts space the frames of a video (Qwen2.5-VL); with "
            "split_video_frames (Qwen3-VL) time advances through the timestamp tokens: leave them unset"
        )
    intervals = None  # temporal positions per grid step of each video (Qwen2.5-VL)
    if split_video_frames and video_grid_thw is not None:
        video_grid_thw = video_grid_thw.repeat_interleave(video_grid_thw[:, 0], dim=0)
        video_grid_thw[:, 0] = 1
    elif video_grid_thw is not None:
        if tokens_per_second is None:
            raise ValueError(
                "tokens_per_second must be set to space the frames of videos (Qwen2.5-VL "
                "vision_config.tokens_per_second), or split_video_frames for Qwen3-VL"
            )
        seconds = [1] * len(video_grid_thw) if second_per_grid_ts is None else second_per_grid_ts
        if len(seconds) != len(video_grid_thw):
            raise ValueError(
                f"second_per_grid_ts has {len(seconds)} entries for {len(video_grid_thw)} videos (video_grid_thw)"
            )
        intervals = [tokens_per_second * s for s in seconds]
    grids = {
        image_token_id: _Grids("image_grid_thw", image_grid_thw),
        video_token_id: _Grids("video_grid_thw", video_grid_thw),
    }
    batch, seq = input_ids.shape
    position_ids = torch.zeros(3, batch, seq, dtype=input_ids.dtype, device=input_ids.device)
    deltas = []
    for b in range(batch):
        keep = None if attention_mask is None else attention_mask[b].bool()
        ids = input_ids[b] if keep is None else input_ids[b][keep]
        positions_3N = _sample_positions(ids, b, grids, spatial_merge_size, video_token_id, intervals)
        if keep is None:
            position_ids[:, b] = positions_3N
        else:
            position_ids[:, b, keep] = positions_3N
        deltas.append(int(positions_3N.max()) + 1 - len(ids) if len(ids) else 0)
    for queue in grids.values():
        queue.check_all_used()
    return position_ids, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


def _sample_positions(
    ids: Tensor,
    sample: int,
    grids: dict[int, _Grids],
    merge: int,
    video_token_id: int,
    video_intervals: Sequence[float | Tensor] | None,
) -> Tensor:
    """``[3, N]`` positions of one sample's ``N`` unpadded tokens, text runs and vision items in order."""
    is_vision = torch.zeros_like(ids, dtype=torch.bool)
    for token in grids:
        is_vision |= ids == token
    vision_idx = is_vision.nonzero().flatten().tolist()
    chunks = [torch.zeros(3, 0, dtype=torch.long, device=ids.device)]
    cursor = current = j = 0
    while j < len(vision_idx) or cursor < len(ids):
        start = vision_idx[j] if j < len(vision_idx) else len(ids)
        if start > cursor:  # text run
            chunks.append(torch.arange(current, current + start - cursor, device=ids.device).expand(3, -1))
            current += start - cursor
            cursor = start
            continue
        token = int(ids[start])
        index, grid = grids[token].take(sample, start)
        t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
        count = t * h * w
        if start + count > len(ids) or not bool((ids[start : start + count] == token).all()):
            raise ValueError(
                f"sample {sample}, token {start}: {grids[token].name}[{index}] ({[int(g) for g in grid]}, merge "
                f"{merge}) needs {count} consecutive placeholder tokens (id {token})"
            )
        if start + count < len(ids) and int(ids[start + count]) == token:
            raise ValueError(
                f"sample {sample}, token {start}: the placeholder run (id {token}) is longer than the {count} "
                f"tokens of {grids[token].name}[{index}] ({[int(g) for g in grid]}, merge {merge}); items need text "
                "between them (<|vision_start|> / <|vision_end|>; Qwen3-VL: each video frame after its timestamp)"
            )
        interval = video_intervals[index] if token == video_token_id and video_intervals is not None else 1
        chunks.append(_vision_positions(t, h, w, current, interval, ids.device))
        current += max(h, w)
        cursor = start + count
        j += count
    return torch.cat(chunks, dim=1)


def _vision_positions(
    t: int, h: int, w: int, start: int, interval: float | Tensor, device: torch.device
) -> Tensor:
    """``[3, t * h * w]`` (frame, row, column) positions of one item's merged patches in raster order."""
    temporal = (torch.arange(t, device=device) * interval).long() + start
    height = torch.arange(h, device=device) + start
    width = torch.arange(w, device=device) + start
    return torch.stack(torch.meshgrid(temporal, height, width, indexing="ij")).reshape(3, -1)


def get_packed_rope_index(input_ids: Tensor, document_ids: Tensor, **options: object) -> Tensor:
    """M-RoPE positions ``[3, B, S]`` of packed rows: :func:`get_rope_index` of each document on its own, so positions
    restart at every document; the grids (and ``second_per_grid_ts``) are consumed in document order.

    Args:
        input_ids: token ids ``[B, S]``.
        document_ids: ``[B, S]`` non-decreasing document index of each token of a row.
        options: the keyword arguments of :func:`get_rope_index` (``attention_mask`` excepted).
    """
    if "attention_mask" in options:
        raise ValueError("packed rows take no attention_mask: padding is a document of its own")
    if document_ids.shape != input_ids.shape:
        raise ValueError(
            f"document_ids {list(document_ids.shape)} must have input_ids' shape {list(input_ids.shape)}"
        )
    batch, seq = input_ids.shape
    spans = []  # (row, start, length) of every document, in order
    for row in range(batch):
        counts = torch.unique_consecutive(document_ids[row], return_counts=True)[1].tolist()
        starts = [0, *itertools.accumulate(counts)][:-1]
        spans += [(row, start, length) for start, length in zip(starts, counts)]
    # One document per row of a right-padded batch: get_rope_index skips the padding via its attention_mask.
    longest = max(length for _, _, length in spans)
    ids_NL = input_ids.new_zeros(len(spans), longest)
    mask_NL = torch.zeros(len(spans), longest, dtype=torch.bool, device=input_ids.device)
    for n, (row, start, length) in enumerate(spans):
        ids_NL[n, :length] = input_ids[row, start : start + length]
        mask_NL[n, :length] = True
    documents_3NL, _ = get_rope_index(ids_NL, attention_mask=mask_NL, **options)  # type: ignore[arg-type]
    position_ids = torch.zeros(3, batch, seq, dtype=input_ids.dtype, device=input_ids.device)
    for n, (row, start, length) in enumerate(spans):
        position_ids[:, row, start : start + length] = documents_3NL[:, n, :length]
    return position_ids

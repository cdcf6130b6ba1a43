"""A composed model's encoder side spread over the pipeline stages (``encoder_placement: spread``, the default with
pipeline parallelism; see components.py for the rest of the encoder side).

The T x P ranks of a model-parallel group (its TP ranks of every pipeline stage) hold the same micro-batches. Each
holds a replica of the encoder side and encodes a contiguous run of the step's samples, before megatron's schedule;
the first stage gathers the features, and after the schedule sends each rank the gradient of its rows::

    the step's S samples, micro-batch after micro-batch; rank k = p*T + t (stage p, TP rank t):
      rows [k*S // (T*P), (k+1)*S // (T*P))                                        (step_shares)
    encode_spread    composition.encode of its rows of each micro-batch the run touches  -> its pieces (graph kept)
                     all-gather over the TP group (the stage's pieces), gather over the PP group to the first stage
                     -> on the first stage: each micro-batch's [b, ...] features as a leaf (the schedule reads it)
    the schedule     1F1B; the first stage's backward leaves the gradient of the loss w.r.t. each leaf
    backward_spread  scatter over the PP group: rank (p, t) gets its rows' gradient from (0, t); backward through
                     its pieces (every TP rank of the first stage holds the whole gradient, see components.py)

No sample is encoded twice (the runs differ by one sample at most, none pads), and the features travel once to the
first stage and their gradients once back: per step ``S * (features of one sample)`` over the PP group, next to the
``2 * (P - 1)`` activation transfers per micro-batch the schedule makes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Codes of the encodings' dtypes in the shapes the ranks exchange.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 6  # dimensions of one sample's encoding at most (a VLM's: [S, H])


def step_shares(sizes: Sequence[int], rank: int, size: int) -> list[tuple[int, Tensor]]:
    """The samples of a step that rank ``rank`` of ``size`` encodes: the run ``[rank*S // size, (rank+1)*S // size)``
    of the step's ``S = sum(sizes)`` samples (micro-batch after micro-batch), as ``(micro-batch, rows)`` pairs
    (``sizes`` ``[3, 3, 3]``, ``size`` 2: rank 0 ``[(0, [0, 1, 2]), (1, [0])]``, rank 1 ``[(1, [1, 2]), (2, [0, 1, 2])]``).

    Args:
        sizes: the samples of each micro-batch of the step.
        rank: this rank's place among the ranks sharing the work.
        size: the ranks sharing the work.
    """
    total = sum(sizes)
    start, stop = rank * total // size, (rank + 1) * total // size
    shares, offset = [], 0
    for index, count in enumerate(sizes):
        lo, hi = max(start, offset), min(stop, offset + count)
        if lo < hi:
            shares.append((index, torch.arange(lo - offset, hi - offset)))
        offset += count
    return shares


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageGroups:
    """The process groups of the spread: this rank's TP group and PP group, and the PP group's first-stage rank."""

    tp: Any
    pp: Any
    first: int  # global rank of the first stage in this rank's PP group

    @property
    def shape(self) -> tuple[int, int]:
        """``(P, T)``."""
        return dist.get_world_size(self.pp), dist.get_world_size(self.tp)

    @property
    def place(self) -> tuple[int, int]:
        """``(p, t)``: this rank's stage and TP rank."""
        return dist.get_rank(self.pp), dist.get_rank(self.tp)


@dataclasses.dataclass(kw_only=True)
class SpreadStep:
    """One step's spread encoding (:func:`encode_spread`): what :func:`backward_spread` needs after the schedule.

    Args:
        shares: ``shares[p][t]``: the ``(micro-batch, rows)`` of rank (p, t).
        shapes: one sample's encoding shape, per micro-batch.
        dtype: the dtype the encodings travel in (the widest of the ranks').
        device: where the features and their gradients travel.
        pieces: this rank's encodings of its shares (their graph kept in training), in share order.
        leaves: on the first stage, each micro-batch's gathered features (what the schedule reads); empty elsewhere.
    """

    shares: list[list[list[tuple[int, Tensor]]]]
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    device: torch.device
    pieces: list[Tensor]
    leaves: list[Tensor]

    def numel(self, p: int, t: int) -> int:
        """The elements of rank (p, t)'s encodings."""
        return sum(len(rows) * math.prod(self.shapes[m]) for m, rows in self.shares[p][t])

    @property
    def padded(self) -> int:
        """The elements every rank sends: the largest share's (at least 1)."""
        return max([1] + [self.numel(p, t) for p, row in enumerate(self.shares) for t in range(len(row))])


def encode_spread(
    sizes: Sequence[int],
    encode_rows: Callable[[int, Tensor], Tensor],
    groups: StageGroups,
    *,
    device: torch.device,
    requires_grad: bool,
) -> SpreadStep:
    """Encode this rank's share of the step and gather every micro-batch's features on the first stage.

    Args:
        sizes: the samples of each micro-batch of the step (the same on every rank of the model-parallel group).
        encode_rows: ``encode_rows(micro-batch, rows) -> [len(rows), ...]``, the composition's encode of those
            samples (called for this rank's shares only).
        groups: this rank's groups.
        device: where the features travel (the batches' device).
        requires_grad: the schedule back-propagates into the features (training): the first stage's leaves then
            require grad and :func:`backward_spread` follows.

    Returns:
        The step; on the first stage ``leaves[m]`` is micro-batch ``m``'s ``[sizes[m], ...]`` features.
    """
    (num_stages, tp), (stage, rank) = groups.shape, groups.place
    shares = [[step_shares(sizes, p * tp + t, num_stages * tp) for t in range(tp)] for p in range(num_stages)]
    pieces = [encode_rows(m, rows) for m, rows in shares[stage][rank]]
    shapes, dtype = _exchange_shapes(sizes, shares[stage][rank], pieces, groups, device)
    # differentiable: the gradients come back in each piece's own dtype
    pieces = [piece.to(dtype) for piece in pieces]
    step = SpreadStep(shares=shares, shapes=shapes, dtype=dtype, device=device, pieces=pieces, leaves=[])
    flat = _pad(torch.cat([p.detach().reshape(-1) for p in pieces] or [_empty(step, device)]), step.padded)
    stage_parts = [torch.empty_like(flat) for _ in range(tp)]
    dist.all_gather(stage_parts, flat, group=groups.tp)
    stage_block = torch.stack(stage_parts)  # [T, padded]: this stage's pieces
    first = stage == 0
    blocks = [torch.empty_like(stage_block) for _ in range(num_stages)] if first else None
    dist.gather(stage_block, blocks, dst=groups.first, group=groups.pp)
    if first:
        assert blocks is not None
        step.leaves = [
            features.requires_grad_(requires_grad) for features in _assemble(step, torch.stack(blocks), sizes)
        ]
    return step


def backward_spread(step: SpreadStep, groups: StageGroups) -> None:
    """After the schedule: the first stage sends each rank of its PP group the gradient of that rank's rows (the
    leaves' gradients; zero where a leaf got none), and every rank back-propagates its pieces. Collective over
    the PP group."""
    (num_stages, _), (stage, rank) = groups.shape, groups.place
    device, parts = step.device, None
    if stage == 0:
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in step.leaves]
        parts = [
            _pad(
                torch.cat([grads[m][rows.to(device)].reshape(-1) for m, rows in step.shares[p][rank]])
                if step.shares[p][rank]
                else _empty(step, device),
                step.padded,
            )
            for p in range(num_stages)
        ]
    own = torch.empty(step.padded, dtype=step.dtype, device=device)
    dist.scatter(own, parts, src=groups.first, group=groups.pp)
    offset, pairs = 0, []
    for piece in step.pieces:
        if piece.requires_grad:  # not an encoding without encoder work (samples without images)
            pairs.append((piece, own[offset : offset + piece.numel()].view_as(piece)))
        offset += piece.numel()
    if pairs:
        torch.autograd.backward([piece for piece, _ in pairs], [grad for _, grad in pairs])


def _exchange_shapes(
    sizes: Sequence[int],
    mine: list[tuple[int, Tensor]],
    pieces: list[Tensor],
    groups: StageGroups,
    device: torch.device,
) -> tuple[list[tuple[int, ...]], torch.dtype]:
    """Every micro-batch's encoding shape (of one sample) and the dtype the encodings travel in, from the ranks that
    encoded them (a rank knows its own pieces only). Two small all-gathers, over the TP then the PP group."""
    meta = torch.full((len(sizes), 2 + _MAX_DIMS), -1, dtype=torch.long)
    for (m, _), piece in zip(mine, pieces, strict=True):
        if piece.ndim - 1 > _MAX_DIMS or piece.dtype not in _DTYPES:
            raise ValueError(
                f"the composition's encode gave a {piece.dtype} tensor of shape {list(piece.shape)}: the spread "
                f"encoder sends up to {_MAX_DIMS} dimensions per sample in one of {[str(d) for d in _DTYPES]}; "
                "use encoder_placement: first_stage for this model"
            )
        meta[m, 0], meta[m, 1] = _DTYPES.index(piece.dtype), piece.ndim - 1
        meta[m, 2 : 1 + piece.ndim] = torch.tensor(piece.shape[1:])
    meta = meta.to(device)
    tp_parts = [torch.empty_like(meta) for _ in range(dist.get_world_size(groups.tp))]
    dist.all_gather(tp_parts, meta, group=groups.tp)
    stage = torch.stack(tp_parts)
    pp_parts = [torch.empty_like(stage) for _ in range(dist.get_world_size(groups.pp))]
    dist.all_gather(pp_parts, stage, group=groups.pp)
    rows = torch.stack(pp_parts).flatten(0, 1).cpu()  # [P * T, M, 2 + dims]: rank after rank
    shapes = []
    for m in range(len(sizes)):
        given = {tuple(r[2 : 2 + int(r[1])].tolist()) for r in rows[:, m] if r[0] >= 0}
        if len(given) != 1:
            raise ValueError(
                f"the ranks encoded micro-batch {m} to different shapes per sample {sorted(given)}: a composition's "
                "encode must give every sample the same shape whatever part of the batch it encodes"
            )
        shapes.append(given.pop())
    # Under autocast a share without encoder work (a VLM's samples without images) gives zeros in the parameters'
    # dtype, the others the autocast dtype: all travel in the wider one.
    dtypes = [_DTYPES[int(code)] for code in rows[..., 0].flatten().tolist() if code >= 0]
    common = dtypes[0]
    for dtype in dtypes[1:]:
        common = torch.promote_types(common, dtype)
    return shapes, common


def _assemble(step: SpreadStep, blocks: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """Each micro-batch's features from every rank's flat pieces (``blocks``: ``[P, T, padded]``)."""
    parts: list[list[Tensor]] = [[] for _ in sizes]
    for p, row in enumerate(step.shares):
        for t, shares in enumerate(row):
            offset = 0
            for m, rows in shares:
                count = len(rows) * math.prod(step.shapes[m])
                parts[m].append(blocks[p, t, offset : offset + count].view(len(rows), *step.shapes[m]))
                offset += count
    return [torch.cat(pieces) for pieces in parts]


def _pad(flat: Tensor, size: int) -> Tensor:
    return torch.cat([flat, flat.new_zeros(size - flat.numel())]) if flat.numel() < size else flat


def _empty(step: SpreadStep, device: torch.device) -> Tensor:
    return torch.zeros(0, dtype=step.dtype, device=device)

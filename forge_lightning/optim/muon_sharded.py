"""Muon's exchange for sharded parameters (FSDP2, HSDP, FSDP x TP DTensors), and the default exchange choice.

Each parameter is owned by one rank of the process group spanned by the mesh dims it is sharded on; the owner
receives every member's local piece and assembles the full matrix (:meth:`ShardedExchange.gather`), and later cuts
its result back into the members' pieces (:meth:`ShardedExchange.publish`). Both are one ``all_to_all_single`` per
process group, over flat buffers that coalesce every parameter of that group::

    gather (2 ranks, W0 owned by rank 0, W1 by rank 1)       publish: the reverse
    rank 0: [W0 rows 0-2 | W1 rows 0-1] --a2a--> rank 0: W0 = [rank 0's rows; rank 1's rows]
    rank 1: [W0 rows 3-4 | W1 rows 2-3] ------>  rank 1: W1 = [rank 0's rows; rank 1's rows]

Mesh dims on which a parameter is replicated (HSDP's ``dp_replicate``) are not part of its group: every replica
runs the same exchange within its own group, computes the same owners' results and keeps the same state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

# FSDP2 over a TP-sharded dim places a strided shard; its pieces are not contiguous ranges.
from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

from forge_lightning.optim.muon_exchange import (
    LocalExchange,
    MatrixExchange,
    ReplicatedExchange,
    assign_owners,
)

__all__ = ["ShardedExchange", "default_exchange"]


@dataclass(frozen=True)
class _Piece:
    """Where one rank's local tensor sits in the full tensor: an index into it (slices while the piece is a
    block; broadcast index tensors for strided shards, whose rows are not contiguous) and the piece's shape."""

    index: tuple[slice | torch.Tensor, ...]
    shape: tuple[int, ...]
    numel: int

    def read(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of ``full``."""
        return full[self.index]

    def write(self, full: torch.Tensor, values: torch.Tensor) -> None:
        """Copies ``values`` (of this piece's shape) into ``full``."""
        full[self.index] = values


def _piece(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    device: torch.device,
) -> _Piece:
    """The piece of a tensor of ``shape`` held at mesh ``coordinate``: shards apply left to right over the mesh
    dims, as in DTensor's ``compute_local_shape_and_global_offset``, but for any rank and with every index of a
    strided shard."""
    # Per tensor dim: (start, length) while the selection is a range, else the selected indices.
    selection: list[tuple[int, int] | torch.Tensor] = [(0, size) for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if not (placement.is_shard() or isinstance(placement, _StridedShard)):
            continue
        dim, chunks, at = placement.dim, mesh_shape[mesh_dim], coordinate[mesh_dim]
        current = selection[dim]
        length = current[1] if isinstance(current, tuple) else len(current)
        if isinstance(placement, _StridedShard):
            _, offsets = placement.local_shard_size_and_offset(
                length, chunks, at, _StridedShardOffsetMode.ALL
            )
            base = torch.arange(current[0], current[0] + length) if isinstance(current, tuple) else current
            selection[dim] = base[torch.tensor(offsets, dtype=torch.long)]
        else:
            size, offset = Shard.local_shard_size_and_offset(length, chunks, at)
            if isinstance(current, tuple):
                selection[dim] = (current[0] + offset, size)
            else:
                selection[dim] = current[offset : offset + size]
    sizes = tuple(sel[1] if isinstance(sel, tuple) else len(sel) for sel in selection)
    numel = 1
    for size in sizes:
        numel *= size
    if all(isinstance(sel, tuple) for sel in selection):
        return _Piece(tuple(slice(start, start + n) for start, n in selection), sizes, numel)
    index = []
    for dim, sel in enumerate(selection):
        idx = torch.arange(sel[0], sel[0] + sel[1]) if isinstance(sel, tuple) else sel
        index.append(idx.to(device).view([-1 if k == dim else 1 for k in range(len(shape))]))
    return _Piece(tuple(index), sizes, numel)


def _coordinates(mesh: DeviceMesh) -> dict[int, list[int]]:
    """The mesh coordinate of every global rank in ``mesh`` (as this rank sees it: a sub-mesh holds its slice)."""
    ranks = mesh.mesh
    coordinates = {}
    for flat, rank in enumerate(ranks.flatten().tolist()):
        coordinate = []
        for size in reversed(ranks.shape):
            coordinate.append(flat % size)
            flat //= size
        coordinates[rank] = coordinate[::-1]
    return coordinates


def _sharded_dims(param: DTensor, index: int) -> tuple[int, ...]:
    """The mesh dims ``param`` is sharded on (size-1 dims left out); a partial placement is refused."""
    dims = []
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if not (placement.is_shard() or isinstance(placement, _StridedShard)):
            raise ValueError(
                f"parameter {index} (shape {tuple(param.shape)}) has placement {placement} on mesh dim {mesh_dim}: "
                "Muon needs parameters sharded or replicated, not partial; redistribute it to Replicate() first"
            )
        if param.device_mesh.size(mesh_dim) > 1:
            dims.append(mesh_dim)
    return tuple(dims)


def _group(mesh: DeviceMesh, dims: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group spanned by mesh ``dims`` (every rank of the mesh's root calls this in the same order)."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = mesh.mesh_dim_names
    if names is not None:
        # DeviceMesh keeps its flattened meshes (and uses the default group for the whole world), so another
        # exchange over the same dims reuses the group.
        return mesh[tuple(names[d] for d in dims)]._flatten().get_group()
    coordinate = mesh.get_coordinate()
    selection = tuple(slice(None) if d in dims else c for d, c in enumerate(coordinate))
    if sorted(mesh.mesh[selection].flatten().tolist()) == list(range(dist.get_world_size())):
        return dist.group.WORLD
    raise ValueError(
        f"a parameter is sharded on mesh dims {list(dims)} of an unnamed mesh {mesh}, which span only part of "
        "the world: Muon flattens such dims into one process group by name; build the mesh with "
        "init_device_mesh(..., mesh_dim_names=...)"
    )


def _promoted(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    return dtype


class _Bucket:
    """The parameters sharing one process group (``None``: no communication): their owners, every member's piece
    and the exchange over flat buffers."""

    def __init__(
        self,
        indices: list[int],
        params: Sequence[DTensor],
        costs: Sequence[float],
        group: dist.ProcessGroup | None,
        wire_dtype: torch.dtype | None,
    ) -> None:
        self.indices = indices
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.owners = dict(zip(indices, assign_owners([costs[i] for i in indices], self.size), strict=True))
        self.owned_by = [[i for i in indices if self.owners[i] == r] for r in range(self.size)]
        self.wire_dtype = wire_dtype
        self.param_dtype = _promoted([params[i].dtype for i in indices])
        self.device = params[indices[0]].to_local().device
        if group is not None and self.device.type == "cpu" and "gloo" not in dist.get_backend(group):
            raise ValueError(
                f"Muon's sharded exchange runs where the parameter shards are (the CPU), but their process group's "
                f"backend is {dist.get_backend(group)!r}: FSDP2's cpu_offload with Muon is not supported; set "
                "cpu_offload to false (or use AdamW)"
            )
        members = [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)
        meshes: dict[int, dict[int, list[int]]] = {}
        self.pieces: dict[int, list[_Piece]] = {}
        for i in indices:
            mesh = params[i].device_mesh
            coordinates = meshes.setdefault(id(mesh), _coordinates(mesh))
            self.pieces[i] = [
                _piece(params[i].shape, mesh.shape, coordinates[r], params[i].placements, self.device)
                for r in members
            ]

    def _all_to_all(
        self, send: list[torch.Tensor], in_splits: list[int], out_splits: list[int], dtype: torch.dtype
    ) -> torch.Tensor:
        flat = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=self.device)
        out = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        dist.all_to_all_single(out, flat, out_splits, in_splits, group=self.group)
        return out

    def gather(self, local: Sequence[torch.Tensor], params: Sequence[DTensor]) -> dict[int, torch.Tensor]:
        """The full tensors this rank owns, from every member's local pieces."""
        owned = self.owned_by[self.rank]
        dtype = self.wire_dtype or _promoted([local[i].dtype for i in self.indices])
        if self.group is None:
            return {i: local[i].to(dtype) for i in owned}
        # Send: to each owner in rank order, the pieces of its parameters in index order; receive the reverse.
        send = [local[i].reshape(-1).to(dtype) for dest in self.owned_by for i in dest]
        in_splits = [sum(self.pieces[i][self.rank].numel for i in dest) for dest in self.owned_by]
        out_splits = [sum(self.pieces[i][src].numel for i in owned) for src in range(self.size)]
        received = self._all_to_all(send, in_splits, out_splits, dtype)
        full = {i: torch.empty(params[i].shape, dtype=dtype, device=self.device) for i in owned}
        offset = 0
        for src in range(self.size):
            for i in owned:
                piece = self.pieces[i][src]
                piece.write(full[i], received[offset : offset + piece.numel].view(piece.shape))
                offset += piece.numel
        return full

    def publish(self, results: Mapping[int, torch.Tensor], outs: list[torch.Tensor | None]) -> None:
        """Fills ``outs[i]`` with this rank's piece of every parameter's result, from the owners' full results."""
        owned = self.owned_by[self.rank]
        dtype = self.wire_dtype or self.param_dtype  # a rank that owns nothing sees no result's dtype
        if self.group is None:
            for i in owned:
                outs[i] = results[i].to(dtype)
            return
        send = [
            self.pieces[i][dest].read(results[i]).reshape(-1).to(dtype)
            for dest in range(self.size)
            for i in owned
        ]
        in_splits = [sum(self.pieces[i][dest].numel for i in owned) for dest in range(self.size)]
        out_splits = [sum(self.pieces[i][self.rank].numel for i in src) for src in self.owned_by]
        received = self._all_to_all(send, in_splits, out_splits, dtype)
        offset = 0
        for src in self.owned_by:
            for i in src:
                piece = self.pieces[i][self.rank]
                outs[i] = received[offset : offset + piece.numel].view(piece.shape)
                offset += piece.numel


class ShardedExchange:
    """The exchange for DTensor parameters: FSDP2 ``Shard(0)``, HSDP ``(Replicate, Shard(0))``, FSDP x TP
    ``(Shard(0), Shard(1))`` or strided shards (FSDP2 over a TP-sharded dim), uneven and empty shards included;
    a 3-D expert stack sharded on its expert dim reaches its owner whole.

    Parameters are bucketed by the process group spanned by the mesh dims each is sharded on (one dim: that dim's
    group; several: the mesh's flattened dims, or the world for an unnamed mesh spanning it). Owners are assigned
    per bucket by :func:`assign_owners` over that group's ranks, so ``owners[i]`` is a rank in parameter ``i``'s
    group and :meth:`is_owner` compares it with this process's rank there, ``ranks[i]``; :attr:`rank` is this
    process's rank in the first bucket's group, the only one when all parameters share a mesh layout (the usual
    case). A parameter sharded on no mesh dim of size > 1 is owned by every rank and exchanged without
    communication.

    Each :meth:`gather` and :meth:`publish` makes one ``all_to_all_single`` per bucket (each HSDP replica in its
    own group) over one flat buffer, and returns tensors in the dtype it sent: by default the promoted dtype of
    the bucket's local tensors for :meth:`gather` (every rank must pass the same dtypes) and of its parameters
    for :meth:`publish`.

    Args:
        params: the parameters, as DTensors (index ``i`` is parameter ``i`` in every call).
        costs: the cost of orthogonalising each parameter (e.g. :func:`newton_schulz_flops` of its parts).
        wire_dtype: one dtype for both directions instead. Newton-Schulz returns ``ns_dtype`` (as in
            ``torch.optim.Muon``, whose update adds that to the parameter), so ``ns_dtype`` here halves what the
            owners of fp32 matrices send back and keeps the update exact (not so for AdamW's new values).
    """

    replicated = False

    def __init__(
        self, params: Sequence[DTensor], costs: Sequence[float], *, wire_dtype: torch.dtype | None = None
    ) -> None:
        if len(params) != len(costs):
            raise ValueError(
                f"got {len(params)} parameters but {len(costs)} costs: give one cost per parameter"
            )
        for i, p in enumerate(params):
            if not isinstance(p, DTensor):
                raise ValueError(
                    f"parameter {i} (shape {tuple(p.shape)}) is a plain tensor: ShardedExchange takes DTensors "
                    "(FSDP2 / TP parameters); use default_exchange to pick the exchange for plain tensors"
                )
            if p.device_mesh.get_coordinate() is None:
                raise ValueError(
                    f"parameter {i} (shape {tuple(p.shape)}) lives on mesh {p.device_mesh}, which does not hold "
                    f"this rank ({dist.get_rank()}): give each rank's optimizer only its own parameters"
                )
        self._params = list(params)
        by_group: dict[str | None, list[int]] = {}
        groups: dict[str | None, dist.ProcessGroup | None] = {}
        for i, p in enumerate(params):
            dims = _sharded_dims(p, i)
            group = _group(p.device_mesh, dims) if dims else None
            key = None if group is None else group.group_name
            groups[key] = group
            by_group.setdefault(key, []).append(i)
        self._buckets = [
            _Bucket(indices, params, costs, groups[key], wire_dtype) for key, indices in by_group.items()
        ]
        self.owners = [0] * len(params)
        self.ranks = [0] * len(params)
        self._local_shapes: list[tuple[int, ...]] = [()] * len(params)
        for bucket in self._buckets:
            for i in bucket.indices:
                self.owners[i] = bucket.owners[i]
                self.ranks[i] = bucket.rank
                self._local_shapes[i] = bucket.pieces[i][bucket.rank].shape
        self.rank = self._buckets[0].rank if self._buckets else 0

    @property
    def groups(self) -> list[dist.ProcessGroup | None]:
        """The process group of each bucket (``None``: parameters exchanged without communication)."""
        return [bucket.group for bucket in self._buckets]

    def is_owner(self, index: int) -> bool:
        """Whether this rank orthogonalises parameter ``index``."""
        return self.owners[index] == self.ranks[index]

    def gather(self, local: Sequence[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """The full tensors this rank owns, assembled from every member's ``local[i]`` (each rank's local tensor,
        of the shape of ``params[i].to_local()``)."""
        if len(local) != len(self._params):
            raise ValueError(f"gather got {len(local)} tensors for {len(self._params)} parameters")
        for i, (t, p) in enumerate(zip(local, self._params, strict=True)):
            if t is None or tuple(t.shape) != self._local_shapes[i]:
                raise ValueError(
                    f"gather: local tensor {i} has shape {None if t is None else tuple(t.shape)}, expected this "
                    f"rank's piece {self._local_shapes[i]} of the parameter of shape {tuple(p.shape)} (pass its "
                    "to_local() layout)"
                )
        full: dict[int, torch.Tensor] = {}
        for bucket in self._buckets:
            full |= bucket.gather(local, self._params)
        return full

    def publish(self, results: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every parameter's result as this rank's local piece, from the full ``results`` of the parameters this
        rank owns."""
        owned = [i for i in range(len(self._params)) if self.is_owner(i)]
        if sorted(results) != owned:
            raise ValueError(
                f"publish got results for parameters {sorted(results)}, but this rank owns {owned}"
            )
        for i in owned:
            if tuple(results[i].shape) != tuple(self._params[i].shape):
                raise ValueError(
                    f"publish: result {i} has shape {tuple(results[i].shape)}, expected the full parameter's "
                    f"{tuple(self._params[i].shape)}"
                )
        outs: list[torch.Tensor | None] = [None] * len(self._params)
        for bucket in self._buckets:
            bucket.publish(results, outs)
        return outs  # type: ignore[return-value]  # every index is filled by its bucket


def default_exchange(params: Sequence[torch.Tensor], costs: Sequence[float]) -> MatrixExchange:
    """The exchange for ``params``: :class:`ShardedExchange` for DTensors (FSDP2 / HSDP / TP), a
    ``ReplicatedExchange`` over the world for plain tensors in a multi-process run (DDP / ZeRO-1), else a
    :class:`LocalExchange`.

    Args:
        params: the parameters (all DTensors, or all plain tensors).
        costs: the cost of orthogonalising each parameter.
    """
    sharded = [isinstance(p, DTensor) for p in params]
    if any(sharded):
        if not all(sharded):
            plain = sharded.index(False)
            raise ValueError(
                f"parameter {plain} (shape {tuple(params[plain].shape)}) is a plain tensor while others are "
                "DTensors: one optimizer's parameters must be all sharded (fully_shard every module holding them) "
                "or all plain"
            )
        return ShardedExchange(params, costs)  # type: ignore[arg-type]  # all DTensors, checked above
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ReplicatedExchange(params, costs)
    return LocalExchange(len(params))

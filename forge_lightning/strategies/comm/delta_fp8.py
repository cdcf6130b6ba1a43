"""Delta-FP8 parameter all-gather for FSDP2: each rank sends the block-quantized change of its shard.

Every rank keeps a full-size reconstruction ``R`` of the unit's gathered parameters (rank ``r``'s chunk is
``R[r]``). At each all-gather, rank ``r`` sends ``Q(x_r - R[r])``: the difference between its current shard
(in the all-gather dtype, e.g. bf16) and the last reconstruction of that shard, quantized to e4m3 with one fp32
scale per 256 elements. Every rank adds all ranks' dequantized deltas to ``R`` and uses ``R`` as the gathered
parameters::

    shard x_r ─ − R[r] ─ quantize ─ all-gather (uint8) ─ dequantize ─ R += deltas ─→ unsharded parameters
                 (every rank, the owner included, then holds the same R, bit for bit)

Since the next delta is taken against ``R`` rather than against the previous shard, the quantization error of
one step is part of the next step's delta and is corrected there: the error never accumulates. It is bounded
by the quantization error of one delta, ``≲ |Δ|/16`` per element (``Δ``: how much the shard moved since the
last gather, plus the previous error), plus one rounding to the all-gather dtype. A periodic exact re-sync
(``resync_every``) sends the exact shards instead, after which the error is 0.

Bytes each rank sends per gather of a unit with a ``S``-element shard: ``(W-1) · (S + 4·⌈S/256⌉)``, against
``(W-1) · 2S`` for FSDP2's bf16 all-gather (a ratio of ``0.508``) and ``(W-1) · 4S`` for fp32.

How it is hooked into FSDP2 (torch 2.13). ``FSDPModule.set_custom_all_gather(comm)`` hands ``comm`` the flat
all-gather input (this rank's padded shards, back to back) and the flat output ``[W · S]`` it must fill; the
layout is fixed per unit, so the reconstruction is one ``[W, S]`` buffer per unit, and the unit's training state
tells forward gathers from backward re-gathers. The tensor-subclass extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, which torchao's float8 all-gather uses to cast each weight shard to float8 before the
gather and wrap the result after it) was not chosen: it is a stateless per-parameter cast, so the
reconstruction of every other rank's chunk would have to hang off each parameter; every parameter would become
a subclass that optimizers, DCP state dicts and FP8 training's own subclass then see; and its hooks cannot tell a
backward re-gather from a new step. The custom comm keeps parameters plain tensors.

Two modes:

- **resharded** (default, any ``reshard_after_forward``): FSDP2 frees the unsharded parameters after backward
  (and after forward when ``reshard_after_forward`` is on), so the reconstruction is extra state: one
  unsharded copy of every unit in the all-gather dtype (2 bytes per parameter for bf16) plus one shard-sized
  copy of the last input, per rank. Re-gathers in backward reuse the reconstruction without communicating; a
  rank whose shard did not change since its last gather (micro-batches of one step) sends a zero delta, so all
  forward passes of a step see the same parameters. A gather over the smaller post-forward group
  (``reshard_after_forward`` = int) moves already reconstructed values and stays exact.
- **keep_unsharded** (ZeRO-2-like): parameters stay unsharded between steps (FSDP2's ``reshard_after_forward``
  and ``reshard_after_backward`` off) and the reconstruction *is* the unsharded parameter storage: no extra
  memory. FSDP2 then never re-gathers, so :meth:`DeltaFP8AllGather.step` (called after each optimizer step, or
  installed with :meth:`DeltaFP8AllGather.attach`) sends the deltas and adds them in place. Whenever FSDP2
  reshards anyway (a state dict), its next gather is its own exact one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.utils.hooks import RemovableHandle

from forge_lightning.strategies.comm.fp8_reduce_scatter import (
    GRADIENT_REDUCE,
    ReduceScatterStats,
    enable_fp8_reduce_scatter,
    fsdp_units,
    pack_fp8_rows,
    packed_row_bytes,
    unpack_fp8_rows,
)

PARAM_ALL_GATHER = ("exact", "delta_fp8")
"""Values of the ``param_all_gather`` option (``exact``: FSDP2's own all-gather)."""


def delta_all_gather_bytes(shard_numel: int, world_size: int, block: int = 256) -> int:
    """Bytes one rank sends in one delta-FP8 all-gather of a ``shard_numel``-element shard."""
    return (world_size - 1) * packed_row_bytes(shard_numel, block)


def exact_all_gather_bytes(shard_numel: int, world_size: int, element_size: int = 2) -> int:
    """Bytes one rank sends in an exact all-gather (``element_size`` 2 for bf16, 4 for fp32)."""
    return (world_size - 1) * shard_numel * element_size


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; earlier versions only have the former.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def exchange_deltas(delta: torch.Tensor, group: dist.ProcessGroup, block: int = 256) -> torch.Tensor:
    """All-gather every rank's block-quantized ``delta``; every rank gets the same dequantized values.

    Args:
        delta: ``[S]`` this rank's delta (the same size on every rank).
        group: the ranks to gather over.
        block: elements per fp32 scale.

    Returns:
        fp32 ``[W, S]``: row ``r`` is rank ``r``'s dequantized delta.
    """
    packed = pack_fp8_rows(delta.reshape(1, -1), block)[0]  # uint8 [S + 4 * ceil(S / block)]
    gathered = torch.empty(group.size() * packed.numel(), dtype=torch.uint8, device=packed.device)
    _all_gather(gathered, packed, group)
    return unpack_fp8_rows(gathered.view(group.size(), -1), delta.numel(), block)


@dataclass(kw_only=True)
class DeltaStats:
    """What the delta all-gathers of one model did on this rank (shared by all its units).

    Args:
        bytes_sent: bytes sent (payload and scales, or exact values on re-syncs).
        delta_gathers: gathers that sent FP8 deltas.
        exact_gathers: gathers that sent exact shards (the first of each unit, re-syncs, post-forward groups).
        replays: gathers answered from the reconstruction without communicating (re-gathers in backward).
        reconstruction_bytes: memory held across steps for reconstructions (0 in ``keep_unsharded`` mode).
    """

    bytes_sent: int = 0
    delta_gathers: int = 0
    exact_gathers: int = 0
    replays: int = 0
    reconstruction_bytes: int = 0


@dataclass(kw_only=True, eq=False)
class DeltaFP8AllGatherComm(AllGather):
    """FSDP2 custom all-gather of one unit in the resharded mode (see :func:`enable_delta_fp8_all_gather`).

    Args:
        param_group: the unit's FSDP2 parameter group (read for its training state and shard group).
        block: elements per fp32 scale.
        resync_every: every N-th forward gather of the unit sends exact shards (0: only the first).
        stats: counters shared by every unit of the model.
    """

    param_group: Any
    block: int = 256
    resync_every: int = 0
    stats: DeltaStats = field(default_factory=DeltaStats)
    recon: torch.Tensor | None = None  # [W, S] in the all-gather dtype
    last_input: torch.Tensor | None = None  # [S]: this rank's shard when it last sent
    forward_gathers: int = 0
    force_exact: bool = False  # set by DeltaFP8AllGather.request_resync

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain buffer, as FSDP2's default all-gather allocates."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        """Fill ``output_tensor`` ``[W · S]`` with the reconstruction, synchronously.

        ``input_tensor`` is FSDP2's view of this rank's slot in ``output_tensor``; it is read before the slot is
        overwritten with this rank's reconstructed chunk.
        """
        if group is not self.param_group.mesh_info.shard_process_group:
            self._exact(output_tensor, input_tensor, group, keep=False)
            return None
        out_WS = output_tensor.view(group.size(), -1)
        if self.recon is not None and _in_backward(self.param_group):
            out_WS.copy_(self.recon)
            self.stats.replays += 1
            return None
        due = self.resync_every > 0 and self.forward_gathers % self.resync_every == 0
        if self.recon is None or due or self.force_exact:
            self._exact(output_tensor, input_tensor, group, keep=True)
            self.force_exact = False
        else:
            self._delta(out_WS, input_tensor, group)
        self.forward_gathers += 1
        return None

    def _exact(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, keep: bool
    ) -> None:
        _all_gather(output, input, group)
        self.stats.exact_gathers += 1
        self.stats.bytes_sent += exact_all_gather_bytes(input.numel(), group.size(), input.element_size())
        if not keep:
            return
        out_WS = output.view(group.size(), -1)
        if self.recon is None:
            self.recon, self.last_input = out_WS.clone(), input.clone()
            self.stats.reconstruction_bytes += (self.recon.numel() + input.numel()) * input.element_size()
        else:
            self.recon.copy_(out_WS)
            self.last_input.copy_(input)

    def _delta(self, out_WS: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
        assert self.recon is not None and self.last_input is not None
        mine = self.recon[group.rank()]
        # A shard that did not move since its last send sends zeros: micro-batches of one step (and ranks whose
        # parameters are frozen) keep the parameters they had. Decided on the device: no host synchronisation.
        changed = (input != self.last_input).any()
        delta = torch.where(changed, input.float() - mine.float(), torch.zeros((), device=input.device))
        self.last_input.copy_(input)
        deltas_WS = exchange_deltas(delta, group, self.block)
        self.recon.add_(
            deltas_WS
        )  # computed in fp32, rounded once to the all-gather dtype: identical everywhere
        out_WS.copy_(self.recon)
        self.stats.delta_gathers += 1
        self.stats.bytes_sent += delta_all_gather_bytes(input.numel(), group.size(), self.block)


def _in_backward(param_group: Any) -> bool:
    """Whether FSDP2 is gathering this unit for backward (parameters unchanged since its forward gather)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    return param_group._training_state == TrainingState.PRE_BACKWARD


class DeltaFP8AllGather:
    """The delta-FP8 all-gather of one model, as returned by :func:`enable_delta_fp8_all_gather`.

    Args:
        units: ``(FSDP module, parameter group)`` pairs (see ``fsdp_units``).
        block: elements per fp32 scale.
        resync_every: exact re-sync period (forward gathers in the resharded mode, :meth:`step` calls in the
            ``keep_unsharded`` mode; 0: only the initial gather is exact).
        keep_unsharded: the ZeRO-2-like mode (parameters stay unsharded; :meth:`step` sends the deltas).
    """

    def __init__(
        self, units: list[tuple[Any, Any]], *, block: int, resync_every: int, keep_unsharded: bool
    ) -> None:
        self.units = units
        self.block = block
        self.resync_every = resync_every
        self.keep_unsharded = keep_unsharded
        self.stats = DeltaStats()
        self.steps = 0
        self.comms: list[DeltaFP8AllGatherComm] = []

    def step(self) -> None:
        """Send this step's deltas into the unsharded parameters (``keep_unsharded``; a no-op otherwise, where
        the next forward all-gather sends them). Collective: call on every rank after each optimizer step."""
        if not self.keep_unsharded:
            return
        self.steps += 1
        self._refresh(exact=self.resync_every > 0 and self.steps % self.resync_every == 0)

    def request_resync(self) -> None:
        """Re-synchronise exactly, e.g. after parameters were loaded or edited in place (a delta as large as the
        edit would carry an error of up to 1/16 of it). ``keep_unsharded``: the unsharded parameters are
        gathered exactly now; otherwise the next gather of every unit is exact. Collective: call on every rank."""
        if self.keep_unsharded:
            self._refresh(exact=True)
        for comm in self.comms:
            comm.force_exact = True

    @torch.no_grad()
    def _refresh(self, exact: bool) -> None:
        for _, group in self.units:
            if group.is_unsharded and group.mesh_info.shard_process_group.size() > 1:
                _refresh_unsharded(group, self.block, exact, self.stats)

    def attach(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Call :meth:`step` after every ``optimizer.step()``; returns the hook's handle."""
        return optimizer.register_step_post_hook(lambda *_: self.step())


def _refresh_unsharded(group: Any, block: int, exact: bool, stats: DeltaStats) -> None:
    """Bring one unit's unsharded parameters (the reconstruction) up to date with the sharded ones."""
    pg = group.mesh_info.shard_process_group
    world, rank = pg.size(), pg.rank()
    outs_WN = [fp.all_gather_outputs[0].view(world, -1) for fp in group.fsdp_params]
    shards = [fp._sharded_param_data.to(out.device, out.dtype) for fp, out in zip(group.fsdp_params, outs_WN)]
    sizes = [s.numel() for s in shards]
    if exact:
        gathered = torch.empty(world * sum(sizes), dtype=outs_WN[0].dtype, device=outs_WN[0].device)
        _all_gather(gathered, torch.cat(shards), pg)
        gathered_WS = gathered.view(world, -1)
        for out, values in zip(outs_WN, gathered_WS.split(sizes, dim=1)):
            out.copy_(values)
        stats.exact_gathers += 1
        stats.bytes_sent += exact_all_gather_bytes(sum(sizes), world, gathered_WS.element_size())
        return
    delta = torch.cat([s.float() - out[rank].float() for s, out in zip(shards, outs_WN)])
    deltas_WS = exchange_deltas(delta, pg, block)
    for out, values in zip(outs_WN, deltas_WS.split(sizes, dim=1)):
        out.add_(values)
    stats.delta_gathers += 1
    stats.bytes_sent += delta_all_gather_bytes(delta.numel(), world, block)


def _check_units(units: list[tuple[Any, Any]], keep_unsharded: bool) -> None:
    for _, group in units:
        for fp in group.fsdp_params:
            if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
                raise ValueError(
                    "param_all_gather='delta_fp8' cannot be combined with an all-gather extension (e.g. torchao's "
                    "float8 all-gather): the parameters are already gathered in a custom format"
                )
            if keep_unsharded and fp.fsdp_placement.dim != 0:
                raise ValueError(
                    f"keep_unsharded needs parameters sharded on dim 0, got {fp.fsdp_placement} (shard_placement_fn)"
                )


def enable_delta_fp8_all_gather(
    module: nn.Module,
    *,
    block: int = 256,
    resync_every: int = 0,
    keep_unsharded: bool = False,
) -> DeltaFP8AllGather:
    """Gather parameters as FP8 deltas against a per-rank reconstruction on every FSDP2 unit under ``module``.

    Call after ``fully_shard`` has been applied to the blocks and the root. The first gather of each unit is
    exact; every rank, the owner of a shard included, then computes with the same reconstructed parameters.

    Args:
        module: the root module (or any module holding ``fully_shard`` units).
        block: elements per fp32 scale of the deltas.
        resync_every: send exact shards every N-th time instead of deltas, which zeroes the error (0: never
            after the first gather). Resharded mode: every N-th forward all-gather of a unit (one per step
            without gradient accumulation, ``accumulate_grad_batches`` per step with it; validation forward
            passes count too). ``keep_unsharded``: every N-th :meth:`DeltaFP8AllGather.step`.
        keep_unsharded: keep parameters unsharded between steps (sets FSDP2's ``reshard_after_forward`` and
            ``reshard_after_backward`` off on every unit) and hold the reconstruction in the unsharded
            parameter storage; call :meth:`DeltaFP8AllGather.step` after each optimizer step (or
            :meth:`DeltaFP8AllGather.attach` the optimizer). Default: FSDP2 reshards as configured and the
            reconstruction costs one unsharded copy of the parameters (all-gather dtype) per rank.

    Returns:
        The handle: counters (``stats``), :meth:`~DeltaFP8AllGather.step` and :meth:`~DeltaFP8AllGather.attach`.
    """
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if not isinstance(resync_every, int) or resync_every < 0:
        raise ValueError(f"resync_every must be an int >= 0 (0: never re-sync), got {resync_every!r}")
    units = fsdp_units(module)
    _check_units(units, keep_unsharded)
    handle = DeltaFP8AllGather(units, block=block, resync_every=resync_every, keep_unsharded=keep_unsharded)
    for unit, group in units:
        if keep_unsharded:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
        else:
            comm = DeltaFP8AllGatherComm(
                param_group=group, block=block, resync_every=resync_every, stats=handle.stats
            )
            unit.set_custom_all_gather(comm)
            handle.comms.append(comm)
    return handle


@dataclass(kw_only=True)
class FSDPCommHandles:
    """What :func:`apply_fsdp_comm_options` enabled (``None`` where the exact FSDP2 collective stays).

    Args:
        all_gather: the delta-FP8 all-gather handle.
        reduce_scatter: the compressed reduce-scatter counters.
    """

    all_gather: DeltaFP8AllGather | None = None
    reduce_scatter: ReduceScatterStats | None = None


def check_fsdp_comm_options(
    param_all_gather: str,
    gradient_reduce: str,
    delta_resync_every: int,
    fp8_block: int = 256,
    delta_keep_unsharded: bool = False,
) -> None:
    """Raise a ``ValueError`` naming the option when a communication option of the FSDP2 strategy is invalid.

    Args:
        param_all_gather: ``exact`` or ``delta_fp8``.
        gradient_reduce: ``exact``, ``bf16`` or ``fp8``.
        delta_resync_every: int >= 0.
        fp8_block: elements per fp32 scale (positive int).
        delta_keep_unsharded: only with ``param_all_gather: delta_fp8``.
    """
    if delta_keep_unsharded and param_all_gather != "delta_fp8":
        raise ValueError(
            f"delta_keep_unsharded needs param_all_gather='delta_fp8', got param_all_gather={param_all_gather!r}"
        )
    if param_all_gather not in PARAM_ALL_GATHER:
        raise ValueError(f"param_all_gather must be one of {PARAM_ALL_GATHER}, got {param_all_gather!r}")
    if gradient_reduce not in GRADIENT_REDUCE:
        raise ValueError(f"gradient_reduce must be one of {GRADIENT_REDUCE}, got {gradient_reduce!r}")
    if (
        isinstance(delta_resync_every, bool)
        or not isinstance(delta_resync_every, int)
        or delta_resync_every < 0
    ):
        raise ValueError(
            f"delta_resync_every must be an int >= 0 (0: never re-sync), got {delta_resync_every!r}"
        )
    if isinstance(fp8_block, bool) or not isinstance(fp8_block, int) or fp8_block < 1:
        raise ValueError(f"fp8_block must be a positive int, got {fp8_block!r}")


def apply_fsdp_comm_options(
    module: nn.Module,
    *,
    param_all_gather: str = "exact",
    gradient_reduce: str = "exact",
    fp8_error_feedback: bool = True,
    delta_resync_every: int = 0,
    delta_keep_unsharded: bool = False,
    fp8_block: int = 256,
) -> FSDPCommHandles:
    """Enable the compressed FSDP2 collectives the strategy options ask for, after ``fully_shard``.

    Args:
        module: the root module.
        param_all_gather: ``exact`` (FSDP2's) or ``delta_fp8`` (:func:`enable_delta_fp8_all_gather`).
        gradient_reduce: ``exact`` (FSDP2's), ``bf16`` or ``fp8`` (:func:`enable_fp8_reduce_scatter`).
        fp8_error_feedback: error feedback for the compressed reduce-scatter.
        delta_resync_every: exact re-sync period of the delta all-gather.
        delta_keep_unsharded: the ZeRO-2-like delta mode (parameters stay unsharded between steps).
        fp8_block: elements per fp32 scale in both collectives.

    Returns:
        The handles of what was enabled.
    """
    check_fsdp_comm_options(
        param_all_gather, gradient_reduce, delta_resync_every, fp8_block, delta_keep_unsharded
    )
    handles = FSDPCommHandles()
    if param_all_gather == "delta_fp8":
        handles.all_gather = enable_delta_fp8_all_gather(
            module, block=fp8_block, resync_every=delta_resync_every, keep_unsharded=delta_keep_unsharded
        )
    if gradient_reduce != "exact":
        handles.reduce_scatter = enable_fp8_reduce_scatter(
            module, dtype=gradient_reduce, block=fp8_block, error_feedback=fp8_error_feedback
        )
    return handles

"""DDP communication hooks: bf16 compression and FP8 all-reduce, with exact all-reduce where it matters.

A hook averages one gradient bucket. Parameters listed as exact (1-D parameters such as norms and biases,
embeddings and the output head, whose gradients are sparse or sensitive) and buckets smaller than
``min_compress_numel`` use an exact fp32 all-reduce; everything else is compressed. On CUDA a hook runs its
quantization and collectives on a side stream and returns a future that the reducer's stream waits on, so
communication overlaps the rest of backward; on CPU (gloo) it runs synchronously and returns a completed future.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from forge_lightning.accelerators.capabilities import capabilities
from forge_lightning.strategies.comm.fp8_allreduce import fp8_all_reduce_, fp8_all_reduce_bytes

HOOKS = ("none", "bf16", "fp8")


@dataclass(kw_only=True)
class CommHookState:
    """What a compression hook needs and what it counts.

    Args:
        group: process group to reduce over (``None``: world).
        exact_params: parameters always reduced exactly in fp32.
        min_compress_numel: buckets (compressible parts) smaller than this are reduced exactly.
        block: FP8 elements per fp32 scale.
        error_feedback: keep each rank's FP8 quantization error and add it to the next step's gradient.
    """

    group: dist.ProcessGroup | None = None
    exact_params: set[int] = field(default_factory=set)  # ids of parameters
    min_compress_numel: int = 0
    block: int = 256
    error_feedback: bool = False
    # Error-feedback residuals per parameter (id): DDP rebuilds its buckets after the first step, so a bucket's
    # index does not name the same parameters throughout.
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    bytes_sent: int = 0
    compressed_numel: int = 0
    exact_numel: int = 0
    streams: dict[torch.device, torch.cuda.Stream] = field(default_factory=dict)


def _split(
    bucket: dist.GradBucket, state: CommHookState
) -> tuple[list[tuple[nn.Parameter, torch.Tensor]], list[torch.Tensor]]:
    """((parameter, gradient view) pairs to compress, exact gradient views) of the bucket."""
    compress, exact = [], []
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        if id(param) in state.exact_params:
            exact.append(grad)
        else:
            compress.append((param, grad))
    if sum(g.numel() for _, g in compress) < state.min_compress_numel:
        return [], [g for _, g in compress] + exact
    return compress, exact


def _exact_(grads: list[torch.Tensor], state: CommHookState) -> None:
    if not grads:
        return
    world = dist.get_world_size(state.group)
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=state.group)
    flat /= world
    _scatter(flat, grads)
    state.exact_numel += flat.numel()
    state.bytes_sent += 2 * (world - 1) * flat.numel() * 4 // world  # ring all-reduce


def _scatter(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _run(
    state: CommHookState, bucket: dist.GradBucket, reduce_: Callable[[], None]
) -> torch.futures.Future[torch.Tensor]:
    """Run ``reduce_`` (which averages the bucket in place) and return the bucket's future.

    On CUDA it runs on the state's side stream after the gradients are ready; the future records its completion
    there, and DDP's reducer makes its stream wait on it before reading the bucket.
    """
    buffer = bucket.buffer()
    if not capabilities(buffer.device).cuda_streams:
        reduce_()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    if buffer.device not in state.streams:  # one side stream per device, made on the first bucket
        state.streams[buffer.device] = torch.cuda.Stream(buffer.device)
    stream = state.streams[buffer.device]
    stream.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(stream):
        reduce_()
        fut = torch.futures.Future(devices=[buffer.device])
        fut.set_result(buffer)
    return fut


def fp8_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with :func:`fp8_all_reduce_` (exact parameters and small buckets in fp32)."""
    return _run(state, bucket, lambda: _fp8_reduce_(state, bucket))


def _fp8_reduce_(state: CommHookState, bucket: dist.GradBucket) -> None:
    pairs, exact = _split(bucket, state)
    _exact_(exact, state)
    if pairs:
        world = dist.get_world_size(state.group)
        compress = [g for _, g in pairs]
        flat = torch.cat([g.reshape(-1).float() for g in compress])
        residual = parts = None
        if state.error_feedback:
            parts = [
                state.residuals.setdefault(
                    id(p), torch.zeros(g.numel(), dtype=torch.float32, device=g.device)
                )
                for p, g in pairs
            ]
            residual = torch.cat(parts)
        fp8_all_reduce_(flat, state.group, block=state.block, residual=residual)
        if parts is not None:
            _scatter(residual, parts)  # each parameter's new residual, for whichever bucket holds it next
        _scatter(flat, compress)
        state.compressed_numel += flat.numel()
        state.bytes_sent += fp8_all_reduce_bytes(flat.numel(), world, state.block)


def bf16_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bf16 (exact parameters and small buckets in fp32); works on gloo and NCCL."""
    return _run(state, bucket, lambda: _bf16_reduce_(state, bucket))


def _bf16_reduce_(state: CommHookState, bucket: dist.GradBucket) -> None:
    pairs, exact = _split(bucket, state)
    _exact_(exact, state)
    compress = [g for _, g in pairs]
    if compress:
        world = dist.get_world_size(state.group)
        flat = torch.cat([g.reshape(-1) for g in compress]).to(torch.bfloat16)
        dist.all_reduce(flat, group=state.group)
        _scatter(flat.float() / world, compress)
        state.compressed_numel += flat.numel()
        state.bytes_sent += 2 * (world - 1) * flat.numel() * 2 // world


def exact_parameters(model: nn.Module, head_modules: Iterable[nn.Module] = ()) -> set[int]:
    """Ids of the parameters reduced exactly: every parameter with at most one dimension, every embedding's,
    and those of ``head_modules`` (e.g. the output head)."""
    exact = {id(p) for p in model.parameters() if p.dim() <= 1}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            exact.update(id(p) for p in module.parameters())
    for module in head_modules:
        exact.update(id(p) for p in module.parameters())
    return exact


def make_comm_hook(name: str) -> Callable[[CommHookState, dist.GradBucket], torch.futures.Future] | None:
    """The hook called ``name`` (``none`` / ``bf16`` / ``fp8``; ``none`` gives ``None``: DDP's own all-reduce)."""
    if name not in HOOKS:
        raise ValueError(f"comm_hook must be one of {HOOKS}, got {name!r}")
    return {"none": None, "bf16": bf16_hook, "fp8": fp8_hook}[name]

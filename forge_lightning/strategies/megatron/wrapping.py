"""Wrapping a twin's chunks in megatron-core's ``DistributedDataParallel`` and connecting them to the schedule.

Family-agnostic: works on any chunks a :class:`~forge_lightning.contracts.MegatronTwin` builds (megatron
``MegatronModule`` s with a ``config``); a routed expert is recognised by megatron-core's own ``MoELayer``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from forge_lightning.contracts import MegatronDims


def chunk_config(chunk: nn.Module) -> Any:
    """The ``TransformerConfig`` of a chunk, through megatron's wrappers (DDP, Float16Module)."""
    while not hasattr(chunk, "config") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk.config


def _mark_expert_parameters(chunk: nn.Module) -> None:
    """Tag every routed expert's parameters for megatron's expert data-parallel group (``allreduce = False``).

    megatron-core 0.16 tags them only when ``expert_model_parallel_size > 1``; with EP = 1 and ETP ≠ TP its DDP
    would then reduce the experts' gradients over the data-parallel ranks only and miss the TP ranks that routed
    other tokens to the same experts. Its optimizer and gradient norm follow the same tag."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in chunk.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():
                param.allreduce = False


def wrap_ddp(chunks: list[nn.Module], dims: MegatronDims, *, overlap_grad_reduce: bool) -> list[nn.Module]:
    """Wrap each chunk in megatron's ``DistributedDataParallel`` (contiguous fp32 gradient buffers).

    Args:
        chunks: this rank's model chunks.
        dims: the strategy's layout (distributed optimizer, parameter-gather overlap, experts' reduction group).
        overlap_grad_reduce: reduce gradient buckets while backward runs.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=dims.overlap_param_gather,
        align_param_gather=dims.overlap_param_gather and dims.pp > 1,
        use_distributed_optimizer=dims.use_distributed_optimizer,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        if dims.experts_apart:
            _mark_expert_parameters(chunk)
        # Only the first chunk is bucketed: later chunks' gradients are ready last in backward anyway.
        ddp = DistributedDataParallel(chunk_config(chunk), ddp_config, chunk, disable_bucketing=i > 0)
        ddp.broadcast_params()
        wrapped.append(ddp)
    return wrapped


def connect_schedule(chunks: list[nn.Module], optimizer: Any, dims: MegatronDims, overlap: bool) -> None:
    """Hand megatron's schedule the gradient finalisation, loss scaling and the overlap hooks of the chunks.

    Args:
        chunks: the DDP-wrapped chunks.
        optimizer: megatron's optimizer (its ``scale_loss`` scales the loss for fp16).
        dims: the strategy's layout.
        overlap: ``overlap_grad_reduce``.
    """
    from megatron.core.distributed import finalize_model_grads

    def one_or_list(fns: list[Any]) -> Any:
        return fns[0] if len(fns) == 1 else fns

    config = chunk_config(chunks[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if overlap:
        config.no_sync_func = one_or_list([c.no_sync for c in chunks])
        config.grad_sync_func = one_or_list([c.start_grad_sync for c in chunks])
    if dims.overlap_param_gather and dims.pp > 1:
        config.param_sync_func = one_or_list([c.start_param_sync for c in chunks])

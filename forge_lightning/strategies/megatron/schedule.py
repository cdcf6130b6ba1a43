"""One optimizer step's micro-batches through megatron-core's pipeline schedule.

::

    micro-batches of the step ──> get_forward_backward_func()  (no pipelining | 1F1B | interleaved 1F1B)
                                   forward step: the twin's (MegatronTwin.forward_step) -> output, loss function
                                   loss function: (loss sum, count) of the micro-batch (last stage)
                                   finalize_model_grads: DP x CP all-reduce, tied-embedding sync, grads / global count

With ``calculate_per_token_loss`` the schedule sums the counts of every micro-batch and megatron's
``finalize_model_grads`` all-reduces that count over data- and context-parallel ranks and divides the gradients by
it: the gradient of (sum of item losses of the global batch) / (its items), the one batch rule's loss. The twin's
loss functions are the module's (its family's ``forward_step``); nothing here knows a family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from forge_lightning.contracts import LOSS_AND_COUNT, MegatronTwin


def run_schedule(
    chunks: list[nn.Module], batches: list[dict[str, Tensor]], *, forward_only: bool, twin: MegatronTwin
) -> Tensor:
    """Run forward (and backward) of ``batches`` through megatron's schedule.

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage).
        batches: the micro-batches of one optimizer step (or one evaluation batch).
        forward_only: evaluation (no backward, no gradient finalisation).
        twin: the module's megatron-core model (its forward step and micro-batch shape).

    Returns:
        ``[loss sum, count]`` (float64) of this rank's micro-batches (its share of the sequence under context
        parallelism: sum over the data- and context-parallel ranks for the batch's), on every pipeline stage
        (reduced from the last).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batch, seq_length = twin.micro_batch_shape(batches[0])

    def step(
        data_iterator: Any, model: nn.Module, return_schedule_plan: bool = False
    ) -> tuple[Any, Callable]:
        if return_schedule_plan:  # overlap_moe_expert_parallel_comm: megatron's combined 1F1B schedule
            return twin.forward_step(next(data_iterator), model, schedule_plan=True)
        return twin.forward_step(next(data_iterator), model)

    iterators: Any = [iter(batches) for _ in chunks]
    outputs = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch,
        forward_only=forward_only,
    )
    device = next(chunks[0].parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for out in outputs:  # only the last stage has outputs
        sums += out[LOSS_AND_COUNT].to(device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())
    return sums


def check_interleaved_micro_batches(pp: int, vpp: int | None, accumulate: int) -> None:
    """Raise ``ValueError`` unless the interleaved schedule can run ``accumulate`` micro-batches per step.

    megatron-core's interleaved 1F1B runs each virtual stage on groups of ``pp`` consecutive micro-batches
    (``microbatch_group_size_per_vp_stage``, default PP), so their count must be a multiple of PP.

    Args:
        pp: ``pipeline_model_parallel_size``.
        vpp: ``virtual_pipeline_model_parallel_size`` (``None`` or 1: not interleaved, any count works).
        accumulate: ``trainer.accumulate_grad_batches``, the micro-batches of one optimizer step.
    """
    if vpp is None or vpp == 1 or accumulate % pp == 0:
        return
    raise ValueError(
        f"virtual_pipeline_model_parallel_size={vpp} (interleaved 1F1B) runs micro-batches in groups of "
        f"pipeline_model_parallel_size={pp}: trainer.accumulate_grad_batches ({accumulate}) must be a multiple "
        f"of {pp} (e.g. {accumulate // pp * pp or pp} or {(accumulate // pp + 1) * pp}; keep the global batch by "
        "adjusting data.batch_size)"
    )


def eval_micro_batches(
    batch: dict[str, Tensor], count: int, *, twin: MegatronTwin
) -> list[dict[str, Tensor]]:
    """``count`` micro-batches carrying exactly ``batch``'s loss and items (for the interleaved schedule).

    Split along the batch dimension when it divides, else ``batch`` plus ``count - 1`` copies of the twin's
    :meth:`~forge_lightning.contracts.MegatronTwin.padding_batch` (no loss, no items).

    Args:
        batch: one evaluation batch.
        count: micro-batches wanted (1: ``[batch]``).
        twin: the module's megatron-core model (the batch's size and its padding batch).
    """
    size = twin.micro_batch_shape(batch)[0]
    if count == 1:
        return [batch]
    if size % count == 0:
        keys = [k for k, v in batch.items() if isinstance(v, Tensor) and v.ndim and v.shape[0] == size]
        parts = {k: batch[k].chunk(count) for k in keys}
        return [{**batch, **{k: parts[k][i] for k in keys}} for i in range(count)]
    return [batch] + [twin.padding_batch(batch)] * (count - 1)

"""One optimizer step's micro-batches through megatron-core's pipeline schedule.

::

    micro-batches of the step ──> get_forward_backward_func()  (no pipelining | 1F1B | interleaved 1F1B)
                                   forward_step: GPTModel(input_ids, labels) -> per-token loss [b, s] (last stage)
                                   loss: sum over trainable tokens (labels != ignore_index), token count
                                   finalize_model_grads: DP all-reduce, tied-embedding sync, grads / global tokens

With ``calculate_per_token_loss`` the schedule sums the token counts of every micro-batch and megatron's
``finalize_model_grads`` all-reduces that count over data-parallel ranks and divides the gradients by it: the
gradient of (sum of token losses of the global batch) / (its trainable tokens), the one batch rule's loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn


def forward_step(ignore_index: int, data_iterator: Iterator[dict[str, Tensor]], model: nn.Module) -> tuple:
    """megatron's ``forward_step_func``: the chunk's output and the loss function of its micro-batch.

    Args:
        ignore_index: label value excluded from the loss.
        data_iterator: this chunk's iterator over the step's micro-batches.
        model: one model chunk.
    """
    batch = next(data_iterator)
    if batch.get("document_ids") is not None:
        raise NotImplementedError("packed batches (document_ids) are not yet supported by MegatronStrategy")
    labels = batch["labels"]
    mask = labels != ignore_index
    # Ignored positions get a valid class id; their loss is masked out below.
    output = model(batch["input_ids"], None, None, labels=labels.masked_fill(~mask, 0))
    return output, partial(masked_loss_sum, mask)


def masked_loss_sum(mask: Tensor, losses_BS: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(sum of the trainable tokens' losses, their count, the pair for logging) of one micro-batch."""
    loss_sum = (losses_BS.float() * mask).sum()
    tokens = mask.sum().to(torch.int)
    return loss_sum, tokens, {"loss_and_tokens": torch.stack([loss_sum.detach().double(), tokens.double()])}


def run_schedule(
    chunks: list[nn.Module],
    batches: list[dict[str, Tensor]],
    *,
    ignore_index: int,
    forward_only: bool,
) -> Tensor:
    """Run forward (and backward) of ``batches`` through megatron's schedule.

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage).
        batches: the micro-batches of one optimizer step (or one evaluation batch).
        ignore_index: label value excluded from the loss.
        forward_only: evaluation (no backward, no gradient finalisation).

    Returns:
        ``[loss sum, trainable tokens]`` (float64) of this data-parallel rank's micro-batches, on every pipeline
        stage (broadcast from the last).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batch, seq_length = batches[0]["input_ids"].shape
    iterators: Any = [iter(batches) for _ in chunks]
    outputs = get_forward_backward_func()(
        forward_step_func=partial(forward_step, ignore_index),
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch,
        forward_only=forward_only,
    )
    device = batches[0]["input_ids"].device
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for out in outputs:  # only the last stage has outputs
        sums += out["loss_and_tokens"].to(device)
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


def eval_micro_batches(batch: dict[str, Tensor], count: int, *, ignore_index: int) -> list[dict[str, Tensor]]:
    """``count`` micro-batches carrying exactly ``batch``'s trainable tokens (for the interleaved schedule).

    Split along the batch dimension when it divides, else ``batch`` plus ``count - 1`` copies whose labels are all
    ``ignore_index`` (they add no loss and no tokens).

    Args:
        batch: one evaluation batch (``input_ids``, ``labels`` ``[b, s]``).
        count: micro-batches wanted (1: ``[batch]``).
        ignore_index: label value excluded from the loss.
    """
    size = batch["input_ids"].shape[0]
    if count == 1:
        return [batch]
    if size % count == 0:
        keys = [k for k, v in batch.items() if isinstance(v, Tensor) and v.ndim and v.shape[0] == size]
        parts = {k: batch[k].chunk(count) for k in keys}
        return [{**batch, **{k: parts[k][i] for k in keys}} for i in range(count)]
    padding = {**batch, "labels": torch.full_like(batch["labels"], ignore_index)}
    return [batch] + [padding] * (count - 1)

"""One optimizer step's micro-batches through megatron-core's pipeline schedule.

::

    micro-batches of the step ──> get_forward_backward_func()  (no pipelining | 1F1B | interleaved 1F1B)
                                   forward_step: GPTModel(input_ids, labels) -> per-token loss [b, s] (last stage)
                                   loss: sum over trainable tokens (labels != ignore_index), token count
                                   finalize_model_grads: DP x CP all-reduce, tied-embedding sync, grads / global tokens

With ``calculate_per_token_loss`` the schedule sums the token counts of every micro-batch and megatron's
``finalize_model_grads`` all-reduces that count over data- and context-parallel ranks and divides the gradients by
it: the gradient of (sum of token losses of the global batch) / (its trainable tokens), the one batch rule's loss.
With context parallelism each micro-batch is first cut to this rank's share of the sequence
(:func:`shard_on_context_parallel_rank`); megatron's DDP all-reduces the gradients over the DP x CP group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    position_ids, document_ids = packed_inputs(batch, model)
    batch = shard_on_context_parallel_rank(batch)
    labels = batch["labels"]
    mask = labels != ignore_index
    # Ignored positions get a valid class id; their loss is masked out below. The document ids travel as the
    # attention mask (a tensor: megatron's recompute saves it) to SDPACoreAttention.
    output = model(batch["input_ids"], position_ids, document_ids, labels=labels.masked_fill(~mask, 0))
    return output, partial(masked_loss_sum, mask)


def packed_inputs(batch: dict[str, Tensor], model: nn.Module) -> tuple[Tensor | None, Tensor | None]:
    """``(position_ids, document_ids)`` ``[b, S]`` of a micro-batch for the twin, as the native model reads them.

    A packed batch (``document_ids``) attends within each document, and its positions restart at every document
    unless the batch gives ``position_ids`` (:func:`~forge_lightning.modules.layers.attention.document_positions`);
    both stay whole under context parallelism (the twin cuts the rotary table to this rank's chunks, Ulysses
    attention sees the whole sequence). ``(None, None)`` for an unpacked batch without ``position_ids``.

    Raises:
        NotImplementedError: a packed batch with a twin whose attention cannot take the document mask
            (TransformerEngine's layer spec) or that rotates inside its layers (multi-latent attention).
    """
    from forge_lightning.modules.layers.attention import document_positions
    from forge_lightning.modules.llm.megatron import unwrap
    from forge_lightning.strategies.megatron.layer_spec import SDPACoreAttention

    position_ids, document_ids = batch.get("position_ids"), batch.get("document_ids")
    if document_ids is None:
        return position_ids, None
    gpt = unwrap(model)
    if gpt.config.multi_latent_attention:
        raise NotImplementedError(
            "packed batches (document_ids) with multi-latent attention (DeepSeek-V3) are not yet supported by "
            "MegatronStrategy: megatron's MLA rotates queries and keys at positions 0..s-1 inside each layer"
        )
    core = gpt.decoder.layers[0].self_attention.core_attention if len(gpt.decoder.layers) else None
    if core is not None and not isinstance(core, SDPACoreAttention):
        raise NotImplementedError(
            f"packed batches (document_ids) need the twin's SDPA core attention, got {type(core).__name__} "
            "(TransformerEngine's layer spec): set use_transformer_engine: false"
        )
    return (document_positions(document_ids) if position_ids is None else position_ids), document_ids


def shard_on_context_parallel_rank(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """This context-parallel rank's share of the micro-batch's ``input_ids`` and ``labels`` (``[b, S]`` ->
    ``[b, S / CP]``), in megatron's load-balanced layout (``get_batch_on_this_cp_rank``).

    The sequence is cut into ``2 * CP`` chunks and rank ``r`` keeps chunks ``r`` and ``2 * CP - 1 - r`` (CP = 2: rank 0
    positions ``[0, S/4) + [3S/4, S)``), the order megatron's rotary embedding assumes when it picks this rank's
    positions; labels are cut the same way, so each rank's loss is over its own tokens.

    Args:
        batch: one micro-batch (the same on every rank of the CP group).

    Raises:
        ValueError: the sequence length is not divisible by ``2 * CP``.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return batch
    seq = batch["input_ids"].shape[1]
    if seq % (2 * cp):
        raise ValueError(
            f"context_parallel_size={cp} splits each sequence into 2 x {cp} = {2 * cp} chunks (megatron's causal "
            f"load-balanced layout): the sequence length ({seq}) must be divisible by {2 * cp}; change "
            "data.seq_length"
        )
    return {**batch, **get_batch_on_this_cp_rank({k: batch[k] for k in ("input_ids", "labels")})}


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
    step_func: Callable[..., tuple] = forward_step,
) -> Tensor:
    """Run forward (and backward) of ``batches`` through megatron's schedule.

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage).
        batches: the micro-batches of one optimizer step (or one evaluation batch).
        ignore_index: label value excluded from the loss.
        forward_only: evaluation (no backward, no gradient finalisation).
        step_func: ``step_func(ignore_index, data_iterator, model)``, the forward step (:func:`forward_step`; a
            composed model's runs its encoder side first, see components.py).

    Returns:
        ``[loss sum, trainable tokens]`` (float64) of this rank's micro-batches (its share of the sequence under
        context parallelism: sum over the data- and context-parallel ranks for the batch's), on every pipeline
        stage (broadcast from the last).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batch, seq_length = batches[0]["input_ids"].shape
    iterators: Any = [iter(batches) for _ in chunks]
    outputs = get_forward_backward_func()(
        forward_step_func=partial(step_func, ignore_index),
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


def router_loss_metrics(config: Any, num_micro_batches: int, device: torch.device) -> dict[str, Tensor]:
    """The MoE router losses of the step that just ran, as the native ``CausalLM`` logs them; clears megatron's
    tracker. Collective over the pipeline, tensor x context and data-parallel groups (empty dict for a dense model).

    megatron's tracker holds, per layer and summed over the step's micro-batches, each router's loss divided by
    its coefficient: the load-balancing loss ``E / K * sum_e f_e * P_e`` (a partial sum per sequence- or
    context-parallel rank) and the z-loss (a mean over the rank's tokens). Logged: ``train/router_aux_loss`` (times K, so that
    balanced routing gives K as natively) and ``train/router_z_loss``, each a mean over MoE layers, micro-batches
    and data-parallel ranks.

    Args:
        config: the model's ``TransformerConfig`` (``moe_router_topk``, ``moe_layer_freq``).
        num_micro_batches: micro-batches of the step on each data-parallel rank.
        device: where this rank's model lives (for the collectives).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    if not getattr(config, "num_moe_experts", None):
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    freq = config.moe_layer_freq
    num_moe_layers = sum(freq) if isinstance(freq, list) else len(range(0, config.num_layers, freq))
    metrics = {}
    # Summed per layer over the TP x CP ranks' partial sums (load balancing) or averaged over their token means (z).
    tp_cp = parallel_state.get_tensor_and_context_parallel_group()
    losses = (
        ("load_balancing_loss", "train/router_aux_loss", config.moe_router_topk, False),
        ("z_loss", "train/router_z_loss", 1, True),
    )
    # A pipeline stage without MoE layers (e.g. DeepSeek-V3's dense first layers) tracks nothing: the stages agree
    # on the tracked losses first, then each adds its layers' values (zeros where it has none).
    tracked = torch.tensor([float(name in tracker) for name, *_ in losses], device=device)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    torch.distributed.all_reduce(tracked, op=torch.distributed.ReduceOp.MAX, group=pp_group)
    for (name, key, scale, shard_mean), on in zip(losses, tracked.tolist(), strict=True):
        if not on:
            continue
        if name in tracker:
            values = tracker[name]["values"].clone()
        else:
            values = torch.zeros(config.num_layers, device=device)
        torch.distributed.all_reduce(values, group=pp_group)
        torch.distributed.all_reduce(values, group=tp_cp)
        torch.distributed.all_reduce(values, group=parallel_state.get_data_parallel_group())
        shards = torch.distributed.get_world_size(tp_cp) if shard_mean else 1
        dp = parallel_state.get_data_parallel_world_size()
        metrics[key] = (values.sum() * scale / (num_moe_layers * num_micro_batches * dp * shards)).float()
    clear_aux_losses_tracker()
    return metrics


def expert_load_metrics(config: Any, chunks: list[nn.Module]) -> dict[str, Tensor]:
    """``moe/expert_load_max_over_mean`` of the step that just ran, as the native ``CausalLM`` logs it: per MoE
    layer, the most tokens any expert was routed over the mean per expert, averaged over the layers; 1 is perfect
    balance. The counts are the routers' (:class:`~.layer_spec.MegatronTopKRouter`) over the step's micro-batches,
    summed over the tensor x context-parallel ranks (each routes its sequence shard) and the data-parallel ranks:
    the global batch. Clears the counts. Collective over those groups and the pipeline (empty dict for a dense
    model).

    Args:
        config: the model's ``TransformerConfig`` (``num_moe_experts``).
        chunks: this rank's model chunks.
    """
    from megatron.core import parallel_state

    from forge_lightning.strategies.megatron.layer_spec import MegatronTopKRouter

    if not getattr(config, "num_moe_experts", None):
        return {}
    routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MegatronTopKRouter)]
    counts = [r.step_tokens_per_expert for r in routers if r.step_tokens_per_expert is not None]
    for router in routers:
        router.step_tokens_per_expert = None
    # (sum of the layers' ratios, number of layers): a stage without MoE layers adds zeros
    total = torch.zeros(2, device=next(chunks[0].parameters()).device)
    if counts:
        counts_LE = torch.stack(counts)
        torch.distributed.all_reduce(counts_LE, group=parallel_state.get_tensor_and_context_parallel_group())
        torch.distributed.all_reduce(counts_LE, group=parallel_state.get_data_parallel_group())
        ratio_L = counts_LE.amax(dim=-1) / counts_LE.mean(dim=-1).clamp_min(1e-9)
        total = torch.stack([ratio_L.sum(), torch.tensor(float(len(ratio_L)), device=ratio_L.device)])
    torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    # No host sync: a MoE model's step always routed tokens on some stage.
    return {"moe/expert_load_max_over_mean": (total[0] / total[1].clamp_min(1)).float()}

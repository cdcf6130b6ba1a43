"""The decoder twin's forward step of one micro-batch, for megatron-core's schedule.

::

    plain:    batch ─ packed_inputs (positions, document ids) ─ this CP rank's share ─ GPTModel(input_ids, labels)
    composed: batch ─ build.encode (the encoder side, over the TP group) ─┐
              input_ids ─ the twin's token embeddings ───────────────────┴─ composition.merge ─ decoder_input ─
              GPTModel(decoder_input=..., position_ids, labels, layer_residuals)
                  (later pipeline stages: the previous stage's output; each stage the batch's position_ids)
    both:     per-token losses [b, s] (last stage) ─ LMLoss.reduce ─ (loss sum, trainable tokens)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from forge_lightning.contracts import LOSS_AND_COUNT, Composition
from forge_lightning.modules.layers.attention import document_positions
from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.megatron.gpt import unwrap


def forward_step(
    batch: dict[str, Tensor], chunk: nn.Module, loss: LMLoss, *, schedule_plan: bool = False
) -> tuple[Any, Callable]:
    """The chunk's output on a plain (not composed) micro-batch and its loss function.

    Ignored positions get a valid class id for megatron's cross-entropy; their loss is masked out by
    :meth:`LMLoss.reduce`. The document ids travel as the attention mask (a tensor: megatron's recompute saves it)
    to the SDPA core attention. With ``schedule_plan`` (``overlap_moe_expert_parallel_comm``: megatron-core's
    combined 1F1B schedule, which hands the unwrapped model) the chunk's schedule plan of the same inputs instead of
    its output; the plan runs the model's own pre- and post-processing, so the loss is the same.
    """
    position_ids, document_ids = packed_inputs(batch, chunk)
    batch = shard_on_context_parallel_rank(batch)
    labels = batch["labels"]
    trainable = labels.masked_fill(labels == loss.ignore_index, 0)
    if schedule_plan:
        plan = unwrap(chunk).build_schedule_plan(
            batch["input_ids"], position_ids, document_ids, labels=trainable
        )
        return plan, loss_function(loss, labels)
    output = chunk(batch["input_ids"], position_ids, document_ids, labels=trainable)
    return output, loss_function(loss, labels)


def composed_forward_step(
    batch: dict[str, Tensor],
    chunk: nn.Module,
    loss: LMLoss,
    composition: Composition,
    encode: Callable[[dict[str, Tensor]], Tensor],
) -> tuple[Tensor, Callable]:
    """The chunk's output on a micro-batch of a composed model (encoder -> projector -> this decoder): the encoder
    side's output (``encode``, run by the strategy over the TP group) merged with the twin's token embeddings by the
    composition, then the decoder on the merged inputs.

    With pipeline parallelism only the first stage merges; the later ones take their input from the previous stage
    and the last one's labels are ``batch["labels"]``: the merge must then keep the text positions and their labels
    (a VLM's features in place of its placeholder tokens do; checked on the first stage). Every stage rotates by the
    composition's ``position_ids`` of the batch; the composition's ``layer_residuals`` (DeepStack) are added on the
    first stage, whose chunk must hold their layers.
    """
    if batch.get("document_ids") is not None:
        raise NotImplementedError(
            "packed batches (document_ids) of a composed model (encoder -> projector -> LLM) are not yet "
            "supported by MegatronStrategy: the merge changes the sequence, so the document ids would not match"
        )
    gpt = unwrap(chunk)
    position_ids = None if composition.position_ids is None else composition.position_ids(batch)
    if not gpt.pre_process:  # a later pipeline stage: its input is the previous stage's output
        labels_BS = batch["labels"]
        trainable = labels_BS.masked_fill(labels_BS == loss.ignore_index, 0)
        return chunk(None, position_ids, None, labels=trainable), loss_function(loss, labels_BS)
    # The twin's token embeddings, whole on every TP rank (all-reduced, not scattered: see DecoderTwin).
    tokens_BSH = gpt.embedding.word_embeddings(batch["input_ids"])
    encoded = encode(batch).to(tokens_BSH.dtype)
    inputs_BTH, labels_BT = composition.merge(tokens_BSH, encoded, batch)
    residuals = [] if composition.layer_residuals is None else composition.layer_residuals(encoded, batch)
    if gpt.config.pipeline_model_parallel_size > 1 and not _keeps_text(labels_BT, batch["labels"]):
        raise ValueError(
            f"pipeline_model_parallel_size > 1 needs a composition whose merge keeps the text positions and their "
            f"labels (the last stage reads batch['labels']): merge gave labels {list(labels_BT.shape)} for labels "
            f"{list(batch['labels'].shape)}; use pipeline_model_parallel_size 1 for this model"
        )
    trainable = labels_BT.masked_fill(labels_BT == loss.ignore_index, 0)
    inputs = decoder_input(gpt, inputs_BTH)
    output = chunk(
        None, position_ids, None, decoder_input=inputs, labels=trainable, layer_residuals=residuals
    )
    return output, loss_function(loss, labels_BT)


def _keeps_text(labels_BT: Tensor, labels_BS: Tensor) -> bool:
    return labels_BT.shape == labels_BS.shape and bool(torch.equal(labels_BT, labels_BS))


def loss_function(
    loss: LMLoss, labels: Tensor
) -> Callable[[Tensor], tuple[Tensor, Tensor, dict[str, Tensor]]]:
    """megatron's loss function of one micro-batch: the trainable tokens' loss sum, their count and the pair for
    the module's bookkeeping (:data:`~forge_lightning.contracts.LOSS_AND_COUNT`)."""

    def reduce(losses_BS: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        loss_sum, count = loss.reduce(losses_BS, labels)
        pair = torch.stack([loss_sum.detach().double(), count.double()])
        return loss_sum, count.to(torch.int), {LOSS_AND_COUNT: pair}

    return reduce


def decoder_input(gpt: nn.Module, inputs_BTH: Tensor) -> Tensor:
    """The twin's ``decoder_input`` from merged embeddings ``[b, T, H]``: sequence first, embedding dropout, and
    under sequence parallelism this TP rank's share of the sequence (what megatron's own embedding does)."""
    from megatron.core import tensor_parallel

    config = gpt.config
    x_TBH = inputs_BTH.transpose(0, 1).contiguous()
    if not config.sequence_parallel:
        return gpt.embedding.embedding_dropout(x_TBH)
    tp = config.tensor_model_parallel_size
    if x_TBH.shape[0] % tp:
        raise ValueError(
            f"sequence_parallel: the decoder's input length ({x_TBH.shape[0]}: the merged encoder and text positions) "
            f"must be divisible by tensor_model_parallel_size ({tp})"
        )
    x_TBH = tensor_parallel.scatter_to_sequence_parallel_region(x_TBH).clone()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        return gpt.embedding.embedding_dropout(x_TBH)


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
    from forge_lightning.modules.llm.megatron.layer_spec import SDPACoreAttention

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

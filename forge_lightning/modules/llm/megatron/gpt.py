"""One megatron-core ``GPTModel`` chunk of a decoder LM, with the native model's RoPE and loss."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers.rope import rope_inv_freq
from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.loss import LMLoss


def build_gpt_model(
    config: LLMConfig,
    tf_config: Any,
    decoder_spec: Any,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    loss: LMLoss | None = None,
    fused_loss: bool = False,
) -> nn.Module:
    """Build one megatron-core ``GPTModel`` chunk (this rank's TP shard of one pipeline stage).

    RoPE frequencies (plain, linear or llama3-scaled) are those of forge's own model, so the twin computes the
    same function as :class:`~forge_lightning.modules.llm.model.DecoderLM`; the chunk is a
    :func:`forge_gpt_model_class`, whose RoPE follows ``position_ids`` and whose per-token loss adds the z-loss.

    Args:
        config: the decoder's configuration.
        tf_config: its ``TransformerConfig`` (see :func:`transformer_config`).
        decoder_spec: the layer spec or decoder block spec to build the layers from.
        pre_process: this chunk holds the embedding (first stage).
        post_process: this chunk holds the final norm and output layer (last stage).
        vp_stage: virtual pipeline stage of this chunk.
        loss: the module's loss (its ``z_loss`` is added to every token's cross-entropy; default: none).
        fused_loss: at tensor-parallel size 1, the per-token loss is ``loss.per_token``: forge's fused linear +
            cross-entropy, which never builds the fp32 logits. Otherwise (or with the vocabulary split over TP
            ranks) megatron's output layer and vocab-parallel cross-entropy.
    """
    tp = tf_config.tensor_model_parallel_size
    model = forge_gpt_model_class()(
        config=tf_config,
        transformer_layer_spec=decoder_spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(config.rope_theta),
        vp_stage=vp_stage,
    )
    # With MLA each layer's attention has its own rotary embedding (of a head's rotary part), the model none.
    if config.mla is None:
        rotaries = [model.rotary_pos_emb]
    else:
        rotaries = [layer.self_attention.rotary_pos_emb for layer in model.decoder.layers]
    for rotary in rotaries:
        rotary.inv_freq = rope_inv_freq(config.rope_head_dim, config.rope_theta, config.rope_scaling)
    model.loss = LMLoss() if loss is None else loss
    model.fused_loss = fused_loss and tp == 1
    return model


@functools.cache
def forge_gpt_model_class() -> type:
    """megatron's ``GPTModel`` with two native behaviours (a function: megatron is imported on first use).

    * **RoPE at** ``position_ids``: megatron's rotary embedding always covers positions ``0..s-1``; given
      ``position_ids`` ``[b, s]`` (packed rows: restarting at every document, see
      :func:`~forge_lightning.modules.layers.attention.document_positions`) the twin rotates each token by its own
      position, from megatron's table of the same frequencies (``[s, b, 1, dim]``; under context parallelism this
      rank's chunks of it, as megatron cuts its own). MLA rotates inside each layer: not covered (refused upstream).
    * **z-loss**: the module's ``loss.z_loss * logsumexp(logits)^2`` added to every token's cross-entropy, the
      logsumexp taken over the whole vocabulary across the TP ranks' shards (:func:`vocab_parallel_logsumexp`).
    * **Fused loss** (``fused_loss``, TP = 1): training and evaluation losses come from the module's
      :class:`~forge_lightning.modules.llm.loss.LMLoss` (``per_token``: forge's fused linear + cross-entropy) over
      the final hidden states and the output weight (the embedding when tied), in chunks of tokens, never
      materialising the ``[s, b, vocab]`` logits and their fp32 copies; the same per-token values (z-loss
      included) as megatron's output layer + cross-entropy (both round the logit GEMM's output to the
      parameters' dtype, then take the softmax in fp32).
    """
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
    from megatron.core.models.gpt import GPTModel

    class ForgeGPTModel(GPTModel):
        loss: LMLoss = LMLoss()
        fused_loss: bool = False

        def _postprocess(self, hidden_states: Tensor, input_ids: Tensor, position_ids: Tensor, labels: Tensor,
                         *args: Any, **kwargs: Any) -> Tensor:  # fmt: skip
            plain = (
                not self.fused_loss
                or labels is None
                or not self.post_process
                or kwargs.get("mtp_in_postprocess")
                or self.config.mtp_num_layers is not None
                or kwargs.get("inference_context") is not None
                or kwargs.get("inference_params") is not None
            )
            if plain:
                return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
            weight = (
                self.shared_embedding_or_output_weight()
                if self.share_embeddings_and_output_weights
                else self.output_layer.weight
            )
            S, B, _ = hidden_states.shape
            # Tokens in [s, b] order, as the hidden states are laid out: no copy of them.
            loss_SB = self.loss.per_token(hidden_states.reshape(S * B, -1), weight, labels.t().reshape(S * B))
            return loss_SB.view(S, B).t()

        def _preprocess(
            self, input_ids: Tensor, position_ids: Tensor | None, *args: Any, **kwargs: Any
        ) -> tuple:
            out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
            if position_ids is None or out[1] is None:  # default positions, or no model-level RoPE (MLA)
                return out
            rotary = self.rotary_pos_emb
            table_PD = rotary.get_emb(int(position_ids.max()) + 1)[:, 0, 0]  # [positions, dim]
            emb_SB1D = table_PD[position_ids.t()][:, :, None]
            cp_group = rotary.cp_group
            if cp_group is not None and cp_group.size() > 1:
                emb_SB1D = get_pos_emb_on_this_cp_rank(emb_SB1D, 0, cp_group)
            return (out[0], emb_SB1D, *out[2:])

        def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
            if not self.loss.z_loss:
                return super().compute_language_model_loss(labels, logits)
            # Before megatron's cross-entropy, which works on fp32 logits in place.
            lse_BS = vocab_parallel_logsumexp(logits).t()
            return super().compute_language_model_loss(labels, logits) + self.loss.z_loss * lse_BS.square()

    return ForgeGPTModel


def vocab_parallel_logsumexp(logits_SBV: Tensor) -> Tensor:
    """``logsumexp`` ``[s, b]`` (fp32) over the whole vocabulary of logits split by vocabulary over the TP ranks.

    Differentiable: the shards' sums of exponentials are all-reduced (backward: each rank's own gradient). Keeps
    no reference to ``logits`` for backward, so megatron's cross-entropy may then overwrite them in place.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x_SBV = logits_SBV.float()
    max_SB = x_SBV.detach().amax(dim=-1)  # the shift cancels in the value and the gradient
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        torch.distributed.all_reduce(max_SB, op=torch.distributed.ReduceOp.MAX, group=group)
    sum_SB = reduce_from_tensor_model_parallel_region((x_SBV - max_SB[..., None]).exp().sum(dim=-1))
    return max_SB + sum_SB.log()


def unwrap(model: nn.Module) -> nn.Module:
    """The ``GPTModel`` inside megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def named_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The tensors the weight rules fill, by megatron name: the chunk's parameters and buffers (a DeepSeek-V3
    router's selection bias, ``mlp.router.expert_bias``, is a buffer)."""
    gpt = unwrap(model)
    return {**dict(gpt.named_buffers()), **dict(gpt.named_parameters())}

"""One megatron-core ``GPTModel`` chunk of a decoder LM, with the native model's RoPE and loss."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers.rope import MultimodalRotaryEmbedding
from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.model import build_rotary


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

    RoPE frequencies (plain, linear or llama3-scaled) and, with multimodal RoPE, the position axis of each frequency
    are those of forge's own model, so the twin computes the same function as
    :class:`~forge_lightning.modules.llm.model.DecoderLM`; the chunk is a :func:`forge_gpt_model_class`, whose RoPE
    follows ``position_ids`` and whose per-token loss adds the z-loss.

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
    native = build_rotary(config)
    for rotary in rotaries:
        rotary.inv_freq = native.inv_freq.clone()
    # M-RoPE: the position axis (temporal, height, width) of each frequency, chunked or interleaved (Qwen3-VL).
    model.mrope_axes = native.axis_of_freq if isinstance(native, MultimodalRotaryEmbedding) else None
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
    * **Multimodal RoPE** (Qwen2.5-VL / Qwen3-VL, ``mrope_axes`` set): ``position_ids`` ``[3, b, s]`` (temporal,
      height, width); each frequency turns by the position of its own axis, in the native model's chunked or
      interleaved layout (:class:`~forge_lightning.modules.layers.rope.MultimodalRotaryEmbedding`). megatron's own
      ``mrope`` embedding has the chunked layout only, so the twin builds the table itself for both.
    * **Layer residuals** (``forward(..., layer_residuals=[...])``, Qwen3-VL's DeepStack): ``[b, s, h]`` tensors
      added to the outputs of the decoder layers ``0, 1, ...``, as the native model's ``layer_residuals``; each must
      be a layer of this chunk.
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
        mrope_axes: Tensor | None = None

        def forward(
            self, *args: Any, layer_residuals: Sequence[Tensor] | None = None, **kwargs: Any
        ) -> Tensor:
            with _added_after_layers(self, layer_residuals or ()):
                return super().forward(*args, **kwargs)

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
            if position_ids.ndim == 3:
                emb_SB1D = self._multimodal_emb(position_ids)
            else:
                table_PD = rotary.get_emb(int(position_ids.max()) + 1)[:, 0, 0]  # [positions, dim]
                emb_SB1D = table_PD[position_ids.t()][:, :, None]
            cp_group = rotary.cp_group
            if cp_group is not None and cp_group.size() > 1:
                emb_SB1D = get_pos_emb_on_this_cp_rank(emb_SB1D, 0, cp_group)
            return (out[0], emb_SB1D, *out[2:])

        def _multimodal_emb(self, position_ids: Tensor) -> Tensor:
            """megatron's rotary ``emb`` ``[s, b, 1, dim]`` (angles, both halves) of ``[axes, b, s]`` positions."""
            axes = self.mrope_axes
            num_axes = None if axes is None else int(axes.max()) + 1
            if position_ids.shape[0] != num_axes:
                has = "no rope_scaling mrope_section" if axes is None else f"{num_axes} position axes"
                raise ValueError(
                    f"position_ids of shape {list(position_ids.shape)} are multimodal RoPE positions, but the "
                    f"model's config has {has}"
                )
            inv_freq = self.rotary_pos_emb.inv_freq.to(position_ids.device)
            positions_FBS = position_ids[axes.to(position_ids.device)]  # each frequency's axis
            angles_SBF = positions_FBS.permute(2, 1, 0).float() * inv_freq
            return torch.cat([angles_SBF, angles_SBF], dim=-1)[:, :, None]

        def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
            if not self.loss.z_loss:
                return super().compute_language_model_loss(labels, logits)
            # Before megatron's cross-entropy, which works on fp32 logits in place.
            lse_BS = vocab_parallel_logsumexp(logits).t()
            return super().compute_language_model_loss(labels, logits) + self.loss.z_loss * lse_BS.square()

    return ForgeGPTModel


@contextlib.contextmanager
def _added_after_layers(gpt: nn.Module, residuals: Sequence[Tensor]) -> Iterator[None]:
    """While in the context, ``residuals[i]`` (``[b, s, h]``) is added to the output of global decoder layer ``i``
    of ``gpt`` (forward hooks, removed on exit). Under sequence parallelism each TP rank adds its share of the
    sequence; the backward gathers the whole gradient, which every TP rank then holds (as for the decoder input)."""
    if not residuals:
        yield
        return
    from megatron.core import tensor_parallel

    config = gpt.config
    layers = {layer.layer_number - 1: layer for layer in gpt.decoder.layers}
    missing = [i for i in range(len(residuals)) if i not in layers]
    if missing:
        raise ValueError(
            f"layer_residuals for decoder layers {missing}, which this pipeline chunk does not hold (it holds "
            f"{sorted(layers)}): the residuals must be added on the first pipeline stage"
        )
    if config.recompute_granularity is not None:
        raise NotImplementedError(
            "layer_residuals (DeepStack) with the decoder's activation recompute are not yet supported by the megatron "
            "twin: the recomputed layers would not add them; set the decoder's recompute to 'none'"
        )
    added = []
    for residual_BSH in residuals:
        residual_SBH = residual_BSH.transpose(0, 1).contiguous()
        if config.sequence_parallel:
            residual_SBH = tensor_parallel.scatter_to_sequence_parallel_region(residual_SBH)
        added.append(residual_SBH)

    def hook(layer: nn.Module, args: Any, output: tuple[Tensor, Any]) -> tuple[Tensor, Any]:
        hidden_SBH, context = output
        return hidden_SBH + added[layer.layer_number - 1].to(hidden_SBH.dtype), context

    handles = [layers[i].register_forward_hook(hook) for i in range(len(added))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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

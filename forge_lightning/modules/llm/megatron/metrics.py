"""The MoE metrics of the decoder twin's step, as the native ``CausalLM`` logs them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


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

    from forge_lightning.modules.llm.megatron.layer_spec import MegatronTopKRouter

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

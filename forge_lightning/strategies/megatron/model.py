"""Building, filling and wrapping this rank's megatron-core model chunks for ``MegatronStrategy``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.megatron import build_gpt_model, transformer_config, unwrap
from forge_lightning.strategies.megatron.layer_spec import gpt_decoder_spec


def validate_degrees(world_size: int, degrees: dict[str, Any]) -> int:
    """Check the parallel degrees against the world size and each other; return the data-parallel size.

    Args:
        world_size: number of processes.
        degrees: the strategy's options (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ...).

    Raises:
        NotImplementedError: context or expert parallelism above 1 (not yet supported).
        ValueError: inconsistent degrees, named in the message.
    """
    tp, pp = degrees["tensor_model_parallel_size"], degrees["pipeline_model_parallel_size"]
    vpp = degrees["virtual_pipeline_model_parallel_size"]
    named = ", ".join(f"{k}={v}" for k, v in degrees.items()) + f", world size={world_size}"
    for option in ("context_parallel_size", "expert_model_parallel_size"):
        if degrees[option] != 1:
            raise NotImplementedError(f"{option}={degrees[option]} is not yet supported by MegatronStrategy")
    if min(tp, pp) < 1 or (vpp is not None and vpp < 1):
        raise ValueError(f"every parallel degree must be at least 1: {named}")
    if world_size % (tp * pp):
        raise ValueError(f"tensor x pipeline model parallel size must divide the world size: {named}")
    if vpp is not None and vpp > 1 and pp == 1:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1: {named}"
        )
    if degrees["sequence_parallel"] and tp == 1:
        raise ValueError(f"sequence_parallel needs tensor_model_parallel_size > 1: {named}")
    if degrees["overlap_param_gather"] and not degrees["use_distributed_optimizer"]:
        raise ValueError(f"overlap_param_gather needs use_distributed_optimizer: {named}")
    return world_size // (tp * pp)


def _llm_config_of(module: nn.Module) -> LLMConfig:
    config = getattr(module, "config", None)
    if not isinstance(config, LLMConfig) or not isinstance(getattr(module, "model", None), nn.Module):
        raise TypeError(
            f"MegatronStrategy builds the megatron-core twin of decoder LMs (a module with an LLMConfig `config` "
            f"and a `model`, e.g. CausalLM); {type(module).__name__} is not one"
        )
    if getattr(module, "z_loss", 0.0):
        raise NotImplementedError("z_loss is not yet supported by MegatronStrategy")
    if getattr(module, "lora_config", None) is not None:
        raise NotImplementedError("LoRA is not yet supported by MegatronStrategy")
    return config


def build_chunks(
    module: nn.Module,
    degrees: dict[str, Any],
    *,
    device: torch.device,
    bf16: bool,
    use_transformer_engine: bool | None,
) -> list[nn.Module]:
    """This rank's model chunks (one per virtual stage), holding the module's current weights.

    Args:
        module: the LightningModule (its ``config`` is an :class:`LLMConfig`, its ``model`` the HF-named weights).
        degrees: the strategy's options.
        device: where the chunks live.
        bf16: bf16 parameters (wrapped in megatron's ``Float16Module``); fp32 otherwise.
        use_transformer_engine: TE layer spec (``None``: when importable).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    from forge_lightning.strategies.megatron.bridge import load_state

    config = _llm_config_of(module)
    pp, vpp = degrees["pipeline_model_parallel_size"], degrees["virtual_pipeline_model_parallel_size"] or 1
    if config.num_layers % (pp * vpp):
        raise ValueError(
            f"num_layers ({config.num_layers}) must be divisible by pipeline_model_parallel_size ({pp}) x "
            f"virtual_pipeline_model_parallel_size ({vpp})"
        )
    tf_config = transformer_config(
        config,
        tensor_model_parallel_size=degrees["tensor_model_parallel_size"],
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=degrees["virtual_pipeline_model_parallel_size"],
        sequence_parallel=degrees["sequence_parallel"],
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
    )
    chunks = []
    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        chunk = build_gpt_model(
            config,
            tf_config,
            gpt_decoder_spec(tf_config, vp_stage=vp_stage, use_transformer_engine=use_transformer_engine),
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        chunks.append(chunk.to(device))
    weights = module.model.state_dict()
    load_state(chunks, config, weights.__getitem__)
    return [Float16Module(tf_config, chunk) if bf16 else chunk for chunk in chunks]


def wrap_ddp(
    chunks: list[nn.Module], degrees: dict[str, Any], *, overlap_grad_reduce: bool
) -> list[nn.Module]:
    """Wrap each chunk in megatron's ``DistributedDataParallel`` (contiguous fp32 gradient buffers).

    Args:
        chunks: this rank's model chunks.
        degrees: the strategy's options (distributed optimizer, parameter-gather overlap).
        overlap_grad_reduce: reduce gradient buckets while backward runs.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=degrees["overlap_param_gather"],
        align_param_gather=degrees["overlap_param_gather"] and degrees["pipeline_model_parallel_size"] > 1,
        use_distributed_optimizer=degrees["use_distributed_optimizer"],
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        # Only the first chunk is bucketed: later chunks' gradients are ready last in backward anyway.
        ddp = DistributedDataParallel(unwrap(chunk).config, ddp_config, chunk, disable_bucketing=i > 0)
        ddp.broadcast_params()
        wrapped.append(ddp)
    return wrapped


def connect_schedule(chunks: list[nn.Module], optimizer: Any, degrees: dict[str, Any], overlap: bool) -> None:
    """Hand megatron's schedule the gradient finalisation, loss scaling and the overlap hooks of the chunks.

    Args:
        chunks: the DDP-wrapped chunks.
        optimizer: megatron's optimizer (its ``scale_loss`` scales the loss for fp16).
        degrees: the strategy's options.
        overlap: ``overlap_grad_reduce``.
    """
    from megatron.core.distributed import finalize_model_grads

    def one_or_list(fns: list[Any]) -> Any:
        return fns[0] if len(fns) == 1 else fns

    config = unwrap(chunks[0]).config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if overlap:
        config.no_sync_func = one_or_list([c.no_sync for c in chunks])
        config.grad_sync_func = one_or_list([c.start_grad_sync for c in chunks])
    if degrees["overlap_param_gather"] and degrees["pipeline_model_parallel_size"] > 1:
        config.param_sync_func = one_or_list([c.start_param_sync for c in chunks])

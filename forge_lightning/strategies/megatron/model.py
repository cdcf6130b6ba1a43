"""Building, filling and wrapping this rank's megatron-core model chunks for ``MegatronStrategy``."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.hf import split_experts
from forge_lightning.modules.llm.megatron import build_gpt_model, transformer_config, unwrap
from forge_lightning.strategies.context_parallel import CP_COMM_TYPES
from forge_lightning.strategies.megatron.layer_spec import gpt_decoder_spec, transformer_engine_available


def validate_degrees(world_size: int, degrees: dict[str, Any]) -> int:
    """Check the parallel degrees against the world size and each other; return the data-parallel size.

    Args:
        world_size: number of processes.
        degrees: the strategy's options (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ...;
            ``cp_comm_type`` and ``hierarchical_context_parallel_sizes`` may be absent: Ulysses).

    Raises:
        ValueError: inconsistent degrees, named in the message.
    """
    tp, pp = degrees["tensor_model_parallel_size"], degrees["pipeline_model_parallel_size"]
    vpp, ep = degrees["virtual_pipeline_model_parallel_size"], degrees["expert_model_parallel_size"]
    cp, etp = degrees["context_parallel_size"], degrees.get("expert_tensor_parallel_size") or tp
    named = ", ".join(f"{k}={v}" for k, v in degrees.items()) + f", world size={world_size}"
    if min(tp, pp, cp, ep, etp) < 1 or (vpp is not None and vpp < 1):
        raise ValueError(f"every parallel degree must be at least 1: {named}")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"tensor x pipeline model parallel x context parallel size must divide the world size: {named}"
        )
    if (world_size // pp) % (ep * etp):
        # megatron-core lays the experts out on a grid of its own over each pipeline stage's TP x DP x CP ranks:
        # ETP ranks split an expert's width, EP ranks split the experts, the rest replicate them (expert data
        # parallelism). With ETP = TP (the default) that is: EP divides DP x CP.
        raise ValueError(
            f"expert_model_parallel_size ({ep}) x expert_tensor_parallel_size ({etp}) must divide the ranks of a "
            f"pipeline stage, tensor x data x context parallel size = world / pipeline model parallel size = "
            f"{world_size // pp}: {named}"
        )
    if vpp is not None and vpp > 1 and pp == 1:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1: {named}"
        )
    if degrees["sequence_parallel"] and tp == 1:
        raise ValueError(f"sequence_parallel needs tensor_model_parallel_size > 1: {named}")
    if degrees["overlap_param_gather"] and not degrees["use_distributed_optimizer"]:
        raise ValueError(f"overlap_param_gather needs use_distributed_optimizer: {named}")
    _check_context_parallel(
        cp, degrees.get("cp_comm_type", "a2a"), degrees.get("hierarchical_context_parallel_sizes")
    )
    return world_size // (tp * pp * cp)


def _check_context_parallel(cp: int, comm_type: str, sizes: list[int] | None) -> None:
    """Raise ``ValueError`` unless ``cp_comm_type`` and ``hierarchical_context_parallel_sizes`` fit each other and
    ``context_parallel_size``."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type ({comm_type!r}) must be one of {', '.join(CP_COMM_TYPES)}")
    if comm_type != "a2a+p2p":
        if sizes:
            raise ValueError(
                f"hierarchical_context_parallel_sizes ({sizes}) is only read with cp_comm_type 'a2a+p2p', got "
                f"{comm_type!r}"
            )
        return
    if not sizes or len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
        raise ValueError(
            f"cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes [a2a, p2p] whose product is "
            f"context_parallel_size ({cp}), got {sizes}"
        )
    if importlib.util.find_spec("einops") is None:  # megatron-core builds its hierarchical groups with einops
        raise ImportError(
            "cp_comm_type 'a2a+p2p' needs einops (megatron-core's hierarchical groups): pip install einops"
        )


def _llm_config_of(module: nn.Module) -> LLMConfig:
    config = getattr(module, "config", None)
    if not isinstance(config, LLMConfig) or not isinstance(getattr(module, "model", None), nn.Module):
        raise TypeError(
            f"MegatronStrategy builds the megatron-core twin of decoder LMs (a module with an LLMConfig `config` "
            f"and a `model`, e.g. CausalLM); {type(module).__name__} is not one"
        )
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
    config_overrides: dict[str, Any] | None = None,
) -> list[nn.Module]:
    """This rank's model chunks (one per virtual stage), holding the module's current weights.

    A module whose native model is on the meta device (``CausalLM`` built under
    :func:`~forge_lightning.modules.llm.module.deferred_pretrained`) has its ``pretrained`` directory read
    instead, each rank reading only its own shards (see :func:`~.bridge.load_hf_checkpoint`).

    Args:
        module: the LightningModule (its ``config`` is an :class:`LLMConfig`, its ``model`` the HF-named weights).
        degrees: the strategy's options.
        device: where the chunks live.
        bf16: bf16 parameters (wrapped in megatron's ``Float16Module``); fp32 otherwise.
        use_transformer_engine: TE layer spec (``None``: when importable).
        config_overrides: further ``TransformerConfig`` fields (e.g. a component's recompute settings).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    from forge_lightning.strategies.megatron.bridge import load_hf_checkpoint, load_state

    config = _llm_config_of(module)
    pp, vpp = degrees["pipeline_model_parallel_size"], degrees["virtual_pipeline_model_parallel_size"] or 1
    if config.num_layers % (pp * vpp):
        raise ValueError(
            f"num_layers ({config.num_layers}) must be divisible by pipeline_model_parallel_size ({pp}) x "
            f"virtual_pipeline_model_parallel_size ({vpp})"
        )
    _check_experts(config, degrees["expert_model_parallel_size"], degrees.get("expert_tensor_parallel_size"))
    use_te = use_transformer_engine
    if use_te is None:  # multi-latent attention: always the local spec (see gpt_decoder_spec)
        use_te = transformer_engine_available() and config.mla is None
    cp, comm_type = degrees["context_parallel_size"], degrees.get("cp_comm_type", "a2a")
    hierarchy = degrees.get("hierarchical_context_parallel_sizes") if comm_type == "a2a+p2p" else None
    if not use_te:  # TransformerEngine's attention brings its own context parallelism
        ulysses = {"a2a": cp, "p2p": 1, "a2a+p2p": hierarchy[0] if hierarchy else 1}[comm_type]
        option = "context_parallel_size" if comm_type == "a2a" else "hierarchical_context_parallel_sizes[0]"
        check_ulysses_heads(config, degrees["tensor_model_parallel_size"], ulysses, option=option)
    # megatron's own names: its TE attention reads them too (None: its default).
    cp_fields = (
        {"cp_comm_type": comm_type, "hierarchical_context_parallel_sizes": hierarchy} if cp > 1 else {}
    )
    tf_config = transformer_config(
        config,
        tensor_model_parallel_size=degrees["tensor_model_parallel_size"],
        pipeline_model_parallel_size=pp,
        context_parallel_size=degrees["context_parallel_size"],
        expert_model_parallel_size=degrees["expert_model_parallel_size"],
        expert_tensor_parallel_size=degrees.get("expert_tensor_parallel_size"),
        virtual_pipeline_model_parallel_size=degrees["virtual_pipeline_model_parallel_size"],
        sequence_parallel=degrees["sequence_parallel"],
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        **cp_fields,
        # On a GPU, built there (megatron's CPU initialisation is slow at real sizes); the init values are
        # overwritten below, but megatron's init functions also tag the tensor-parallel weights. There, too,
        # the gated MLP's SiLU-and-multiply runs as megatron's compiled fused kernel (one pass instead of
        # several eager ones; not on a CPU, where compiling it would only slow the short runs down).
        **{
            "use_cpu_initialization": device.type != "cuda",
            "bias_activation_fusion": device.type == "cuda",
            **(config_overrides or {}),
        },
    )
    chunks = []
    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        chunk = build_gpt_model(
            config,
            tf_config,
            gpt_decoder_spec(tf_config, vp_stage=vp_stage, use_transformer_engine=use_te),
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
            z_loss=float(getattr(module, "z_loss", 0.0)),
            loss_backend=_loss_backend(module),
        )
        chunks.append(chunk.to(device))
    pretrained = getattr(module, "pretrained", None)
    if any(p.is_meta for p in module.model.parameters()):
        # Deferred pretrained weights (see CausalLM): each rank reads its own shards from the files.
        if pretrained is None:
            raise ValueError(
                f"{type(module).__name__}.model is on the meta device and names no pretrained directory to read "
                "its weights from; pass model.init_args.pretrained or build the module with materialised weights"
            )
        load_hf_checkpoint(chunks, config, pretrained)
    else:
        # The module's own (materialised) weights. Hugging Face names: the module keeps each layer's experts as
        # 3-D tensors, the rules name them one by one.
        weights = split_experts(module.model.state_dict())
        load_state(chunks, config, weights.__getitem__)
    return [Float16Module(tf_config, chunk) if bf16 else chunk for chunk in chunks]


def _loss_backend(module: nn.Module) -> str:
    """The backend of the fused linear + cross-entropy: the module's ``performance.kernels.cross_entropy``."""
    performance = getattr(module, "performance", None)
    kernels = getattr(performance, "kernels", None)
    return getattr(kernels, "cross_entropy", "auto")


def check_ulysses_heads(
    config: LLMConfig, tp: int, cp: int, *, option: str = "context_parallel_size"
) -> None:
    """Raise ``ValueError`` unless Ulysses context parallelism can split this TP rank's query heads over CP ranks.

    Each Ulysses rank attends over the whole sequence for ``1 / cp`` of the rank's query heads (see
    :class:`~forge_lightning.strategies.megatron.layer_spec.SDPACoreAttention`). Key/value heads need not divide:
    when they do not, they are repeated to the query heads before the exchange (more bytes, same result). Ring
    attention (``cp_comm_type`` ``p2p``) has no such constraint; the hybrid's Ulysses part (``a2a+p2p``) has, over
    its ``hierarchical_context_parallel_sizes[0]`` ranks.

    Args:
        config: the decoder's configuration (``num_heads``).
        tp: ``tensor_model_parallel_size``.
        cp: the ranks Ulysses splits the heads over (``context_parallel_size`` with ``cp_comm_type`` ``a2a``).
        option: the option that set ``cp``, for the message.
    """
    if cp == 1 or (config.num_heads // tp) % cp == 0:
        return
    raise ValueError(
        f"{option} ({cp}) must divide the query heads of each tensor-parallel rank, num_heads "
        f"({config.num_heads}) / tensor_model_parallel_size ({tp}) = {config.num_heads // tp}: Ulysses attention "
        "gives each context-parallel rank a share of the heads over the whole sequence (cp_comm_type 'p2p', ring "
        "attention, does not)"
    )


def _check_experts(config: LLMConfig, ep: int, etp: int | None = None) -> None:
    """Raise ``ValueError`` unless ``expert_model_parallel_size`` and ``expert_tensor_parallel_size`` (``None``:
    TP, checked with the other TP constraints) fit the model's experts."""
    if ep == 1 and etp is None:
        return
    if config.moe is None or not config.num_moe_layers:
        option = f"expert_model_parallel_size ({ep})" if ep > 1 else f"expert_tensor_parallel_size ({etp})"
        raise ValueError(
            f"{option} needs a mixture-of-experts model; {config.architecture} has no experts (leave the expert "
            "options at their defaults)"
        )
    if etp is not None and config.moe.intermediate_size % etp:
        raise ValueError(
            f"expert_tensor_parallel_size ({etp}) must divide moe.intermediate_size ({config.moe.intermediate_size}):"
            " each expert-tensor-parallel rank holds an equal slice of every expert's width"
        )
    if config.moe.num_experts % ep:
        raise ValueError(
            f"expert_model_parallel_size ({ep}) must divide moe.num_experts ({config.moe.num_experts}): each "
            "expert-parallel rank holds the same number of experts"
        )


def experts_apart(degrees: dict[str, Any]) -> bool:
    """Whether the routed experts' gradients are reduced over a group of their own (megatron's expert data-parallel
    group) rather than the data-parallel one: with expert parallelism, or with an expert tensor-parallel size other
    than TP (the TP ranks then hold whole or differently split experts and route different tokens to them)."""
    etp = degrees.get("expert_tensor_parallel_size")
    return degrees["expert_model_parallel_size"] > 1 or (
        etp is not None and etp != degrees["tensor_model_parallel_size"]
    )


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
        if experts_apart(degrees):
            _mark_expert_parameters(chunk)
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

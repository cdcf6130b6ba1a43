"""megatron-core's optimizer (optionally the DistributedOptimizer) and our LR schedule, from the module's configs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from forge_lightning.accelerators.capabilities import capabilities
from forge_lightning.optim import OptimizerConfig, SchedulerConfig, build_scheduler


def _no_decay(decay_all: bool, chunks: list[nn.Module]) -> Any:
    """megatron param-group overrides reproducing ``forge_lightning.optim.param_groups``'s decay rule: norm weights,
    biases (parameters of fewer than 2 dimensions) and embedding tables are not decayed, matrices are.

    Embedding tables are found by module type in any chunk (the twin's megatron ``VocabParallelEmbedding``, a
    composed model's encoder-side ``nn.Embedding``), plus the copy of a tied embedding that megatron keeps on the
    last pipeline stage (its ``shared_embedding`` tag).
    """
    from megatron.core.optimizer import ParamGroupOverride, ParamKey, ParamWithNamePredicate

    if decay_all:
        return {}
    tables = embedding_tables(chunks)
    rule = ParamWithNamePredicate(
        name="norms_biases_embeddings",
        fn=lambda param, name: (
            param.ndim < 2 or id(param) in tables or getattr(param, "shared_embedding", False)
        ),
    )
    return {ParamKey(with_name_predicate=rule): ParamGroupOverride(wd_mult=0.0)}


def embedding_tables(chunks: list[nn.Module]) -> set[int]:
    """Ids of the embedding tables in any chunk: megatron's ``VocabParallelEmbedding`` and plain ``nn.Embedding``."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    return {
        id(m.weight)
        for chunk in chunks
        for m in chunk.modules()
        if isinstance(m, nn.Embedding | VocabParallelEmbedding)
    }


def build_megatron_optimizer(
    chunks: list[nn.Module],
    config: OptimizerConfig,
    *,
    use_distributed_optimizer: bool,
    overlap_param_gather: bool,
    clip_grad: float,
    bf16: bool,
    implementation: str = "auto",
) -> Any:
    """megatron-core's (chained) optimizer over the DDP-wrapped ``chunks``.

    Args:
        chunks: the model chunks, wrapped in megatron's ``DistributedDataParallel``.
        config: the module's optimizer settings (``adamw``, ``adam``, ``sgd`` or ``muon``: our Muon inside
            megatron's plain optimizer wrappers, see :func:`~forge_lightning.strategies.megatron.muon.build_muon_optimizer`).
        use_distributed_optimizer: shard the optimizer state (and fp32 main weights) over data-parallel ranks.
        overlap_param_gather: overlap the DistributedOptimizer's parameter all-gather with the next forward.
        clip_grad: global gradient-norm clip (0: off), computed across every parallel group.
        bf16: the model holds bf16 parameters (the optimizer keeps fp32 main weights).
        implementation: Adam(W)'s kernels when megatron falls back to torch's optimizers (no TransformerEngine
            or Apex): ``fused`` (one kernel per step), ``foreach`` or ``for_loop``; ``auto``: fused when every
            parameter the optimizer steps is on a CUDA device (the ``performance.optimizer`` setting).
    """
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    if use_distributed_optimizer and config.name == "sgd":
        raise ValueError(
            "megatron-core's distributed optimizer steps Adam / AdamW only (its sharded state is Adam's): set "
            "optimizer.name to adamw or adam, or MegatronStrategy(use_distributed_optimizer=false) for SGD"
        )
    if use_distributed_optimizer and config.name == "muon":
        raise ValueError(
            "optimizer.name muon does not run under megatron-core's distributed optimizer, which shards Adam's "
            "state element-wise over data-parallel ranks; Muon needs whole matrices and spreads its work "
            "tensor-wise itself (each matrix orthogonalised by one TP rank): set "
            "MegatronStrategy(use_distributed_optimizer=false)"
        )
    megatron_config = MegatronOptimizerConfig(
        optimizer="sgd" if config.name == "sgd" else "adam",
        lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.betas[0],
        adam_beta2=config.betas[1],
        adam_eps=config.eps,
        decoupled_weight_decay=config.name in ("adamw", "muon"),
        sgd_momentum=config.momentum,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_param_gather=overlap_param_gather,
        clip_grad=clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    if config.name == "muon":
        from forge_lightning.strategies.megatron.muon import build_muon_optimizer

        return build_muon_optimizer(chunks, config, megatron_config)
    optimizer = get_megatron_optimizer(
        megatron_config, chunks, config_overrides=_no_decay(config.decay_norms_biases_embeddings, chunks)
    )
    # megatron's own scheduler sets each group's weight decay from its multiplier every step; ours sets the LR
    # only, so apply the multipliers once here.
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            group["weight_decay"] = config.weight_decay * group.get("wd_mult", 1.0)
        _choose_kernels(inner, implementation)
    return optimizer


def _choose_kernels(optimizer: torch.optim.Optimizer, implementation: str) -> None:
    """Set torch Adam(W)'s ``fused`` / ``foreach`` flags, which it reads at every step (its state is created at
    the first step, on the parameters' device as the fused kernel needs). Other optimizers keep theirs."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if implementation == "auto":
        fused = bool(params) and all(capabilities(p.device).fused_optimizer for p in params)
        implementation = "fused" if fused else "foreach"
    for group in optimizer.param_groups:
        group["fused"] = implementation == "fused"
        group["foreach"] = implementation == "foreach"


def chain_optimizers(*optimizers: Any) -> Any:
    """One megatron ``ChainedOptimizer`` of ``optimizers`` (each a megatron optimizer or a chain of them): one
    gradient norm over all their parameters (clipping included), one step, one (sharded) state dict.

    megatron's chain requires one config object for all its parts. Parts may differ only in how their parameters are
    sharded (``use_distributed_optimizer``, ``overlap_param_gather``), which decides the optimizer class megatron
    builds and which a built optimizer never reads again, so they take the first part's config; any other
    difference is an error.
    """
    import dataclasses

    from megatron.core.optimizer import ChainedOptimizer

    parts = [inner for opt in optimizers for inner in getattr(opt, "chained_optimizers", [opt])]
    first = parts[0].config
    for part in parts[1:]:
        sharding = {"use_distributed_optimizer": first.use_distributed_optimizer,
                    "overlap_param_gather": first.overlap_param_gather}  # fmt: skip
        if dataclasses.replace(part.config, **sharding) != first:
            raise ValueError(
                "chained megatron optimizers must share their settings apart from parameter sharding"
            )
        part.config = first
    return ChainedOptimizer(parts)


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron (chained) optimizer, whose param groups carry the LR."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt.optimizer for opt in chained]


def build_schedulers(optimizer: Any, config: SchedulerConfig, total_steps: int) -> list[Any]:
    """One ``LambdaLR`` of ``config`` per torch optimizer inside the megatron optimizer."""
    return [build_scheduler(inner, config, total_steps) for inner in torch_optimizers(optimizer)]

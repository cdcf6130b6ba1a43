"""Hugging Face <-> megatron-core weights across a TP / PP / EP layout.

Loading: each rank reads from the safetensors files only the tensors its chunks need (its pipeline stage's
layers, its expert-parallel rank's experts; every TP rank slices its own shard). Export: for every Hugging Face
tensor, the TP ranks of one replica holding it (the owning stage; for a routed expert, the expert-parallel rank
holding it) all-gather their shards, its TP rank 0 merges them and sends the full tensor to global rank 0, which
keeps it on CPU: no rank ever holds more than one gathered tensor besides rank 0's growing CPU state dict.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from torch import Tensor, nn

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.hf import SAFETENSORS_FILE, SAFETENSORS_INDEX
from forge_lightning.modules.llm.megatron import (
    WeightRule,
    load_hf_weights,
    merge_shards,
    unwrap,
    weight_rules,
)


def safetensors_reader(path: str | os.PathLike[str]) -> Callable[[str], Tensor]:
    """A function returning one named tensor of a Hugging Face checkpoint directory, read on demand (CPU).

    Args:
        path: directory with ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
    """
    path = Path(path)
    if (path / SAFETENSORS_INDEX).is_file():
        weight_map: dict[str, str] = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
    elif (path / SAFETENSORS_FILE).is_file():
        with safe_open(path / SAFETENSORS_FILE, framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), SAFETENSORS_FILE)
    else:
        raise FileNotFoundError(f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {path}")

    def read(name: str) -> Tensor:
        if name not in weight_map:
            raise KeyError(f"{path} has no tensor {name!r}")
        with safe_open(path / weight_map[name], framework="pt") as f:
            return f.get_tensor(name)

    return read


def load_hf_checkpoint(chunks: Sequence[nn.Module], config: LLMConfig, path: str | os.PathLike[str]) -> None:
    """Load a Hugging Face directory into this rank's model chunks (its stage's layers, its TP shard).

    Args:
        chunks: this rank's megatron model chunks (one per virtual pipeline stage).
        config: the decoder's configuration (must match the checkpoint's ``config.json``).
        path: the Hugging Face directory.
    """
    from forge_lightning.modules.llm.hf import check_compatible

    check_compatible(config, LLMConfig.load(Path(path) / "config.json"))
    load_state(chunks, config, safetensors_reader(path))


def load_state(chunks: Sequence[nn.Module], config: LLMConfig, read: Callable[[str], Tensor]) -> None:
    """Fill this rank's chunks from a reader of full Hugging Face tensors (see :func:`load_hf_weights`)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    expert_tp = (
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )
    for chunk in chunks:
        device = next(unwrap(chunk).parameters()).device
        load_hf_weights(
            chunk,
            config,
            lambda name, device=device: read(name).to(device),
            tp_rank,
            tp_size,
            expert_tp=expert_tp,
        )


@torch.no_grad()
def export_hf_state(chunks: Sequence[nn.Module], config: LLMConfig) -> dict[str, Tensor]:
    """The full Hugging Face state dict on global rank 0 (CPU), an empty dict elsewhere. Collective.

    Every tensor is gathered from one replica: for a routed expert's weight, the TP group of expert-data-parallel
    rank 0 on the expert-parallel rank that holds the expert; for any other weight, the TP group of data- and
    context-parallel rank 0 (on the first pipeline stage that holds it, for tied embeddings). The other ranks take
    no part beyond the name exchange.

    Args:
        chunks: this rank's megatron model chunks.
        config: the decoder's configuration.
    """
    groups = {
        False: parallel_state.get_tensor_model_parallel_group(),
        True: parallel_state.get_expert_tensor_parallel_group(),
    }
    replica = {  # context-parallel ranks hold the same weights, as data-parallel ones (experts: CP is in EDP)
        False: parallel_state.get_data_parallel_rank(with_context_parallel=True),
        True: parallel_state.get_expert_data_parallel_rank(),
    }
    stage = parallel_state.get_pipeline_model_parallel_rank()
    local: dict[tuple[str, ...], tuple[WeightRule, Tensor]] = {}  # the tensors this rank gathers
    for chunk in chunks:
        params = dict(unwrap(chunk).named_parameters())
        for rule in weight_rules(chunk, config):
            if replica[rule.expert] == 0:
                local.setdefault(rule.hf, (rule, params[rule.megatron]))
    published: list[Any] = [None] * dist.get_world_size()
    mine = [(hf, stage, groups[rule.expert].rank()) for hf, (rule, _) in local.items()]
    dist.all_gather_object(published, mine)
    # One order for every rank (first appearance by rank); each tensor's gatherers: its first stage's holders.
    first_stage: dict[tuple[str, ...], int] = {}
    for entries in published:
        for hf, st, _ in entries:
            first_stage[hf] = min(st, first_stage.get(hf, st))
    sources = {
        hf: r
        for r, entries in enumerate(published)
        for hf, st, tp in entries
        if tp == 0 and st == first_stage[hf]
    }
    some_param = next(
        unwrap(chunks[0]).parameters()
    )  # a rank may hold no tensor to gather (DP > 0, no experts)
    dtype, device = some_param.dtype, some_param.device
    shapes = _hf_shapes(config) if dist.get_rank() == 0 else {}
    state: dict[str, Tensor] = {}
    for hf in first_stage:
        full = None
        if hf in local and stage == first_stage[hf]:
            rule, param = local[hf]
            group = groups[rule.expert]
            shards = [torch.empty_like(param) for _ in range(group.size())]
            dist.all_gather(shards, param.detach().contiguous(), group=group)
            full = merge_shards(rule, shards, config) if group.rank() == 0 else None
        state.update(_to_rank_zero(full, hf, sources[hf], shapes, (dtype, device)))
    return state if dist.get_rank() == 0 else {}


def _to_rank_zero(
    full: dict[str, Tensor] | None,
    names: Sequence[str],
    src: int,
    shapes: dict[str, torch.Size],
    kind: tuple[torch.dtype, torch.device],
) -> dict[str, Tensor]:
    """Move the tensors ``full`` (present on global rank ``src``) to global rank 0's host memory."""
    rank = dist.get_rank()
    if src == 0:
        return {k: v.cpu() for k, v in (full or {}).items()}
    if rank == src:
        for name in names:
            dist.send(full[name].contiguous(), dst=0)
        return {}
    if rank != 0:
        return {}
    received = {}
    for name in names:
        buf = torch.empty(shapes[name], dtype=kind[0], device=kind[1])
        dist.recv(buf, src=src)
        received[name] = buf.cpu()
    return received


def _hf_shapes(config: LLMConfig) -> dict[str, torch.Size]:
    """Shapes of every Hugging Face tensor of ``config`` (from a meta-device model)."""
    from forge_lightning.modules.llm.hf import split_experts
    from forge_lightning.modules.llm.model import DecoderLM

    with torch.device("meta"):
        model = DecoderLM(config)
    return {k: v.shape for k, v in split_experts(model.state_dict()).items()}

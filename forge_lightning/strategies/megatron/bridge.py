"""Hugging Face <-> megatron-core weights across a TP / PP layout.

Loading: each rank reads from the safetensors files only the tensors its chunks need (its pipeline stage's
layers; every TP rank slices its own shard). Export: for every Hugging Face tensor, the TP ranks of the owning
stage all-gather their shards, its TP rank 0 merges them and sends the full tensor to global rank 0, which keeps
it on CPU: no rank ever holds more than one gathered tensor besides rank 0's growing CPU state dict.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from torch import Tensor, nn

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.hf import SAFETENSORS_FILE, SAFETENSORS_INDEX
from forge_lightning.modules.llm.megatron import load_hf_weights, merge_shards, unwrap, weight_rules


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
    for chunk in chunks:
        device = next(unwrap(chunk).parameters()).device
        load_hf_weights(chunk, config, lambda name, device=device: read(name).to(device), tp_rank, tp_size)


@torch.no_grad()
def export_hf_state(chunks: Sequence[nn.Module], config: LLMConfig) -> dict[str, Tensor]:
    """The full Hugging Face state dict on global rank 0 (CPU), an empty dict elsewhere. Collective.

    Ranks with data-parallel rank > 0 take no part beyond the name exchange (their weights are replicas).

    Args:
        chunks: this rank's megatron model chunks.
        config: the decoder's configuration.
    """
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_rank = parallel_state.get_data_parallel_rank()
    tp_rank, tp_size = tp_group.rank(), tp_group.size()
    local = []  # (rule, parameter) of this rank's chunks
    for chunk in chunks:
        params = dict(unwrap(chunk).named_parameters())
        local += [(rule, params[rule.megatron]) for rule in weight_rules(chunk, config)]
    # Every stage learns which stage owns which names, in one order; the first stage wins tied embeddings.
    owned = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(owned, [rule.hf for rule, _ in local], group=pp_group)
    my_stage = dist.get_rank(pp_group)
    # The owner of a stage's tensors is its rank with TP rank 0 and data-parallel rank 0.
    coords = [None] * dist.get_world_size()
    dist.all_gather_object(coords, (my_stage, tp_rank, dp_rank))
    owners = {stage: rank for rank, (stage, tp, dp) in enumerate(coords) if tp == 0 and dp == 0}
    dtype, device = local[0][1].dtype, local[0][1].device
    shapes = _hf_shapes(config) if dist.get_rank() == 0 else {}
    state: dict[str, Tensor] = {}
    seen: set[str] = set()
    for stage, names in enumerate(owned):
        src = owners[stage]
        for i, hf_names in enumerate(names):
            if set(hf_names) <= seen:
                continue
            seen.update(hf_names)
            full = None
            if stage == my_stage and dp_rank == 0:
                rule, param = local[i]
                shards = [torch.empty_like(param) for _ in range(tp_size)]
                dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
                full = merge_shards(rule, shards, config) if tp_rank == 0 else None
            state.update(_to_rank_zero(full, hf_names, src, shapes, (dtype, device)))
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
    from forge_lightning.modules.llm.model import DecoderLM

    with torch.device("meta"):
        model = DecoderLM(config)
    return {k: v.shape for k, v in model.state_dict().items()}

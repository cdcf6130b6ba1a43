"""Hugging Face <-> megatron-core weights across a TP / PP / EP layout.

Loading: each rank reads from the safetensors files only the parts of tensors its chunks need (its pipeline
stage's layers, its expert-parallel rank's experts, and of those its TP rank's rows / columns / key-value groups).
Export: for every Hugging Face tensor, the TP ranks of one replica holding it (the owning stage; for a routed expert, the expert-parallel rank
holding it) all-gather their shards, its TP rank 0 merges them and sends the full tensor to global rank 0, which
keeps it on CPU: no rank ever holds more than one gathered tensor besides rank 0's growing CPU state dict.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from torch import Tensor, nn

from forge_lightning.manifest import FileChecks
from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.hf import EXPERT_KEY, SAFETENSORS_FILE, SAFETENSORS_INDEX
from forge_lightning.modules.llm.megatron.gpt import named_tensors, unwrap
from forge_lightning.modules.llm.megatron.weights import (
    WeightRule,
    assemble_shard,
    check_all_filled,
    load_hf_weights,
    merge_shards,
    shard_indices,
    weight_rules,
)


class SafetensorsSlices:
    """Reads parts of the tensors of a Hugging Face checkpoint directory: only the requested rows, columns or
    experts leave the files (``safe_open(...).get_slice``), onto the CPU.

    Routed experts are found under their per-expert names (``mlp.experts.{e}.gate_proj.weight``) or, failing that,
    in transformers 5's fused 3-D tensors (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
    ``[E, H, I]``). A context manager: the files stay open until it exits. ``elements_read`` counts what was read.

    Args:
        path: directory with ``model.safetensors`` or a sharded ``model.safetensors.index.json``.

    Raises:
        FileNotFoundError: no weights in ``path``, or its index names a missing file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._checks = FileChecks(self.path, "Hugging Face checkpoint")
        if (self.path / SAFETENSORS_INDEX).is_file():
            self._checks.check(SAFETENSORS_INDEX)
            self.where = self.path / SAFETENSORS_INDEX
            self.weight_map: dict[str, str] = json.loads(self.where.read_text())["weight_map"]
        elif (self.path / SAFETENSORS_FILE).is_file():
            self.where = self.path / SAFETENSORS_FILE
            self._checks.check(SAFETENSORS_FILE)
            with safe_open(self.where, framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), SAFETENSORS_FILE)
        else:
            raise FileNotFoundError(f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {self.path}")
        self.elements_read = 0
        self._files = ExitStack()
        self._open: dict[str, Any] = {}

    def __enter__(self) -> SafetensorsSlices:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()
        self._open.clear()

    def _handle(self, file: str) -> Any:
        if file not in self._open:
            if not (self.path / file).is_file():
                raise FileNotFoundError(
                    f"{self.where} names file {file!r}, which is missing from {self.path}"
                )
            self._checks.check(file)
            self._open[file] = self._files.enter_context(safe_open(self.path / file, framework="pt"))
        return self._open[file]

    def _locate(self, name: str) -> tuple[str, str, tuple[int, ...], int, tuple[int, ...]] | None:
        """(file, stored name, leading index, row offset, shape) of tensor ``name``; ``None`` if absent."""
        if name in self.weight_map:
            file = self.weight_map[name]
            return file, name, (), 0, tuple(self._handle(file).get_slice(name).get_shape())
        match = EXPERT_KEY.fullmatch(name)  # a routed expert's weight, perhaps in the fused 3-D layout
        if match is None:
            return None
        fused = f"{match['prefix']}.{'down_proj' if match['proj'] == 'down_proj' else 'gate_up_proj'}"
        if fused not in self.weight_map:
            return None
        file = self.weight_map[fused]
        experts, rows, *rest = self._handle(file).get_slice(fused).get_shape()
        if int(match["expert"]) >= experts:
            return None
        if match["proj"] == "down_proj":
            return file, fused, (int(match["expert"]),), 0, (rows, *rest)
        offset = rows // 2 if match["proj"] == "up_proj" else 0  # gate rows first, then up rows
        return file, fused, (int(match["expert"]),), offset, (rows // 2, *rest)

    def read(self, name: str, index: tuple[slice, ...], expected: tuple[int, ...], needed_by: str) -> Tensor:
        """``full[index]`` of tensor ``name`` (of full shape ``expected``), reading only that part.

        Args:
            name: the Hugging Face tensor name.
            index: one slice per leading dimension (``()``: the whole tensor).
            expected: the tensor's full shape in the model.
            needed_by: the megatron parameter it fills (for error messages).

        Raises:
            KeyError: the checkpoint has no tensor ``name``.
            ValueError: the stored tensor's shape is not ``expected``.
        """
        found = self._locate(name)
        if found is None:
            raise KeyError(
                f"{self.where}: no tensor {name!r} (expected shape {tuple(expected)}, needed for megatron "
                f"parameter {needed_by})"
            )
        file, stored, lead, offset, shape = found
        if shape != tuple(expected):
            described = name if stored == name else f"{name} (in {stored})"
            raise ValueError(
                f"{self.path / file}: tensor {described} has shape {shape}, expected {tuple(expected)} (megatron "
                f"parameter {needed_by})"
            )
        full = [slice(0, n) for n in shape]
        full[: len(index)] = [slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=False)]
        if offset:  # the up rows of a fused gate_up_proj
            full[0] = slice(full[0].start + offset, full[0].stop + offset)
        part = self._handle(file).get_slice(stored)[(*lead, *full)]
        self.elements_read += part.numel()
        return part


def load_hf_checkpoint(
    chunks: Sequence[nn.Module], config: LLMConfig, path: str | os.PathLike[str]
) -> SafetensorsSlices:
    """Load a Hugging Face directory into this rank's model chunks, reading only their shards from the files.

    Each parameter is read as the rows, columns, key/value groups or experts of this rank's TP / PP / EP position
    (see :func:`~forge_lightning.modules.llm.megatron.weights.shard_indices`): no rank holds a full model, and a rank's
    host memory peaks at one parameter's shard. The result is bit-identical to filling the chunks from the
    full tensors (:func:`load_state`).

    Args:
        chunks: this rank's megatron model chunks (one per virtual pipeline stage).
        config: the decoder's configuration (must match the checkpoint's ``config.json``).
        path: the Hugging Face directory.

    Returns:
        The (closed) reader, whose ``elements_read`` counts the elements read.

    Raises:
        KeyError: a tensor is missing (named with the file and its expected shape).
        ValueError: the config does not match, or a tensor has the wrong shape (named with its file).
    """
    from forge_lightning.modules.llm.hf import check_compatible

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    check_compatible(config, LLMConfig.load(path / "config.json"))
    shapes = _hf_shapes(config)
    tp = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    expert_tp = (
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )
    with SafetensorsSlices(path) as files, torch.no_grad():
        for chunk in chunks:
            params, filled = named_tensors(chunk), set()
            for rule in weight_rules(chunk, config):
                param = params[rule.megatron]
                rank, size = expert_tp if rule.expert else tp
                full = [tuple(shapes[name]) for name in rule.hf]
                indices = shard_indices(rule, full, config, rank, size)
                parts = [
                    files.read(name, index, shape, rule.megatron).to(param.device)
                    for name, index, shape in zip(rule.hf, indices, full, strict=True)
                ]
                shard = assemble_shard(rule, parts, config, size)
                if shard.shape != param.shape:
                    raise ValueError(
                        f"{rule.megatron}: shard of {rule.hf} has shape {tuple(shard.shape)}, parameter "
                        f"{tuple(param.shape)}"
                    )
                param.copy_(shard)
                filled.add(rule.megatron)
            check_all_filled(chunk, filled)
    return files


def load_state(chunks: Sequence[nn.Module], config: LLMConfig, read: Callable[[str], Tensor]) -> None:
    """Fill this rank's chunks from a reader of full Hugging Face tensors (see :func:`load_hf_weights`).

    The reference path (the module's materialised weights); :func:`load_hf_checkpoint` reads shards instead.
    """
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
        params = named_tensors(chunk)
        for rule in weight_rules(chunk, config):
            if replica[rule.expert] == 0:
                local.setdefault(rule.hf, (rule, params[rule.megatron]))
    published: list[Any] = [None] * dist.get_world_size()
    # With the dtype: a router's selection bias stays fp32 in a bf16 model.
    mine = [(hf, stage, groups[rule.expert].rank(), t.dtype) for hf, (rule, t) in local.items()]
    dist.all_gather_object(published, mine)
    # One order for every rank (first appearance by rank); each tensor's gatherers: its first stage's holders.
    first_stage: dict[tuple[str, ...], int] = {}
    for entries in published:
        for hf, st, *_ in entries:
            first_stage[hf] = min(st, first_stage.get(hf, st))
    sources = {
        hf: (r, dt)
        for r, entries in enumerate(published)
        for hf, st, tp, dt in entries
        if tp == 0 and st == first_stage[hf]
    }
    # A rank may hold no tensor to gather (DP > 0, no experts).
    device = next(unwrap(chunks[0]).parameters()).device
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
        src, dtype = sources[hf]
        state.update(_to_rank_zero(full, hf, src, shapes, (dtype, device)))
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

"""Checkpoints of ``MegatronStrategy``: megatron-core dist-checkpoints that resume at any TP / PP / VPP / DP layout.

A checkpoint is a directory (Lightning's ``ModelCheckpoint`` names it like a file, e.g. ``epoch=0-step=3.ckpt``)::

    epoch=0-step=3.ckpt/
      metadata.json  common.pt  .metadata  __*_*.distcp   megatron-core dist_checkpointing, torch_dist backend:
                                                         the model chunks ("model0", "model1", ...), a composed
                                                         model's encoder side ("components") and the
                                                         (distributed) optimizer ("optimizer"), one file per
                                                         writing rank and thread
      meta.pt                                            Lightning's own state: global step, loops (with the data
                                                         loader position), LR schedulers, callbacks, hyper-
                                                         parameters, and the layout it was written at; plain
                                                         containers only (loads with ``weights_only=True``)
      config.json                                        the model's Hugging Face config
      forge-manifest.json                                size and hash of every other file (each rank hashes
                                                         the shards it wrote), checked before a load

Why the layout may change on resume: megatron-core saves every tensor under a global key with its global shape
(the layers stacked on a leading layer axis, each TP rank's shard a slice of it), and the optimizer state
alongside the parameter it belongs to. Loading asks for this run's slices of those global tensors, whatever layout
wrote them. The DistributedOptimizer's state has two forms (megatron-core's names):

* ``dp_reshardable`` (the default, as in Megatron-LM): each rank writes its own contiguous shards, with no gather.
  It resumes at another data-parallel size only; another TP / PP / VPP / CP / EP layout is refused by name.
* ``fully_reshardable`` (``MegatronStrategy(dist_ckpt_optim_fully_reshardable=True)``, and every checkpoint of
  format version 1): the state is gathered and saved like the parameters, so it resumes at any layout; the gather
  runs through host memory (about 30 s for a 1B model with Adam on one H200).

A composed model's encoder side (plain modules at TP = 1, replicated over the TP x DP group, see components.py)
is stored under ``components.<name>.<parameter>`` as unsharded tensors whose replica id names TP rank 0 of DP rank
0 as the writer; its Adam moments are matched to those tensors like the twin's, so they load at any decoder layout.

Callbacks' per-parameter state (the EMA callback's average: a mapping from the strategy's trained-parameter names to
tensors shaped like them, see :class:`~forge_lightning.contracts.TrainedParameters`) is saved like the parameters,
each rank its shards, under ``callbacks.<callback state key>.<path in its state>.<the parameter's key>`` with the
parameter's global shape and this rank's slice of it; ``meta.pt`` keeps a stand-in in its place. On load the live
callback's state gives the template (this run's names and shards), so it resumes at another layout too::

    checkpoint["callbacks"]["EMA"]["average"] = {"model0.decoder.layers.0.self_attention.linear_qkv.weight": ...}
      -> dist-checkpoint "callbacks.EMA.average.decoder.layers.self_attention.linear_qkv.weight" (layers stacked)
      meta.pt: "megatron-sharded:callbacks.EMA.average"

Atomic: every rank writes into ``.<name>.tmp`` beside the target; once all have finished, global rank 0 renames
it into place. A crash mid-save leaves the previous checkpoints untouched (and a stale ``.tmp`` that the next save
replaces).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch import nn
from typing_extensions import override

from forge_lightning.atomic_io import old_sibling, replace
from forge_lightning.contracts import MegatronTwin, experts_apart
from forge_lightning.manifest import verify_before_load_collective, write_directory_manifest_collective
from forge_lightning.strategies.checkpoint_io import atomic_torch_save
from forge_lightning.strategies.distributed_checkpoint import CHECKPOINT_WRITERS

FORMAT = "forge-megatron-dist-checkpoint"
FORMAT_VERSION = 2  # 2: meta.pt names the DistributedOptimizer's state form (1: always fully_reshardable)
META_FILE = "meta.pt"
CONFIG_FILE = "config.json"
MEGATRON_METADATA_FILE = "metadata.json"  # written last by megatron-core's dist_checkpointing.save
# Keys of the checkpoint dict handed to MegatronCheckpointIO.save_checkpoint that are not Lightning's own.
SHARDED_KEY = "state_dict"  # the sharded state dict (model chunks + optimizer)
COMPONENTS_KEY = "components"  # a composed model's encoder side (sharded state dict entry, tensor key prefix)
CALLBACKS_KEY = "callbacks"  # callbacks' per-parameter state (sharded state dict entry, tensor key prefix)
HF_CONFIG_KEY = "hf_config"  # written as config.json
INFO_KEY = "megatron"  # format, layout and optimizer kind, kept in meta.pt
# The DistributedOptimizer's state forms (see the module docstring); version 1 always wrote the second.
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
# The degrees a dp_reshardable optimizer state must be resumed at (its buffers are laid out by them).
_MODEL_PARALLEL_DEGREES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


# ----------------------------------------------------------------------------------------------- state dicts


def inner_chunk(chunk: nn.Module) -> nn.Module:
    """The chunk inside megatron's ``DistributedDataParallel`` (``Float16Module`` or ``GPTModel``)."""
    from megatron.core.distributed import DistributedDataParallel

    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def optimizer_sharding(meta: Mapping[str, Any]) -> str:
    """The form the DistributedOptimizer's state was saved in, from a checkpoint's ``meta.pt``."""
    info = meta.get(INFO_KEY, {})
    return info.get("optimizer_sharding") or FULLY_RESHARDABLE


def sharded_state_dict(
    chunks: Sequence[nn.Module],
    optimizer: Any | None,
    *,
    is_loading: bool,
    components: Mapping[str, nn.Module] | None = None,
    optimizer_sharding: str = DP_RESHARDABLE,
) -> dict[str, Any]:
    """The sharded state dict of this rank's model chunks, a composed model's encoder side and (optionally)
    megatron's optimizer.

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage), DDP-wrapped or not.
        optimizer: megatron's (chained) optimizer, or ``None`` for the weights only.
        is_loading: build the template to load into (allocates optimizer state not yet created).
        components: a composed model's encoder-side modules by component name (plain modules, replicated on
            every rank of the TP x DP group; see components.py).
        optimizer_sharding: the DistributedOptimizer's state form, ``dp_reshardable`` or ``fully_reshardable``
            (to load: the checkpoint's, see :func:`optimizer_sharding`).

    Returns:
        ``{"model0": ..., "model1": ..., "components": ..., "optimizer": ...}``. The nesting only names this rank's
        parts: every tensor carries its own global key, so a checkpoint written with N chunks loads into M.
    """
    state: dict[str, Any] = {
        f"model{i}": inner_chunk(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)
    }
    for i, chunk in enumerate(chunks):
        check_tensor_parallel_shards(chunk, state[f"model{i}"])
    if components:
        state[COMPONENTS_KEY] = {name: _replicated(module, name) for name, module in components.items()}
    if optimizer is not None:
        if is_loading:
            _allocate_distributed_adam_state(optimizer)
            _describe_sgd_state(optimizer)
        # Adam's moments (and fp32 main weights) are matched to the parameters of `state`, so the encoder side's
        # are saved and resharded like its parameters.
        state["optimizer"] = _optimizer_state(optimizer, state, is_loading, optimizer_sharding)
    return state


def check_tensor_parallel_shards(chunk: nn.Module, chunk_state: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming each tensor-parallel parameter (megatron's ``tensor_model_parallel`` tag) that the
    chunk's sharded state dict would save whole: TP rank 0's shard would then stand for the full tensor, and the
    checkpoint would load wrong weights at any layout (a submodule that megatron's ``sharded_state_dict`` does not
    reach with its TP sharding, e.g. a plain ``nn.ModuleList`` of a twin's own layers). Routed experts (tagged
    ``allreduce = False``) are split over the expert-TP group instead and are not checked here."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    named = [
        (n, p)
        for n, p in inner_chunk(chunk).named_parameters()
        if getattr(p, "tensor_model_parallel", False) and getattr(p, "allreduce", True)
    ]
    if not named:
        return
    entries = get_param_id_to_sharded_param_map(chunk_state, [p for _, p in named])
    whole = [
        name
        for i, (name, _) in enumerate(named)
        if i not in entries or _saved_whole(entries[i], ShardedTensor)
    ]
    if whole:
        raise ValueError(
            f"the tensor-parallel parameters {whole[:4]} would be saved whole, not as TP shards: the chunk's "
            "sharded_state_dict() must give them as split ShardedTensors (megatron's parallel layers and "
            "MegatronModule.sharded_state_dict of their parents do; see MegatronTwin.build_chunks)"
        )


def _saved_whole(entry: Any, sharded_tensor: type) -> bool:
    """Whether a sharded state dict entry stores its tensor unsplit (a factory splits it: not whole)."""
    if not isinstance(entry, sharded_tensor):
        return False
    data_dims = tuple(entry.global_shape[entry.prepend_axis_num :])  # without the stacked layer / expert axes
    return data_dims == tuple(entry.local_shape)[-len(data_dims) :]


def _replicated(module: nn.Module, name: str) -> dict[str, Any]:
    """``module``'s state as replicated tensors, keyed ``components.<name>.<parameter>``.

    megatron's replica id of an unsharded tensor is ``(0, TP rank, DP rank)``; its first entry is set to the pipeline
    rank here, as the encoder side spread over the stages has a replica on each: only TP rank 0 of DP rank 0 of the
    first stage writes it, every rank reads it whole. ``keep_vars``: the optimizer finds its parameters among these
    tensors (and takes their replica ids for its state).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = make_sharded_tensors_for_checkpoint(
        module.state_dict(keep_vars=True), f"{COMPONENTS_KEY}.{name}."
    )
    stage = parallel_state.get_pipeline_model_parallel_rank()
    for entry in state.values():
        entry.replica_id = (stage, *entry.replica_id[1:])
    return state


def _optimizer_state(
    optimizer: Any, model_state: dict[str, Any], is_loading: bool, sharding: str
) -> dict[str, Any]:
    """``optimizer.sharded_state_dict``, except for a bf16 optimizer that also steps fp32 parameters (see
    :func:`_mixed_float16_state`)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    members = getattr(optimizer, "chained_optimizers", [optimizer])
    mixed = [
        m
        for m in members
        if isinstance(m, Float16OptimizerWithFloat16Params) and any(m.fp32_from_fp32_groups)
    ]
    if not mixed:
        return optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": sharding}
        )
    if len(members) > 1:
        raise NotImplementedError(
            "checkpoints of a bf16 run whose megatron optimizer is chained (expert parallelism or ETP != TP) and "
            "steps fp32 parameters (a composed model's encoder side) are not yet supported; train with "
            "expert_model_parallel_size=1 and the default expert_tensor_parallel_size, or precision 32-true"
        )
    return _mixed_float16_state(mixed[0], model_state, is_loading)


def _mixed_float16_state(optimizer: Any, model_state: dict[str, Any], is_loading: bool) -> dict[str, Any]:
    """The sharded state of megatron's bf16 optimizer when it also steps fp32 parameters (in bf16 runs, a composed
    model's encoder side keeps fp32 parameters, see components.py), in the layout megatron's own loads.

    megatron-core 0.16's ``Float16OptimizerWithFloat16Params.sharded_state_dict`` numbers the optimizer's
    parameters over its bf16 ones only, while torch's optimizer state dict numbers all of them, group after group:
    with fp32 parameters among them the ids no longer match (``Param id ... does not match``, or Adam's moments
    saved under another parameter's key). Here each id is matched to the model parameter its optimizer entry
    stands for: a bf16 parameter's fp32 main copy stands for it, an fp32 parameter for itself.
    """
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    if is_loading:
        optimizer.init_state_fn(optimizer.optimizer, optimizer.config)
    state = optimizer.state_dict()
    owner = {  # fp32 main copy -> its bf16 model parameter
        id(main): param
        for params, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups, strict=True)
        for param, main in zip(params, mains, strict=True)
    }
    groups = optimizer.optimizer.param_groups
    by_id = get_param_id_to_sharded_param_map(
        model_state, [owner.get(id(p), p) for group in groups for p in group["params"]]
    )
    saved_groups = state["optimizer"]["param_groups"]
    # Per group, the main copies of its bf16 parameters in order (what megatron's load_state_dict copies back).
    state["fp32_from_fp16_params"] = [
        [
            make_sharded_optimizer_tensor(by_id[i], p, prefix="optimizer.state.fp32_param")
            for i, p in zip(saved["params"], group["params"], strict=True)
            if id(p) in owner
        ]
        for saved, group in zip(saved_groups, groups, strict=True)
    ]
    # One step for all parameters, stored once (megatron's load gives each parameter a copy).
    steps = [entry["step"] for entry in state["optimizer"]["state"].values() if "step" in entry]
    if any(not torch.equal(torch.as_tensor(s), torch.as_tensor(steps[0])) for s in steps):
        raise ValueError("the optimizer's step differs between parameters; megatron-core stores one step")
    optim_state_to_sharding_state(state["optimizer"], by_id, exclude_keys="step")
    if steps:
        state["optimizer"]["state"]["common_step"] = steps[0]
    return state


def _allocate_distributed_adam_state(optimizer: Any) -> None:
    """Give each parameter of a fresh DistributedOptimizer's torch Adam a zero state (step 0), in place.

    Without TransformerEngine or Apex, megatron-core's ``DistributedOptimizer.state_dict`` reads every parameter's
    Adam ``step``, which torch creates only at the first step: a fresh optimizer could not describe what to load.
    The zeros are overwritten by the load; parameters are not touched (unlike a dummy step, which would decay them).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = member.optimizer
        if not isinstance(member, DistributedOptimizer) or not isinstance(
            inner, torch.optim.Adam | torch.optim.AdamW
        ):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }


def _describe_sgd_state(optimizer: Any) -> None:
    """Give megatron's SGD optimizers the ``init_state_fn`` megatron-core 0.16 leaves unset, in place.

    Its ``sharded_state_dict(is_loading=True)`` calls ``init_state_fn`` to create the state a fresh optimizer
    lacks (``TypeError: 'NoneType' object is not callable`` for SGD): here it allocates the momentum buffers torch's
    SGD creates at the first step (zeros, overwritten by the load; none without momentum).
    """

    def init_state(inner: torch.optim.Optimizer, config: Any = None) -> None:
        for group in inner.param_groups:
            if group["momentum"]:
                for param in group["params"]:
                    inner.state[param].setdefault("momentum_buffer", torch.zeros_like(param))

    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(member.optimizer, torch.optim.SGD) and getattr(member, "init_state_fn", None) is None:
            member.init_state_fn = init_state


def load_into(
    chunks: Sequence[nn.Module],
    optimizer: Any | None,
    loaded: Mapping[str, Any],
    components: Mapping[str, nn.Module] | None = None,
) -> None:
    """Copy a loaded sharded state dict (see :func:`sharded_state_dict`) into the chunks, the encoder-side
    ``components`` and the optimizer."""
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"], strict=True)
    for name, module in (components or {}).items():
        prefix = f"{COMPONENTS_KEY}.{name}."
        module.load_state_dict(
            {k.removeprefix(prefix): v for k, v in loaded[COMPONENTS_KEY][name].items()}, strict=True
        )
    if optimizer is None:
        return
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    states = (
        [loaded["optimizer"]] if len(members) == 1 else [v for _, v in sorted(loaded["optimizer"].items())]
    )
    for member, state in zip(members, states, strict=True):
        _load_optimizer(member, state)


def _load_optimizer(optimizer: Any, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, working around two faults of megatron-core 0.16's DistributedOptimizer
    around torch's Adam (no TransformerEngine or Apex):

    * it gives every parameter the *same* ``step`` tensor, which torch's Adam then increments once per parameter
      in each step (a wrong bias correction from the first step after a resume): each gets its own copy here;
    * it copies the loaded state into every entry of Adam's state, ``step`` included, which the loaded state lacks
      (it is kept per group): a ``KeyError: 'step'`` in the ``fully_reshardable`` form. So the groups and steps
      load first, then the parameter state (in the form it was saved in) with the ``step`` entries set aside.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    loaders = {
        FULLY_RESHARDABLE: "load_parameter_state_from_fully_reshardable",
        DP_RESHARDABLE: "load_parameter_state_from_dp_reshardable",
    }
    sharding = state.get("param_state_sharding_type")
    if not isinstance(optimizer, DistributedOptimizer) or sharding not in loaders:
        optimizer.load_state_dict(state)
        return
    state = dict(state)
    param_state = state.pop("param_state")
    state.pop("param_state_sharding_type")
    optimizer.load_state_dict(state)  # param groups, Adam's step, grad scaler
    inner = optimizer.optimizer.state
    steps = {param: entry.pop("step") for param, entry in inner.items() if "step" in entry}
    try:
        with torch.no_grad():  # dp_reshardable's loader copies into views of leaves that require grad
            getattr(optimizer, loaders[sharding])(param_state)
    finally:
        for param, step in steps.items():
            inner[param]["step"] = step.clone()


def _sharded_tensors(state: Any) -> list[Any]:
    """Every ``ShardedTensor`` of a sharded state dict (factories expanded into the tensors they save)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    tensors = []
    for value in nested_values(state):
        if isinstance(value, ShardedTensorFactory):
            tensors += _sharded_tensors(value.build())
        elif isinstance(value, ShardedTensor):
            tensors.append(value)
    return tensors


# ----------------------------------------------------------------------------------------------- validation


def _stale_hint(path: Path) -> str:
    old = old_sibling(path)
    if old.is_dir():
        return (
            f" (a save interrupted while replacing it left the previous checkpoint at {old}: rename it back)"
        )
    return ""


def check_is_checkpoint(path: Path) -> dict[str, Any]:
    """Raise a clear error unless ``path`` is a complete checkpoint of this format; return its ``meta.pt``."""
    if path.is_file():
        raise ValueError(
            f"{path} is a file, not a MegatronStrategy checkpoint directory: checkpoints of the other strategies "
            "do not load under MegatronStrategy; export their weights to Hugging Face (forge-convert ckpt-to-hf) "
            "and start from them with model.init_args.pretrained"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} not found{_stale_hint(path)}")
    missing = [name for name in (META_FILE, MEGATRON_METADATA_FILE) if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"{path} is not a complete MegatronStrategy checkpoint (no {', '.join(missing)}); checkpoints are "
            "renamed into place only once complete, so this directory was not written by MegatronStrategy or "
            "forge-convert hf-to-megatron"
        )
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    info = meta.get(INFO_KEY, {})
    if info.get("format") != FORMAT or info.get("version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path}/{META_FILE} has format {info.get('format')!r} version {info.get('version')!r}; this "
            f"forge-lightning reads {FORMAT!r} up to version {FORMAT_VERSION}"
        )
    return meta


def check_tensors(path: Path, template: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the tensors of ``template`` that the checkpoint lacks or holds in another shape.

    megatron-core lets the embedding and output layer load with a different vocabulary size (it pads them); here
    every global shape must match, so a checkpoint of another model never loads silently.
    """
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(str(path))
    missing, mismatched = [], []
    for tensor in _sharded_tensors(template):
        if tensor.key not in stored:
            missing.append(tensor.key)
        elif tuple(stored[tensor.key].global_shape) != tuple(tensor.global_shape):
            saved = tuple(stored[tensor.key].global_shape)
            mismatched.append(f"{tensor.key}: checkpoint {saved}, this run {tuple(tensor.global_shape)}")
    if mismatched:
        raise ValueError(
            f"{path} holds tensors of another shape than this model's (global shapes, layers stacked first):\n  "
            + "\n  ".join(sorted(set(mismatched)))
            + f"\nResume with the model config the checkpoint was written with ({path / CONFIG_FILE})."
        )
    if missing:
        weights_only = all(key.startswith("optimizer.") for key in missing)
        components = sorted({key.split(".")[1] for key in missing if key.startswith(f"{COMPONENTS_KEY}.")})
        if weights_only:
            hint = (
                "it holds no optimizer state (a weights-only checkpoint): to train from its weights, convert it "
                "with forge-convert megatron-to-hf and pass the directory as model.init_args.pretrained"
            )
        elif components:
            hint = (
                f"it holds no weights for the components {components} (written for another model, e.g. the "
                "decoder LM alone): start the composed model from the decoder's weights (forge-convert "
                "megatron-to-hf) instead"
            )
        else:
            hint = "it was written for another model or optimizer"
        raise ValueError(
            f"{path} lacks {len(missing)} tensors this run needs ({sorted(set(missing))[:4]} ...): {hint}"
        )


def check_model_config(path: Path, twin: MegatronTwin) -> None:
    """Raise ``ValueError`` naming every architecture field on which the checkpoint's model differs from the twin's
    (the twin's family compares the configs)."""
    try:
        twin.check_checkpoint_config(read_hf_config(path))
    except ValueError as err:
        raise ValueError(
            f"{path} was written for another model: {err}\nResume with the model config the checkpoint was "
            f"written with ({path / CONFIG_FILE}), or start a new run"
        ) from err


def check_optimizer_kind(path: Path, meta: Mapping[str, Any], kind: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when the checkpoint's optimizer was of another kind (distributed or not, precision)."""
    saved = meta.get(INFO_KEY, {}).get("optimizer")
    if saved is None or dict(saved) == dict(kind):
        return
    raise ValueError(
        f"{path} was written with optimizer {dict(saved)}, this run has {dict(kind)}: megatron-core stores the "
        "distributed and the plain optimizer (and fp32 / bf16 main weights, Muon's and Adam's state) differently; "
        "resume with the checkpoint's use_distributed_optimizer, trainer.precision and optimizer.name"
    )


def check_expert_layout(path: Path, meta: Mapping[str, Any], degrees: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when the optimizer state was written with the experts' optimizer kept apart and this run
    does not keep it apart, or the reverse: megatron-core gives the experts an optimizer of their own when their
    gradients are reduced over another group (:func:`~forge_lightning.contracts.experts_apart`: EP > 1, or ETP ≠ TP), and the two
    store the optimizer state under other names."""
    info = meta.get(INFO_KEY, {})
    layout = info.get("layout") or {}
    saved = {
        "expert_model_parallel_size": layout.get("expert_model_parallel_size", 1),
        "expert_tensor_parallel_size": layout.get("expert_tensor_parallel_size"),
        "tensor_model_parallel_size": layout.get("tensor_model_parallel_size", 1),
    }
    if info.get("optimizer") is None or experts_apart(saved) == experts_apart(degrees):
        return
    written = ", ".join(f"{k}={v}" for k, v in saved.items())
    now = ", ".join(f"{k}={degrees.get(k)}" for k in saved)
    raise ValueError(
        f"{path} was written with {written}; this run has {now}: megatron-core keeps the experts' optimizer "
        "state apart only with expert parallelism or an expert tensor-parallel size other than TP, so it does "
        "not resume across that change. Resume with a layout that "
        f"{'keeps' if experts_apart(saved) else 'does not keep'} the experts apart, or take its weights only "
        "(forge validate / test --ckpt_path, or forge-convert megatron-to-hf and model.init_args.pretrained)"
    )


def check_optimizer_layout(path: Path, meta: Mapping[str, Any], degrees: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when a DistributedOptimizer state saved ``dp_reshardable`` would resume at another
    model-parallel layout: its buffers are laid out by TP / PP / VPP / CP / EP / ETP (only DP may change)."""
    info = meta.get(INFO_KEY, {})
    if not (info.get("optimizer") or {}).get("distributed") or optimizer_sharding(meta) != DP_RESHARDABLE:
        return
    saved, now = _model_parallel_degrees(info.get("layout") or {}), _model_parallel_degrees(degrees)
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in _MODEL_PARALLEL_DEGREES if saved[k] != now[k]]
    if not changed:
        return
    raise ValueError(
        f"{path} holds the distributed optimizer's state in its dp_reshardable form, which resumes at another "
        f"data-parallel size only; this run changes {', '.join(changed)}. Resume at the checkpoint's layout "
        "(and save with dist_ckpt_optim_fully_reshardable: true there, which resumes at any layout), or take its "
        "weights only (forge validate / test --ckpt_path, or forge-convert megatron-to-hf and "
        "model.init_args.pretrained)"
    )


def _model_parallel_degrees(layout: Mapping[str, Any]) -> dict[str, int]:
    """The degrees of ``_MODEL_PARALLEL_DEGREES`` with megatron-core's defaults filled in (ETP: TP, others: 1)."""
    tp = layout.get("tensor_model_parallel_size") or 1
    return {
        k: layout.get(k) or (tp if k == "expert_tensor_parallel_size" else 1) for k in _MODEL_PARALLEL_DEGREES
    }


def check_frozen(path: Path, meta: Mapping[str, Any], frozen: Sequence[str]) -> None:
    """Raise ``ValueError`` when the checkpoint's optimizer was written with other components frozen: it holds state
    for the trainable parameters only, so the optimizer does not resume across a change of freezing."""
    info = meta.get(INFO_KEY, {})
    saved = info.get("frozen")
    if info.get("optimizer") is None or saved is None or sorted(saved) == sorted(frozen):
        return
    raise ValueError(
        f"{path} was written with the components {sorted(saved)} frozen, this run freezes {sorted(frozen)}: the "
        "optimizer holds state for the trainable parameters only, so it does not resume across a change of "
        "freezing. Resume with the checkpoint's components.<name>.freeze settings, or take its weights only "
        "(forge validate / test --ckpt_path, or full_model_state_dict)"
    )


def describe_layout(meta: Mapping[str, Any]) -> str:
    """``written at TP=2 PP=1 VPP=1 DP=1 EP=1 by 2 processes`` from a checkpoint's ``meta.pt``."""
    info = meta.get(INFO_KEY, {})
    layout = info.get("layout") or {}
    if not layout:
        return "layout unknown"
    degrees = [
        f"TP={layout.get('tensor_model_parallel_size', 1)}",
        f"PP={layout.get('pipeline_model_parallel_size', 1)}",
        f"VPP={layout.get('virtual_pipeline_model_parallel_size') or 1}",
        f"DP={layout.get('data_parallel_size', 1)}",
        f"EP={layout.get('expert_model_parallel_size', 1)}",
        f"ETP={layout.get('expert_tensor_parallel_size') or layout.get('tensor_model_parallel_size', 1)}",
    ]
    return f"written at {' '.join(degrees)} by {info.get('world_size', '?')} processes"


# ----------------------------------------------------------------------------------------------- the I/O plugin


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _on_rank_zero(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on global rank 0 only; if it fails, every rank raises (none waits for it forever)."""
    distributed = dist.is_available() and dist.is_initialized()
    error: BaseException | None = None
    if not distributed or dist.get_rank() == 0:
        try:
            fn()
        except Exception as err:  # re-raised below, on this rank and (as a message) on the others
            error = err
    message = [f"{type(error).__name__}: {error}" if error is not None else None]
    if distributed:
        dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise RuntimeError(f"global rank 0 failed to {what}: {message[0]}")


def _fresh_directory(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # left by a crashed save
    path.mkdir(parents=True)


def _start_results_queue_by_fork() -> None:
    """megatron-core's writer processes report through a queue served by a multiprocessing Manager, which it starts
    with ``spawn`` at the first save of a process: a new interpreter that imports the entry point again (5 s on a
    CPU machine, once per run, which is the whole end of a short run). Started here with ``fork``, as megatron-core
    starts the writer processes themselves. Skipped if megatron-core no longer keeps the queue in that global."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(initializer=_default_signal_handlers)
        filesystem_async._results_queue = manager.Queue()  # the queue's proxy keeps the manager alive


def _default_signal_handlers() -> None:
    """The default action for every signal a Python handler of the parent took over: a forked Manager would run them
    itself (Lightning's SIGTERM handler broadcasts over the parent's process group, and would hang there)."""
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_DFL)


class MegatronCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing megatron-core dist-checkpoints atomically (see the module docstring).

    Saving and loading are collective: every rank calls them. ``save_checkpoint`` takes Lightning's checkpoint
    dict whose ``state_dict`` entry is the sharded state dict of the model chunks and optimizer; ``hf_config``,
    if present, is written as ``config.json``; everything else goes to ``meta.pt``.

    Args:
        writers_per_rank: files each rank writes in parallel (megatron-core's ``torch_dist`` writer forks one
            process per file); more suit parallel file systems, one suits a single slow disk.
    """

    def __init__(self, writers_per_rank: int = CHECKPOINT_WRITERS) -> None:
        if writers_per_rank < 1:
            raise ValueError(f"writers_per_rank must be at least 1, got {writers_per_rank}")
        self.writers_per_rank = writers_per_rank
        self._verified: set[Path] = set()

    def verify(self, path: str | os.PathLike[str]) -> None:
        """Check the checkpoint's files against its manifest, once per path (every rank hashes a share of them).
        Collective.

        Raises:
            ManifestError: a file is missing or changed.
        """
        path = Path(path)
        if path not in self._verified:
            verify_before_load_collective(path)
            self._verified.add(path)

    def _save_strategy(self) -> Any:
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        _start_results_queue_by_fork()
        return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=self.writers_per_rank)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        from megatron.core import dist_checkpointing

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        checkpoint = dict(checkpoint)
        sharded = checkpoint.pop(SHARDED_KEY)
        hf_config = checkpoint.pop(HF_CONFIG_KEY, None)
        checkpoint[SHARDED_KEY] = {}  # Lightning expects the key; the weights are in the dist-checkpoint
        checkpoint[INFO_KEY] = {**checkpoint.get(INFO_KEY, {}), "format": FORMAT, "version": FORMAT_VERSION}
        _on_rank_zero(lambda: _fresh_directory(tmp), f"create {tmp}")
        dist_checkpointing.save(sharded, str(tmp), sharded_strategy=self._save_strategy())

        def write_meta() -> None:
            atomic_torch_save(checkpoint, tmp / META_FILE)
            if hf_config is not None:
                (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")

        _on_rank_zero(write_meta, f"write {tmp / META_FILE}")
        write_directory_manifest_collective(tmp, threads=self.writers_per_rank)
        _on_rank_zero(lambda: replace(tmp, path), f"rename {tmp} to {path}")

    @override
    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        sharded_state_dict: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Lightning's state from ``meta.pt``; with a ``sharded_state_dict`` template, also the tensors it names.

        Args:
            path: the checkpoint directory.
            map_location: unused (tensors load onto the template's devices).
            weights_only: unused: ``meta.pt`` always loads with ``weights_only=True``.
            sharded_state_dict: what to load (see :func:`sharded_state_dict` with ``is_loading=True``); its
                tensors are checked against the checkpoint first. The result's ``state_dict`` holds them.
        """
        from megatron.core import dist_checkpointing

        path = Path(path)
        meta = check_is_checkpoint(path)
        if sharded_state_dict is not None:
            self.verify(path)
            check_tensors(path, sharded_state_dict)
            meta[SHARDED_KEY] = dist_checkpointing.load(sharded_state_dict, str(path))
        return meta

    @override
    def remove_checkpoint(self, path: Any) -> None:
        path = Path(path)
        if path.is_symlink() or path.is_file():  # e.g. ModelCheckpoint's link to the last checkpoint
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` stored in a checkpoint directory."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"no {CONFIG_FILE} in {path}: not a MegatronStrategy / forge-convert checkpoint"
        )
    return json.loads(file.read_text())

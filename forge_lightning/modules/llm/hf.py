"""Hugging Face interchange: read and write safetensors checkpoints with their ``config.json``.

Parameter names are identical on both sides (see :mod:`forge_lightning.modules.llm.model`), so the mapping is
the identity, except that:

- a tied ``lm_head.weight`` is absent from Hugging Face files, and rotary ``inv_freq`` buffers found in old
  checkpoints are ignored;
- MoE experts live in the model as 3-D tensors (transformers 5's in-memory layout) but in Hugging Face files, as
  published and as transformers writes them, one by one::

      mlp.experts.gate_up_proj [E, 2I, D]  <->  mlp.experts.{e}.gate_proj.weight [I, D]   (rows :I of expert e)
                                                mlp.experts.{e}.up_proj.weight   [I, D]   (rows I: of expert e)
      mlp.experts.down_proj    [E, D, I]   <->  mlp.experts.{e}.down_proj.weight [D, I]

  Loading accepts either layout; saving writes the per-expert one. Qwen3-VL-MoE (:data:`FUSED_EXPERT_FILES`) keeps
  them fused in its files: as published, transposed (``gate_up_proj [E, D, 2I]``, ``down_proj [E, I, D]``, which
  transformers 5 transposes on load when the shape differs from its own), and as transformers 5 writes it, in the
  model's layout, which is what saving writes;
- DeepSeek-V3's multi-token-prediction layers (``model.layers.{num_hidden_layers + i}`` for
  ``i < num_nextn_predict_layers``) are skipped on load.

Pickle-based ``*.bin`` files are never read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from forge_lightning.atomic_io import replace
from forge_lightning.manifest import FileChecks, write_directory_manifest
from forge_lightning.modules.layers.state_dict import assign_weights, write_safetensors_shards
from forge_lightning.modules.llm.config import LLMConfig, field_value
from forge_lightning.modules.llm.model import DecoderLM

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TIED_HEAD_KEY = "lm_head.weight"
EMBEDDING_KEY = "model.embed_tokens.weight"
EXPERT_KEY = re.compile(
    r"(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight"
)
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
FUSED_EXPERT_FILES = ("qwen3_vl_moe_text",)
"""Architectures whose Hugging Face files hold each layer's experts as 3-D tensors, not one by one."""

# Fields that change the computed function: a checkpoint must agree with the model on all of them. Token ids,
# dtype, initializer_range and max_position_embeddings may differ (e.g. when extending the context).
_COMPATIBILITY_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "attention_bias",
    "o_proj_bias",
    "mlp_bias",
    "qk_norm",
    "tie_word_embeddings",
    "moe.num_experts",
    "moe.num_experts_per_tok",
    "moe.intermediate_size",
    "moe.score_func",
    "moe.norm_topk_prob",
    "moe.num_groups",
    "moe.num_groups_per_tok",
    "moe.routed_scaling_factor",
    "moe.shared_intermediate_size",
    "moe.shared_expert_gate",
    "moe.first_dense_layers",
    "moe.layer_step",
    "moe.dense_layers",
    "mla",
)


def load_hf_state_dict(
    path: str | os.PathLike[str], *, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """Read every tensor of a Hugging Face safetensors checkpoint.

    Args:
        path: a checkpoint directory (``model.safetensors`` or a sharded ``model.safetensors.index.json``) or
            a single ``.safetensors`` file.
        device: where to put the tensors.

    Raises:
        FileNotFoundError: the path does not exist, holds no safetensors weights, or its index names a
            missing shard.
        ValueError: the checkpoint only has pickle (``.bin`` / ``.pt``) weights, which are never loaded.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if path.is_file():
        _refuse_pickle([path], path)
        return _read_safetensors(path, device)
    checks = FileChecks(path, "Hugging Face checkpoint")
    if (path / SAFETENSORS_INDEX).is_file():
        checks.check(SAFETENSORS_INDEX)
        return _read_sharded(path, device, checks)
    if (path / SAFETENSORS_FILE).is_file():
        checks.check(SAFETENSORS_FILE)
        return _read_safetensors(path / SAFETENSORS_FILE, device)
    _refuse_pickle(sorted(path.glob("*.bin")) + sorted(path.glob("*.pt")), path)
    others = sorted(p.name for p in path.glob("*.safetensors"))
    hint = f" (found {others} but no {SAFETENSORS_INDEX} naming them)" if others else ""
    raise FileNotFoundError(f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {path}{hint}")


def _refuse_pickle(files: list[Path], where: Path) -> None:
    pickles = [f.name for f in files if f.suffix in (".bin", ".pt")]
    if pickles:
        raise ValueError(
            f"{where} holds pickle weights ({', '.join(pickles)}), which are never loaded because unpickling can "
            "run arbitrary code. Convert them once in a trusted environment, e.g. "
            "`AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst, safe_serialization=True)`, "
            "and load the safetensors copy."
        )


def _read_safetensors(file: Path, device: str | torch.device) -> dict[str, Tensor]:
    with safe_open(file, framework="pt", device=str(device)) as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _read_sharded(path: Path, device: str | torch.device, checks: FileChecks) -> dict[str, Tensor]:
    index_file = path / SAFETENSORS_INDEX
    weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
    state: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise FileNotFoundError(f"{index_file} names shard {shard!r}, which is missing from {path}")
        checks.check(shard)
        tensors = _read_safetensors(path / shard, device)
        wanted = {name for name, file in weight_map.items() if file == shard}
        absent = wanted - tensors.keys()
        if absent:
            raise ValueError(f"shard {shard!r} lacks tensors its index assigns to it: {sorted(absent)}")
        state.update((name, tensors[name]) for name in wanted)
    return state


def check_compatible(model_config: LLMConfig, checkpoint_config: LLMConfig) -> None:
    """Raise ``ValueError`` naming every architecture field on which a checkpoint differs from the model."""
    diffs = [
        f"{name}: checkpoint {field_value(checkpoint_config, name)!r}, model {field_value(model_config, name)!r}"
        for name in _COMPATIBILITY_FIELDS
        if field_value(checkpoint_config, name) != field_value(model_config, name)
    ]
    if diffs:
        raise ValueError("checkpoint config does not match the model:\n  " + "\n  ".join(diffs))


def load_pretrained(model: DecoderLM, path: str | os.PathLike[str]) -> DecoderLM:
    """Load a Hugging Face checkpoint directory into ``model`` strictly (in place; also returned).

    The checkpoint's ``config.json`` must match ``model.config`` (see :func:`check_compatible`). Tensors are
    cast to the model's parameter dtypes. A model built on the meta device takes the checkpoint's tensors as its
    parameters (see :func:`~forge_lightning.modules.layers.state_dict.assign_weights`).

    Args:
        model: the model to fill.
        path: directory with ``config.json`` and safetensors weights.

    Raises:
        FileNotFoundError: no ``config.json`` or weights in ``path``.
        ValueError: the config is incompatible, or tensors are missing, unexpected or of the wrong shape (all
            named).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    hf_config = json.loads((path / "config.json").read_text())
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method")
        raise ValueError(
            f"{path} holds quantized weights (quant_method {method!r}); dequantize them to bf16 first"
        )
    check_compatible(model.config, LLMConfig.from_hf(hf_config))
    # Multi-token prediction layers the model does not build (transformers ignores them too).
    first_unused = model.config.num_layers + model.config.num_nextn_predict_layers
    mtp_layers = range(first_unused, model.config.num_layers + hf_config.get("num_nextn_predict_layers", 0))
    state = {
        k: v
        for k, v in load_hf_state_dict(path).items()
        if not k.endswith("rotary_emb.inv_freq") and _layer_index(k) not in mtp_layers
    }
    return load_hf_weights(model, state, source=f"checkpoint {path}")


def load_hf_weights(
    model: DecoderLM, state: Mapping[str, Tensor], *, source: str = "state dict"
) -> DecoderLM:
    """Copy a Hugging Face-named state dict into ``model`` strictly (in place; also returned).

    Per-expert tensors are fused (:func:`fuse_experts`); a tied ``lm_head.weight`` may be absent or equal to the
    embedding.

    Args:
        model: the model to fill.
        state: tensors named as the model's parameters (``model.*``, ``lm_head.weight``).
        source: what ``state`` came from, for the error message.

    Raises:
        ValueError: tensors are missing, unexpected or of the wrong shape (all named), or a tied head differs
            from the embedding.
    """
    state = fuse_experts(mtp_from_hf(state, model.config, source=source))
    if model.config.tie_word_embeddings and TIED_HEAD_KEY in state:
        head = state.pop(TIED_HEAD_KEY)
        if EMBEDDING_KEY in state and not torch.equal(head, state[EMBEDDING_KEY]):
            raise ValueError(f"config ties the embeddings but {TIED_HEAD_KEY} differs from {EMBEDDING_KEY}")
    expected = {
        k: v
        for k, v in model.state_dict().items()
        if not (model.config.tie_word_embeddings and k == TIED_HEAD_KEY)
    }
    if model.config.architecture in FUSED_EXPERT_FILES:
        state = _experts_in_model_layout(state, expected)
    problems = [f"missing: {k}" for k in expected if k not in state]
    problems += [f"unexpected: {k}" for k in state if k not in expected]
    problems += [
        f"shape mismatch: {k}: checkpoint {tuple(state[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if problems:
        raise ValueError(f"{source} does not fit the model:\n  " + "\n  ".join(problems))
    if model.config.tie_word_embeddings:
        state[TIED_HEAD_KEY] = state[EMBEDDING_KEY]
    assign_weights(model, state)
    return model


def save_pretrained(
    model: DecoderLM,
    config: LLMConfig,
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    *,
    overwrite: bool = False,
    state_dict: Mapping[str, Tensor] | None = None,
) -> Path:
    """Export ``model`` as a Hugging Face checkpoint directory (``config.json``, safetensors, index if sharded).

    Everything is written to a temporary sibling directory that is renamed into place at the end, so an
    interrupted export never leaves a half-written ``out_dir``.

    Args:
        model: the model to export (full, unsharded tensors on any device).
        config: its configuration (written as ``config.json``; ``torch_dtype`` is set to the saved dtype).
        out_dir: destination directory.
        dtype: cast floating tensors to this dtype; default keeps each tensor's dtype.
        max_shard_size: largest shard, in bytes or as a string (``"5GB"``, ``"500MB"``, ``"2GiB"``).
        overwrite: replace an existing non-empty ``out_dir`` (otherwise that is an error).
        state_dict: full tensors to write instead of ``model.state_dict()`` (e.g. gathered from a sharded model).

    Returns:
        The output directory.
    """
    refuse_existing(Path(out_dir), overwrite)  # before the tensors are copied to the host
    tensors = export_tensors(model.state_dict() if state_dict is None else state_dict, config, dtype)
    saved_dtype = next(iter(tensors.values())).dtype
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = hf_config["dtype"] = str(saved_dtype).removeprefix("torch.")
    files = {"config.json": hf_config, **generation_files(hf_config)}
    return write_hf_checkpoint(out_dir, tensors, files, max_shard_size=max_shard_size, overwrite=overwrite)


def refuse_existing(out_dir: Path, overwrite: bool) -> None:
    """Raise ``FileExistsError`` if ``out_dir`` holds files and ``overwrite`` is not set."""
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty: choose another output directory, or replace it (forge-convert: "
            "--overwrite; from Python: overwrite=True)"
        )


def generation_files(hf_config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"generation_config.json": ...}`` with the token ids set in an LLM ``config.json`` dict (empty if none)."""
    generation = {
        k: hf_config[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if hf_config.get(k) is not None
    }
    return {"generation_config.json": generation} if generation else {}


def write_hf_checkpoint(
    out_dir: str | os.PathLike[str],
    tensors: dict[str, Tensor],
    json_files: Mapping[str, dict[str, Any]],
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write ``tensors`` (safetensors, sharded with an index past ``max_shard_size``), the ``json_files``
    (``{"config.json": {...}, ...}``) and a manifest of hashes into ``out_dir``.

    Everything is written to a temporary sibling directory that is renamed into place at the end, so an
    interrupted export never leaves a half-written ``out_dir``.

    Args:
        out_dir: destination directory.
        tensors: contiguous CPU tensors by Hugging Face name.
        json_files: file name to content of each JSON file.
        max_shard_size: largest shard, in bytes or as a string (``"5GB"``, ``"500MB"``, ``"2GiB"``).
        overwrite: replace an existing non-empty ``out_dir`` (otherwise that is an error).

    Returns:
        The output directory.
    """
    out_dir = Path(out_dir)
    refuse_existing(out_dir, overwrite)
    max_bytes = _parse_size(max_shard_size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        for name, content in json_files.items():
            _write_json(tmp / name, content)
        write_safetensors_shards(tensors, tmp, max_bytes, SAFETENSORS_FILE)
        write_directory_manifest(tmp)
        replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def export_tensors(
    state_dict: Mapping[str, Tensor], config: LLMConfig, dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """The tensors of a decoder state dict as Hugging Face files hold them: experts split, a tied head left out,
    floating tensors cast to ``dtype`` (if given), contiguous on the CPU."""
    tensors = {}
    fused = config.architecture in FUSED_EXPERT_FILES
    state_dict = mtp_to_hf(state_dict, config)
    for name, tensor in (state_dict if fused else split_experts(state_dict)).items():
        if config.tie_word_embeddings and name == TIED_HEAD_KEY:
            continue  # Hugging Face files store the tied matrix once, as the embedding
        tensor = tensor.detach()
        # The selection bias stays fp32, as transformers keeps it: in bf16 it would change which experts win.
        if dtype is not None and tensor.is_floating_point() and not name.endswith("e_score_correction_bias"):
            tensor = tensor.to(dtype)
        tensors[name] = tensor.cpu().contiguous()
    return tensors


def _experts_in_model_layout(state: dict[str, Tensor], expected: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Fused expert tensors of the published Qwen3-VL-MoE layout (``[E, D, 2I]``, ``[E, I, D]``) transposed into the
    model's; a tensor already of the model's shape is kept, as transformers keeps it (so a square ``2I == D`` is read
    as the model's layout)."""
    out = dict(state)
    for name, tensor in state.items():
        want = expected.get(name)
        if not name.endswith(FUSED_EXPERTS) or want is None or tensor.ndim != 3 or tensor.shape == want.shape:
            continue
        if tensor.shape == want.transpose(1, 2).shape:
            out[name] = tensor.transpose(1, 2).contiguous()
    return out


MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
"""Tensors DeepSeek-V3's checkpoint stores in each MTP layer that are the main model's (embedding, output head)."""


def mtp_to_hf(state: Mapping[str, Tensor], config: LLMConfig) -> dict[str, Tensor]:
    """The multi-token prediction modules' tensors under DeepSeek-V3's checkpoint names: ``mtp.{k}.X`` as
    ``model.layers.{num_layers + k}.X``, with copies of the shared embedding and output head in each
    (``embed_tokens.weight``, ``shared_head.head.weight``), as DeepSeek-V3's files hold them."""
    if not config.num_nextn_predict_layers:
        return dict(state)
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        match = _MTP_KEY.match(name)
        if match is None:
            out[name] = tensor
            continue
        out[f"model.layers.{config.num_layers + int(match.group(1))}.{match.group(2)}"] = tensor
    for k in range(config.num_nextn_predict_layers):
        prefix = f"model.layers.{config.num_layers + k}."
        # Copies: safetensors refuses tensors that share memory.
        out[prefix + MTP_SHARED[0]] = state[EMBEDDING_KEY].detach().clone()
        out[prefix + MTP_SHARED[1]] = state.get(TIED_HEAD_KEY, state[EMBEDDING_KEY]).detach().clone()
    return out


def mtp_from_hf(
    state: Mapping[str, Tensor], config: LLMConfig, *, source: str = "state dict"
) -> dict[str, Tensor]:
    """The reverse of :func:`mtp_to_hf`: ``model.layers.{num_layers + k}.X`` as ``mtp.{k}.X``; the copies of the
    embedding and head are dropped (they must equal the main model's: the paper shares them).

    Raises:
        ValueError: a copy differs from the main model's tensor.
    """
    if not config.num_nextn_predict_layers:
        return dict(state)
    out: dict[str, Tensor] = {}
    first = config.num_layers
    for name, tensor in state.items():
        index = _layer_index(name)
        if index is None or not first <= index < first + config.num_nextn_predict_layers:
            out[name] = tensor
            continue
        rest = name[len(f"model.layers.{index}.") :]
        if rest in MTP_SHARED:
            main = state.get(
                EMBEDDING_KEY if rest == MTP_SHARED[0] else TIED_HEAD_KEY, state.get(EMBEDDING_KEY)
            )
            if main is not None and not torch.equal(main, tensor):
                raise ValueError(
                    f"{source}: {name} differs from the main model's {EMBEDDING_KEY if rest == MTP_SHARED[0] else TIED_HEAD_KEY}, "
                    "but multi-token prediction shares the embedding and the output head with the main model"
                )
            continue
        out[f"mtp.{index - first}.{rest}"] = tensor
    return out


_MTP_KEY = re.compile(r"mtp\.(\d+)\.(.+)")


def _layer_index(key: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (``None`` outside the layers)."""
    match = _LAYER_KEY.match(key)
    return None if match is None else int(match.group(1))


def fuse_experts(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert tensors (``mlp.experts.{e}.{gate,up,down}_proj.weight``) as the model's 3-D expert tensors.

    Other tensors pass through unchanged, so a state dict already in the fused layout is returned as is.

    Raises:
        ValueError: some layer's experts are incomplete (the missing tensors are named).
    """
    fused: dict[str, Tensor] = {}
    experts: dict[str, dict[tuple[int, str], Tensor]] = {}
    for name, tensor in state.items():
        match = EXPERT_KEY.fullmatch(name)
        if match is None:
            fused[name] = tensor
        else:
            experts.setdefault(match["prefix"], {})[int(match["expert"]), match["proj"]] = tensor
    for prefix, weights in experts.items():
        num_experts = 1 + max(e for e, _ in weights)
        wanted = [(e, proj) for e in range(num_experts) for proj in ("gate_proj", "up_proj", "down_proj")]
        missing = [f"{prefix}.{e}.{proj}.weight" for e, proj in wanted if (e, proj) not in weights]
        if missing:
            raise ValueError("checkpoint lacks expert tensors:\n  " + "\n  ".join(missing))
        gate_up = [torch.cat((weights[e, "gate_proj"], weights[e, "up_proj"])) for e in range(num_experts)]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack([weights[e, "down_proj"] for e in range(num_experts)])
    return fused


def split_experts(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The model's 3-D expert tensors as Hugging Face's per-expert ``nn.Linear`` weights (inverse of
    :func:`fuse_experts`); other tensors pass through unchanged (as views, not copies)."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e, gate_up_2ID in enumerate(tensor):
                gate_ID, up_ID = gate_up_2ID.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate_ID, up_ID
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            out.update((f"{prefix}.{e}.down_proj.weight", down_DI) for e, down_DI in enumerate(tensor))
        else:
            out[name] = tensor
    return out


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def _parse_size(size: int | str) -> int:
    """Bytes from ``5000``, ``"5GB"`` (decimal, as Hugging Face) or ``"2GiB"`` (binary)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        unit = (match.group(2).upper() or "B") if match else None
        if unit not in _UNITS:
            raise ValueError(f"max_shard_size ({size!r}) must be bytes or a size like '5GB', '500MB', '2GiB'")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size ({size!r}) must be positive")
    return value

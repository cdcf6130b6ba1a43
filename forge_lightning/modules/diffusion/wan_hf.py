"""diffusers interchange for the Wan DiT: read and write a ``WanTransformer3DModel`` directory (``config.json`` and
``diffusion_pytorch_model.safetensors``, or shards named by ``diffusion_pytorch_model.safetensors.index.json``).

Parameter names are diffusers' on both sides, so the mapping is the identity; loading is strict (a missing,
unexpected or reshaped tensor is an error that names it). Pickle ``*.bin`` weights are never read.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from forge_lightning.atomic_io import replace
from forge_lightning.manifest import FileChecks, write_directory_manifest
from forge_lightning.modules.diffusion.wan_config import WanDiTConfig
from forge_lightning.modules.diffusion.wan_model import WanDiT
from forge_lightning.modules.layers.state_dict import load_exact, write_safetensors_shards

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"


def read_config(path: str | os.PathLike[str], **overrides: object) -> WanDiTConfig:
    """The :class:`WanDiTConfig` of the diffusers directory ``path`` (``overrides``: our runtime fields)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"no {CONFIG_FILE} in {path}: expected a diffusers WanTransformer3DModel directory"
        )
    return WanDiTConfig.from_diffusers(json.loads(file.read_text()), **overrides)


def read_weights(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Every tensor of the diffusers directory ``path``, single-file or sharded.

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing.
        ValueError: only pickle weights, or a shard lacks tensors its index assigns to it.
    """
    path = Path(path)
    checks = FileChecks(path, "diffusers checkpoint")
    if (path / WEIGHTS_INDEX).is_file():
        checks.check(WEIGHTS_INDEX)
        weight_map: dict[str, str] = json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"]
        state: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise FileNotFoundError(
                    f"{WEIGHTS_INDEX} names shard {shard!r}, which is missing from {path}"
                )
            checks.check(shard)
            tensors = _read(path / shard, device)
            wanted = {name for name, file in weight_map.items() if file == shard}
            if wanted - tensors.keys():
                raise ValueError(
                    f"shard {shard!r} lacks tensors its index assigns to it: {sorted(wanted - tensors.keys())}"
                )
            state.update((name, tensors[name]) for name in wanted)
        return state
    if (path / WEIGHTS_FILE).is_file():
        checks.check(WEIGHTS_FILE)
        return _read(path / WEIGHTS_FILE, device)
    pickles = sorted(p.name for p in path.glob("*.bin"))
    if pickles:
        raise ValueError(
            f"{path} holds pickle weights ({', '.join(pickles)}), which are never loaded (unpickling can run code): "
            "re-save them once with `WanTransformer3DModel.from_pretrained(src).save_pretrained(dst)` (safetensors)"
        )
    raise FileNotFoundError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX} in {path}")


def _read(file: Path, device: str | torch.device) -> dict[str, Tensor]:
    with safe_open(file, framework="pt", device=str(device)) as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def load_pretrained(
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, **overrides: object
) -> WanDiT:
    """A :class:`WanDiT` built from a diffusers ``WanTransformer3DModel`` directory.

    The model is built on the meta device and takes the checkpoint's tensors (cast to ``dtype`` if given, else kept
    in theirs).

    Args:
        path: the directory (``config.json`` and safetensors weights).
        dtype: parameter dtype; ``None``: the checkpoint's.
        overrides: runtime fields of :class:`WanDiTConfig` (``attention_backend``).

    Raises:
        ValueError: tensors missing, unexpected or of another shape than the config says (named).
    """
    config = read_config(path, **overrides)
    weights = read_weights(path)
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
    with torch.device("meta"):
        model = WanDiT(config)
    if dtype is None and weights:
        model.to(next(iter(weights.values())).dtype)
    load_exact(model, weights, what=f"the weights in {path}", owner="Wan DiT")
    return model


def save_pretrained(
    model: WanDiT,
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a diffusers ``WanTransformer3DModel`` directory (sharded past ``max_shard_size`` bytes),
    with a manifest of hashes; written beside ``out_dir`` and renamed into place, so it appears whole or not at all.

    Args:
        model: the model.
        out_dir: destination directory.
        dtype: cast floating tensors to this dtype; ``None``: as they are.
        max_shard_size: largest shard in bytes.
        overwrite: replace a non-empty ``out_dir`` (otherwise an error).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty: choose another directory or pass overwrite=True"
        )
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in model.state_dict().items()
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        (tmp / CONFIG_FILE).write_text(
            json.dumps(model.config.to_diffusers(), indent=2, sort_keys=True) + "\n"
        )
        write_safetensors_shards(tensors, tmp, max_shard_size, WEIGHTS_FILE)
        write_directory_manifest(tmp)
        replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

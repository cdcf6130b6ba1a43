"""Features of frozen modules computed once over a dataset and read back in training without the modules: the
video-diffusion VAE latents and text embeddings, and any other frozen encoder of a family.

A cache is declared by its :class:`FrozenModule` s (a callable built from a module config, the sample fields it
takes, the outputs it writes) and written by :func:`precompute`::

    dataset ─ batches of one group ─ module 1 (fields -> outputs) ─ module 2 (fields or earlier outputs) ─ ...
      ─ stored outputs and kept fields, per sample ─ shard-00000.safetensors ... ─ cache.json (last)

    cache.json  {"format": "forge-feature-cache", "version": 1,
                 "fingerprint": {"modules": ..., "dataset": ...}, "modules": {name: {"config", "fingerprint"}},
                 "dataset": {what the dataset says identifies it}, "fields": {name: {"dtype", "shapes"}},
                 "shards": [{"file", "size", "hash"}], "samples": [{"id", "shard", "shapes", "kept"}]}

Each shard is written atomically and carries the fingerprint and its sample indices in its safetensors metadata;
a re-run keeps the shards that match its plan and fingerprint and computes the rest, so an interrupted run
continues from its last complete shard and ends with the same files as one uninterrupted run. A module's
fingerprint is its config and the content hash of every file or directory its ``init_args`` name (its weights),
computed without loading it; :class:`FeatureCacheDataset` refuses a cache whose fingerprint differs from the
configured modules' and names a shard whose size or hash differs from the manifest.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch.utils.data import DataLoader, Dataset

from forge_lightning.atomic_io import write_file
from forge_lightning.manifest import hash_file, hash_files

MANIFEST = "cache.json"
FORMAT = "forge-feature-cache"
VERSION = 1
_META_KEY = "forge-feature-cache"


class CacheError(ValueError):
    """A feature cache that cannot be used (incomplete, built with other modules or data, a damaged shard); the
    message names the file and how to rebuild it."""


@dataclass(frozen=True, kw_only=True)
class FrozenModule:
    """A frozen module of a feature cache: what to build, what it reads and what it writes.

    Args:
        name: its name in messages and the manifest.
        target: dotted path of a class or factory (``diffusers.AutoencoderKLWan.from_pretrained``).
        init_args: keyword arguments of ``target``; a string naming an existing file or directory is part of the
            fingerprint by content (the weights' identity).
        method: the method of the built object to call (default: call the object).
        inputs: argument name -> sample field (or an earlier module's output) passed to the call.
        call_args: constant keyword arguments of the call (``padding: max_length``).
        outputs: field -> where it is in the call's result: ``""`` (the result), an attribute, a key or an index,
            dotted for nested ones (``latent_dist.mean``, ``last_hidden_state``).
        store: write the outputs to the cache (``False``: only later modules use them, e.g. token ids).
        dtype: store floating outputs in this dtype (``bfloat16``; default: as computed).
    """

    name: str
    target: str
    init_args: dict[str, Any] = field(default_factory=dict)
    method: str | None = None
    inputs: dict[str, str]
    call_args: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, str]
    store: bool = True
    dtype: str | None = None

    def __post_init__(self) -> None:
        if not self.inputs or not self.outputs:
            raise ValueError(f"frozen module {self.name!r} needs inputs and outputs (field names)")
        if self.dtype is not None and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"frozen module {self.name!r}: dtype {self.dtype!r} is not a torch dtype")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FrozenModule:
        """From a YAML mapping; ``outputs`` may be a list of names (one: the result; several: by position)."""
        config = dict(config)
        outputs = config.get("outputs")
        if isinstance(outputs, list):
            config["outputs"] = (
                {n: "" for n in outputs} if len(outputs) == 1 else {n: str(i) for i, n in enumerate(outputs)}
            )
        try:
            return cls(**config)
        except TypeError as error:
            raise ValueError(f"frozen module {config.get('name', '?')!r}: {error}") from None

    def config(self) -> dict[str, Any]:
        """The declaration as plain data."""
        return asdict(self)

    def fingerprint(self) -> str:
        """SHA-256 of the config and of the content hashes of the files its ``init_args`` name."""
        files = {}
        subfolder = self.init_args.get("subfolder")
        for value in _strings(self.init_args):
            path = Path(value)
            if isinstance(subfolder, str) and (path / subfolder).is_dir():
                path = path / subfolder  # from_pretrained(repo, subfolder=...) reads only that part
            if path.is_file() or path.is_dir():
                found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
                hashes = hash_files(found)
                files[value] = {str(p.relative_to(path) if p != path else "."): hashes[p].hash for p in found}
        payload = json.dumps({"config": self.config(), "files": files}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()

    def build(self, device: str | torch.device = "cpu") -> Callable[..., Any]:
        """The callable: ``target(**init_args)`` (its ``method``), moved to ``device``, in eval mode, frozen."""
        built = _resolve(self.target, self.name)(**self.init_args)
        if isinstance(built, torch.nn.Module):
            built = built.to(device).eval().requires_grad_(False)
        return getattr(built, self.method) if self.method else built


def _resolve(target: str, name: str) -> Callable[..., Any]:
    """The object a dotted path names: a module attribute, or a class attribute (``package.Class.from_pretrained``)."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                found = getattr(found, part)
        except AttributeError:
            break
        return found
    raise ValueError(
        f"frozen module {name!r}: target {target!r} names nothing importable (package.module.Class)"
    )


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _select(result: Any, where: str, module: str) -> Any:
    for part in filter(None, where.split(".")):
        try:
            if isinstance(result, (list, tuple)) and part.isdigit():
                result = result[int(part)]
            elif isinstance(result, Mapping) and part in result:
                result = result[part]
            else:
                result = getattr(result, part)
        except (AttributeError, KeyError, IndexError):
            raise ValueError(f"frozen module {module!r}: its result has no {where!r} (at {part!r})") from None
    return result


def modules_fingerprint(modules: Sequence[FrozenModule]) -> dict[str, str]:
    """Each module's fingerprint, by name."""
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"frozen module names {names} repeat")
    return {m.name: m.fingerprint() for m in modules}


def _combined(fingerprints: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(fingerprints, sort_keys=True).encode()).hexdigest()


def dataset_fingerprint(dataset: Any) -> str:
    """SHA-256 of ``dataset.fingerprint()`` (a JSON-able description) and its sample ids."""
    description = {
        "dataset": dataset.fingerprint(),
        "ids": [dataset.sample_id(i) for i in range(len(dataset))],
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()


# ----- writing -------------------------------------------------------------------------------------------------
def plan_shards(
    groups: Sequence[Hashable], *, batch_size: int, samples_per_shard: int
) -> list[list[list[int]]]:
    """Shards of batches of sample indices: batches of one group in dataset order (the last of a group may be
    smaller), consecutive batches filling a shard up to at least ``samples_per_shard`` samples."""
    members: dict[Hashable, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    batches = [m[k : k + batch_size] for m in members.values() for k in range(0, len(m), batch_size)]
    shards: list[list[list[int]]] = [[]]
    for batch in batches:
        if sum(map(len, shards[-1])) >= samples_per_shard:
            shards.append([])
        shards[-1].append(batch)
    return [s for s in shards if s]


@dataclass
class PrecomputeSummary:
    """What :func:`precompute` did: shards written and kept from an earlier run, and the samples."""

    shards_written: int
    shards_kept: int
    samples: int


def precompute(
    dataset: Any,
    modules: Sequence[FrozenModule],
    output: str | os.PathLike,
    *,
    collate_fn: Callable[[list[Any]], dict[str, Any]],
    batch_size: int = 8,
    samples_per_shard: int = 256,
    keep: Sequence[str] = (),
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    log: Callable[[str], None] = print,
) -> PrecomputeSummary:
    """Run the frozen ``modules`` once over ``dataset`` and write their outputs to the cache at ``output``.

    Args:
        dataset: a map-style dataset of dict samples with ``sample_id(i)``, ``fingerprint()`` and, where batches
            must not mix shapes, ``group(i)``.
        modules: the frozen modules, run in order on each batch.
        output: the cache directory (created; shards of an earlier run of the same plan are kept).
        collate_fn: makes a batch of samples.
        batch_size: samples per module call.
        samples_per_shard: samples of a shard (whole batches; at least this many but the last).
        keep: sample fields stored too (JSON-able values, e.g. ``caption``).
        device: where the modules run.
        num_workers: DataLoader workers that read (decode) the samples.
        log: where progress lines go.
    """
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    fingerprints = modules_fingerprint(modules)
    fingerprint = {"modules": _combined(fingerprints), "dataset": dataset_fingerprint(dataset)}
    groups = [dataset.group(i) if hasattr(dataset, "group") else 0 for i in range(len(dataset))]
    shards = plan_shards(groups, batch_size=batch_size, samples_per_shard=samples_per_shard)
    manifest_path = output / MANIFEST
    if manifest_path.exists():
        manifest_path.unlink()  # the shards change under it; a reader must not trust it meanwhile
    built: list[Callable[..., Any]] | None = None
    records: list[dict[str, Any]] = []
    written = kept = 0
    for number, batches in enumerate(shards):
        path = output / f"shard-{number:05d}.safetensors"
        indices = [i for b in batches for i in b]
        meta = _reusable(path, fingerprint, indices)
        if meta is None:
            built = built or [m.build(device) for m in modules]
            loader = DataLoader(
                dataset, batch_sampler=batches, collate_fn=collate_fn, num_workers=num_workers
            )
            tensors, kept_values = _compute_shard(loader, batches, modules, built, keep, device)
            meta = {"fingerprint": fingerprint, "samples": indices, "kept": kept_values}
            data = save(tensors, metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
            write_file(path, lambda stream, data=data: stream.write(data))
            written += 1
        else:
            kept += 1
        records.append({"file": path.name, "meta": meta})
        log(f"feature cache {output}: shard {number + 1} of {len(shards)} ({written} written, {kept} kept)")
    for stale in sorted(output.glob("shard-*.safetensors"))[len(shards) :]:
        stale.unlink()
    _write_manifest(output, dataset, modules, fingerprints, fingerprint, records)
    return PrecomputeSummary(written, kept, len(dataset))


def _compute_shard(
    loader: Iterable[dict[str, Any]],
    batches: list[list[int]],
    modules: Sequence[FrozenModule],
    built: Sequence[Callable[..., Any]],
    keep: Sequence[str],
    device: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
    """The stored outputs of a shard's batches, one tensor per field and sample (``field/index``), and its kept
    fields."""
    tensors: dict[str, torch.Tensor] = {}
    kept: dict[str, list[Any]] = {name: [] for name in keep}
    for batch_indices, batch in zip(batches, loader):
        for name in keep:
            kept[name] += list(batch[name])
        for name, value in _run(modules, built, batch, device).items():
            for row, index in enumerate(batch_indices):
                # a copy: a row of the batch tensor would save its whole storage
                tensors[f"{name}/{index}"] = value[row].contiguous().clone()
    return tensors, kept


def _reusable(path: Path, fingerprint: dict[str, str], indices: list[int]) -> dict[str, Any] | None:
    """The metadata of an earlier run's shard when it is this plan's, under this fingerprint, else ``None``."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as shard:
            meta = json.loads((shard.metadata() or {}).get(_META_KEY, "null"))
    except (SafetensorError, OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("fingerprint") != fingerprint or meta.get("samples") != indices:
        return None
    return meta


def _run(
    modules: Sequence[FrozenModule], built: Sequence[Callable[..., Any]], batch: dict[str, Any], device: Any
) -> dict[str, torch.Tensor]:
    """The stored outputs of the modules on one batch, on the CPU."""
    fields = dict(batch)
    stored: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for module, call in zip(modules, built):
            missing = [f for f in module.inputs.values() if f not in fields]
            if missing:
                raise ValueError(
                    f"frozen module {module.name!r} reads {missing}, which neither the samples nor an earlier "
                    f"module give (there are: {sorted(fields)})"
                )
            arguments = {a: _to(fields[f], device) for a, f in module.inputs.items()}
            result = call(**arguments, **module.call_args)
            for name, where in module.outputs.items():
                value = _select(result, where, module.name)
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"frozen module {module.name!r}: output {name!r} is a {type(value).__name__}, not a tensor"
                    )
                fields[name] = value
                if module.store:
                    dtype = (
                        getattr(torch, module.dtype)
                        if module.dtype and value.is_floating_point()
                        else value.dtype
                    )
                    stored[name] = value.detach().to("cpu", dtype)
    return stored


def _to(value: Any, device: Any) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _write_manifest(
    output: Path,
    dataset: Any,
    modules: Sequence[FrozenModule],
    fingerprints: dict[str, str],
    fingerprint: dict[str, str],
    records: list[dict[str, Any]],
) -> None:
    samples: list[dict[str, Any] | None] = [None] * len(dataset)
    fields: dict[str, dict[str, Any]] = {}
    shards = []
    for number, record in enumerate(records):
        path = output / record["file"]
        file = hash_file(path)
        shards.append({"file": record["file"], "size": file.size, "hash": file.hash})
        meta = record["meta"]
        shapes: dict[int, dict[str, list[int]]] = {index: {} for index in meta["samples"]}
        with safe_open(str(path), "pt") as shard:
            for name in sorted(shard.keys()):
                field_name, _, at = name.rpartition("/")
                tensor = shard.get_slice(name)
                shape = list(tensor.get_shape())
                shapes[int(at)][field_name] = shape
                entry = fields.setdefault(field_name, {"dtype": tensor.get_dtype(), "shapes": {}})
                entry["shapes"][str(shape)] = entry["shapes"].get(str(shape), 0) + 1
        for position, index in enumerate(meta["samples"]):
            kept = {name: values[position] for name, values in meta["kept"].items()}
            samples[index] = {
                "id": dataset.sample_id(index),
                "shard": number,
                "shapes": shapes[index],
                "kept": kept,
            }
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": fingerprint,
        "modules": {m.name: {"config": m.config(), "fingerprint": fingerprints[m.name]} for m in modules},
        "dataset": dataset.fingerprint(),
        "fields": fields,
        "shards": shards,
        "samples": samples,
    }
    text = json.dumps(manifest, indent=1, sort_keys=True, default=str) + "\n"
    write_file(output / MANIFEST, lambda stream: stream.write(text.encode("utf-8")))


# ----- reading -------------------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the cache at ``path``.

    Raises:
        CacheError: no manifest (the cache is incomplete), or not one of this format.
    """
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        raise CacheError(
            f"{path} has no {MANIFEST}: the feature cache is missing or incomplete (an interrupted precompute?); "
            f"run `forge-data precompute --config CFG.yaml --output {path}` to finish it (it resumes)"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CacheError(
            f"{manifest_path} is not JSON ({error}): rebuild the cache with forge-data precompute"
        ) from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CacheError(
            f"{manifest_path}: format {manifest.get('format')!r} version {manifest.get('version')!r}, expected "
            f"{FORMAT!r} version {VERSION}"
        )
    return manifest


class FeatureCacheDataset(Dataset):
    """The samples of a feature cache: the stored outputs (tensors) and kept fields of each, by the dataset index
    they were computed from; no frozen module is built.

    Args:
        path: the cache directory.
        modules: the configured frozen modules: the cache must have been built with them (same configs and
            weight files); ``None`` skips the check.
        dataset: the configured dataset (``fingerprint()``, ``sample_id(i)``): the cache must be of it; ``None``
            skips the check.
        verify: check each shard's content hash when this process first opens it (sizes are always checked).

    Raises:
        CacheError: an incomplete cache, one of other modules or data (naming what differs and how to rebuild),
            or a shard of the wrong size.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        modules: Sequence[FrozenModule] | None = None,
        dataset: Any = None,
        verify: bool = True,
    ) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        if modules is not None:
            self._check_modules(modules)
        if dataset is not None and dataset_fingerprint(dataset) != self.manifest["fingerprint"]["dataset"]:
            raise CacheError(
                f"the feature cache {self.path} was computed from other data than the configured dataset "
                f"({self.manifest['dataset']} vs {dataset.fingerprint()}): rebuild it with "
                f"`forge-data precompute --config CFG.yaml --output {self.path}`"
            )
        self.shards = self.manifest["shards"]
        for shard in self.shards:
            file = self.path / shard["file"]
            size = file.stat().st_size if file.is_file() else None
            if size != shard["size"]:
                found = "missing" if size is None else f"{size} bytes"
                raise CacheError(
                    f"feature cache shard {file} is {found}, the manifest says {shard['size']} bytes (truncated or "
                    f"replaced): rebuild it with `forge-data precompute --config CFG.yaml --output {self.path}`"
                )
        self.samples = self.manifest["samples"]
        self.verify = verify
        self._open: dict[Any, Any] = {}

    def _check_modules(self, modules: Sequence[FrozenModule]) -> None:
        built = self.manifest["modules"]
        configured = modules_fingerprint(modules)
        if _combined(configured) == self.manifest["fingerprint"]["modules"]:
            return
        differ = [n for n in configured if n not in built or built[n]["fingerprint"] != configured[n]]
        differ += [n for n in built if n not in configured]
        raise CacheError(
            f"the feature cache {self.path} was built with other frozen modules than the configured ones "
            f"(differing: {', '.join(differ) or 'their order'}; a module's config or weight files changed): rebuild "
            f"it with `forge-data precompute --config CFG.yaml --output {self.path}` (a new --output keeps the old "
            "cache), or configure the modules it was built with"
        )

    def __len__(self) -> int:
        return len(self.samples)

    def _shard(self, number: int) -> Any:
        if self._open.get("pid") != os.getpid():  # a forked worker opens its own files
            self._open = {"pid": os.getpid()}
        if number not in self._open:
            record, file = self.shards[number], self.path / self.shards[number]["file"]
            if self.verify and hash_file(file).hash != record["hash"]:
                raise CacheError(
                    f"feature cache shard {file} does not match its hash in the manifest (corrupted): rebuild it "
                    f"with `forge-data precompute --config CFG.yaml --output {self.path}`"
                )
            try:
                self._open[number] = safe_open(str(file), "pt")
            except (SafetensorError, OSError) as error:
                raise CacheError(
                    f"feature cache shard {file} cannot be read ({error}): rebuild the cache"
                ) from None
        return self._open[number]

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.samples[index]
        shard = self._shard(sample["shard"])
        item: dict[str, Any] = {name: shard.get_tensor(f"{name}/{index}") for name in sample["shapes"]}
        item.update(sample["kept"])
        return item

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": {}}

    def group(self, index: int) -> str:
        """The shapes of sample ``index``'s tensors: a batch holds samples of one group."""
        return json.dumps(self.samples[index]["shapes"], sort_keys=True)

    def sample_id(self, index: int) -> str:
        """The name of sample ``index`` in the data it was computed from."""
        return self.samples[index]["id"]


def cache_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch of cached samples: tensors stacked, other fields as lists."""
    return {
        name: torch.stack([s[name] for s in samples])
        if isinstance(value, torch.Tensor)
        else [s[name] for s in samples]
        for name, value in samples[0].items()
    }

"""The run's resolved config in every checkpoint, and a resume refused when it no longer describes the run.

A checkpoint holds weights and state, not the meaning of its numbers: resumed with another ``rope_theta`` (same
shapes), another ``seq_length`` or another dataset, it loads and trains on, silently wrong. ``forge fit`` therefore
adds :class:`ConfigDriftCheck`, which saves the ``model``, ``data``, ``optimizer`` and ``scheduler`` sections of the
resolved config in each checkpoint and compares them when a fit resumes:

* a differing ``model`` key refuses the resume (the weights were trained for the old model); the model's config is
  compared as the module resolved it (a preset, a ``config.json`` or inline fields: the same model compares equal);
* a differing ``data``, ``optimizer`` or ``scheduler`` key refuses it unless named in
  ``--resume.allow_changes KEY ...`` (a key or a section prefix such as ``optimizer`` or ``data.init_args``);

every differing key is listed either way. The trainer (steps, devices, strategy and its layout, loggers, callbacks)
and the ``performance`` switches may change freely, as may :data:`NOT_COMPARED`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from forge_lightning.contracts import ConfiguredModule

COMPARED_SECTIONS = ("model", "data", "optimizer", "scheduler")
NOT_COMPARED = frozenset(
    {"pretrained", "batch_size", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor"}
)
"""Leaf keys that do not change what is trained: where the starting weights came from (the checkpoint replaces
them), the per-device batch (it changes with the layout; the data loader's state checks the global batch on
resume) and how many processes read the data."""
_MISSING = "<absent>"


@dataclass
class ResumeOptions:
    """``--resume.*`` options of ``forge fit``.

    Args:
        allow_changes: config keys (``data.init_args.seq_length``) or prefixes (``optimizer``) of the ``data``,
            ``optimizer`` and ``scheduler`` sections that may differ from the checkpoint's when resuming.
    """

    allow_changes: list[str] = field(default_factory=list)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists stay values."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_record(config: Mapping[str, Any]) -> dict[str, Any]:
    """The compared part of a resolved config (a plain dict, as the CLI dumps it), flattened to dotted keys, with
    plain values only (what a checkpoint loads with ``weights_only``)."""
    plain = json.loads(json.dumps({s: config.get(s) for s in COMPARED_SECTIONS}, default=str))
    return {key: value for key, value in flatten(plain).items() if key.rsplit(".", 1)[-1] not in NOT_COMPARED}


def with_model_config(record: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """``record`` with the module's resolved model config (a dataclass) under ``model.config.*`` in place of the
    ``model.init_args.config`` the command line gave, which may be a preset name or a file's path: two runs of the
    same file name can hold different models, and a preset and its ``config.json`` the same."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return dict(record)
    given = "model.init_args.config"
    kept = {k: v for k, v in record.items() if k != given and not k.startswith(given + ".")}
    resolved = json.loads(json.dumps(dataclasses.asdict(config), default=str))
    return {**kept, **flatten(resolved, "model.config")}


def _covered(key: str, allowed: Sequence[str]) -> bool:
    return any(key == a or key.startswith(a.rstrip(".") + ".") for a in allowed)


@dataclass(frozen=True)
class Drift:
    """The keys whose values differ between a checkpoint's config and this run's, sorted into what refuses the
    resume and what was allowed."""

    refused: list[tuple[str, Any, Any]]
    allowed: list[tuple[str, Any, Any]]


def compare(saved: Mapping[str, Any], current: Mapping[str, Any], allow_changes: Sequence[str]) -> Drift:
    """The differing keys of two :func:`config_record` s. Model keys are refused even when allowed."""
    refused, allowed = [], []
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key, _MISSING), current.get(key, _MISSING)
        if old == new:
            continue
        change = (key, old, new)
        if not key.startswith("model.") and _covered(key, allow_changes):
            allowed.append(change)
        else:
            refused.append(change)
    return Drift(refused, allowed)


def _lines(changes: list[tuple[str, Any, Any]]) -> str:
    return "\n".join(f"  {key}: checkpoint {old!r}, now {new!r}" for key, old, new in changes)


class ConfigDriftCheck(Callback):
    """Saves the run's ``model`` / ``data`` / ``optimizer`` / ``scheduler`` config in each checkpoint and refuses a
    resume whose config differs (see the module docstring).

    Args:
        config: the run's resolved config as a plain dict (``forge`` passes its own).
        allow_changes: keys or prefixes of the data, optimizer and scheduler sections that may differ.
    """

    def __init__(self, config: Mapping[str, Any], allow_changes: Sequence[str] = ()) -> None:
        self.record = config_record(config)
        self.allow_changes = list(allow_changes)
        unknown = [a for a in self.allow_changes if a.split(".", 1)[0] not in COMPARED_SECTIONS[1:]]
        if unknown:
            raise ValueError(
                f"--resume.allow_changes {unknown}: only keys of the data, optimizer and scheduler sections may "
                "change on resume (e.g. data.init_args.seq_length, optimizer.lr or a whole section: optimizer); "
                "a changed model starts a new run from the checkpoint's weights"
            )
        self._trainer: Trainer | None = None

    @property
    @override
    def state_key(self) -> str:
        return type(self).__name__

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if isinstance(pl_module, ConfiguredModule):
            self.record = with_model_config(self.record, pl_module.config)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"config": dict(self.record)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        where = (
            str(self._trainer.ckpt_path) if self._trainer and self._trainer.ckpt_path else "the checkpoint"
        )
        saved = state_dict.get("config")
        if not isinstance(saved, Mapping):
            rank_zero_info(
                f"{where} holds no run config (written before it was saved): its config is not compared"
            )
            return
        drift = compare(saved, self.record, self.allow_changes)
        if drift.refused:
            model = any(key.startswith("model.") for key, _, _ in drift.refused)
            others = [key for key, _, _ in drift.refused if not key.startswith("model.")]
            advice = []
            if others:
                advice.append(
                    "resume with the checkpoint's values, or accept the data / optimizer / scheduler changes with "
                    f"--resume.allow_changes {' '.join(others)}"
                )
            if model:
                advice.append(
                    "a model config cannot change on resume: start a new run from the checkpoint's weights "
                    "(forge-convert ckpt-to-hf, then model.init_args.pretrained)"
                )
            raise ValueError(
                f"resume refused: {where} was written by a run with another config:\n{_lines(drift.refused)}\n"
                + "; ".join(advice)
            )
        if drift.allowed:
            rank_zero_warn(
                f"resuming {where} with changes allowed by --resume.allow_changes:\n{_lines(drift.allowed)}"
            )

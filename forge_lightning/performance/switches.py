"""Every ``performance`` switch is applied or refused, never silently ignored.

A switch is a dotted field name of :class:`~forge_lightning.performance.PerformanceConfig` (``compile``,
``kernels.rms_norm``, ``fp8.lm_head``, ...). At setup, whoever applies switches names them: the strategy (its
transforms), the module (``TunedModule.performance_switches``: e.g. its loss kernel) or, under MegatronStrategy,
the family's twin. :func:`check_applied` then refuses every switch the run changed from its default that nobody
named, with a message that names the switch and the strategy::

    changed_switches(perf) - (applied by the strategy | applied by the module)  ->  ValueError, or nothing
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from forge_lightning.performance.config import Float8Config, PerformanceConfig


def switch_names() -> list[str]:
    """Every switch, in field order (``fp8`` itself is the switch that turns FP8 training on)."""
    names = []
    for field in dataclasses.fields(PerformanceConfig):
        default = _default(PerformanceConfig, field.name)
        if dataclasses.is_dataclass(default):
            names += [f"{field.name}.{sub.name}" for sub in dataclasses.fields(default)]
        elif field.name == "fp8":
            names += ["fp8", *(f"fp8.{sub.name}" for sub in dataclasses.fields(Float8Config))]
        else:
            names.append(field.name)
    return names


def changed_switches(perf: PerformanceConfig | None) -> list[str]:
    """The switches whose value in ``perf`` differs from the default (``fp8`` and its fields when FP8 is on: a
    field of an enabled FP8 recipe counts when it differs from :class:`Float8Config`'s default)."""
    if perf is None:
        return []
    reference = PerformanceConfig()
    changed = []
    for field in dataclasses.fields(PerformanceConfig):
        value, default = getattr(perf, field.name), getattr(reference, field.name)
        if field.name == "fp8":
            if value is not None:
                changed.append("fp8")
                changed += [f"fp8.{name}" for name in _differing(value, Float8Config())]
        elif dataclasses.is_dataclass(default):
            changed += [f"{field.name}.{name}" for name in _differing(value, default)]
        elif value != default:
            changed.append(field.name)
    return changed


def check_applied(perf: PerformanceConfig | None, applied: Iterable[str], where: str) -> None:
    """Raise ``ValueError`` naming each switch ``perf`` changed that is not in ``applied``.

    Args:
        perf: the run's performance settings (``None``: nothing to check).
        applied: the switches the strategy, the module (and a twin) apply.
        where: the strategy's name, for the message.
    """
    ignored = [name for name in changed_switches(perf) if name not in set(applied)]
    if ignored:
        listed = ", ".join(f"performance.{name}" for name in ignored)
        raise ValueError(
            f"{listed} {'is' if len(ignored) == 1 else 'are'} not applied under {where} with this module: remove "
            f"{'it' if len(ignored) == 1 else 'them'} from the performance section (docs/performance.md lists what "
            "each strategy applies)"
        )


def _differing(value: object, default: object) -> list[str]:
    return [f.name for f in dataclasses.fields(default) if getattr(value, f.name) != getattr(default, f.name)]


def _default(cls: type, name: str) -> object:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default

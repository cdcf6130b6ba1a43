"""The compatibility matrix (family x strategy x feature, Kunlun vs NVIDIA) of docs/kunlun.md, generated.

Every cell comes from the capability table (:mod:`forge_lightning.accelerators.capabilities`) and two small
declared tables: what each family uses (:data:`FAMILIES`) and what each strategy refuses whatever the platform
(:data:`STRATEGIES`, from docs/performance.md's strategy table). Regenerate the docs section with::

    python -m forge_lightning.accelerators.matrix --write docs/kunlun.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forge_lightning.accelerators.capabilities import KUNLUN, NVIDIA, DeviceCapabilities

SECTION = "## Compatibility matrix"
REGENERATE = "python -m forge_lightning.accelerators.matrix --write docs/kunlun.md"


@dataclass(frozen=True)
class Family:
    """What one model family uses.

    Args:
        name: the family as the docs name it.
        packed: how its packed rows run where FlashAttention and Triton do (``None``: no packed rows).
        moe: its experts run as grouped matmuls.
        megatron: it has a megatron-core twin (runs under ``MegatronStrategy``).
    """

    name: str
    packed: str | None
    moe: bool = False
    megatron: bool = True


@dataclass(frozen=True)
class Strategy:
    """What one strategy refuses on every platform (docs/performance.md, "which strategy applies what").

    Args:
        name: the strategy as the docs name it.
        compile: applies ``performance.compile: true``.
        fp8: applies ``performance.fp8``.
        fa4: applies ``performance.attention.kernel: fa4`` and the native packed kernels (flex / varlen / fa4).
        needs_twin: trains the family's megatron-core twin (families without one are refused).
    """

    name: str
    compile: bool = True
    fp8: bool = True
    fa4: bool = True
    needs_twin: bool = False


FAMILIES = (
    Family(name="LLM dense", packed="flex, or FA4 varlen"),
    Family(name="LLM MoE", packed="flex, or FA4 varlen", moe=True),
    Family(name="VLM", packed="flex (decoder), varlen (vision tower)"),
    Family(name="diffusion (Wan DiT)", packed="varlen (packed videos)"),
    Family(name="embodied (Pi0.5)", packed=None, megatron=False),
)
STRATEGIES = (
    Strategy(name="DDP"),
    Strategy(name="ZeRO-1"),
    Strategy(name="FSDP2"),
    Strategy(name="HSDP"),
    Strategy(name="MegatronStrategy", compile=False, fp8=False, fa4=False, needs_twin=True),
)
PLATFORMS = (("NVIDIA", NVIDIA), ("Kunlun", KUNLUN))

REFUSALS = (
    ("triton", "`performance.kernels.<name>: triton`", "`auto` or `torch`"),
    ("triton", "`performance.compile: true` (inductor generates Triton)", "`auto` or `false`"),
    ("triton", "`performance.attention.packed: flex` (FlexAttention compiles to Triton)", "`auto` or `sdpa`"),
    ("fp8", "`performance.fp8`", "`performance.fp8: null`"),
    (
        "cudnn_attention",
        "`performance.attention.sdpa` lists with `cudnn` / `flash`",
        "`auto` or `[efficient, math]`",
    ),
    (
        "flash_attention",
        "`performance.attention.kernel: fa4`, `performance.attention.packed: fa4 | varlen`",
        "`auto` or `sdpa`",
    ),
    ("fused_optimizer", "`performance.optimizer: fused`", "`auto` or `foreach`"),
)
"""(capability, the switch a platform without it refuses, what to set instead): the refusals of
``forge_lightning.performance.config.refuse_unsupported`` and ``resolve_attention_kernel``."""

Cell = Callable[[DeviceCapabilities, Family, Strategy], str]


def _triton(caps: DeviceCapabilities, family: Family, strategy: Strategy) -> str:
    return "Triton" if caps.triton else "torch reference"


def _compile(caps: DeviceCapabilities, family: Family, strategy: Strategy) -> str:
    if caps.compile and strategy.compile:
        return "on (`auto`)"
    # `true` is refused by the strategy, or by the platform where inductor has no Triton to generate.
    return "off (`true` refused)" if not strategy.compile or not caps.triton else "off (`auto`)"


def _fp8(caps: DeviceCapabilities, family: Family, strategy: Strategy) -> str:
    return "yes" if caps.fp8 and strategy.fp8 else "refused"


def _attention(caps: DeviceCapabilities, family: Family, strategy: Strategy) -> str:
    if not caps.cudnn_attention:
        return "SDPA efficient / math"
    if caps.flash_attention and strategy.fa4:
        return "FA4, cuDNN SDPA"
    return "cuDNN SDPA"


def _fused_adamw(caps: DeviceCapabilities, family: Family, strategy: Strategy) -> str:
    return "fused" if caps.fused_optimizer else "foreach"


def _packed(caps: DeviceCapabilities, family: Family, strategy: Strategy) -> str:
    if family.packed is None:
        return "none (block masks: SDPA)"
    if not strategy.fa4:
        return "SDPA document mask"
    if caps.triton and caps.flash_attention:
        return family.packed
    return "SDPA document mask"


def _muon(caps: DeviceCapabilities, family: Family, strategy: Strategy) -> str:
    # Muon is plain torch matmuls; its Newton-Schulz runs in bf16 where the platform computes in bf16.
    return "yes" if caps.bf16 else "yes (`ns_dtype: float32`)"


def _grouped_mm(caps: DeviceCapabilities, family: Family, strategy: Strategy) -> str:
    if not family.moe:
        return "-"
    if strategy.needs_twin:
        return "megatron-core's"
    return "grouped mm (sm90+)" if caps.grouped_mm else "per-expert matmuls"


FEATURES: tuple[tuple[str, Cell], ...] = (
    ("Triton kernels", _triton),
    ("compile", _compile),
    ("FP8", _fp8),
    ("cuDNN / FA4 attention", _attention),
    ("fused AdamW", _fused_adamw),
    ("packed attention", _packed),
    ("Muon", _muon),
    ("MoE experts", _grouped_mm),
)


def cell(platform: DeviceCapabilities, family: Family, strategy: Strategy, feature: str) -> str:
    """One cell of the matrix: what ``feature`` does for ``family`` under ``strategy`` on ``platform``.

    Args:
        platform: the platform's capabilities (e.g. :data:`~forge_lightning.accelerators.capabilities.KUNLUN`).
        family: one of :data:`FAMILIES`.
        strategy: one of :data:`STRATEGIES`.
        feature: a feature name of :data:`FEATURES`.

    Raises:
        ValueError: an unknown feature name.
    """
    cells = dict(FEATURES)
    if feature not in cells:
        raise ValueError(f"feature ({feature!r}) must be one of {', '.join(map(repr, cells))}")
    return cells[feature](platform, family, strategy)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _family_rows(caps: DeviceCapabilities, family: Family) -> list[list[str]]:
    """One row per group of strategies whose cells are equal for ``family`` on ``caps``' platform."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for strategy in STRATEGIES:
        if strategy.needs_twin and not family.megatron:
            continue
        cells = tuple(fn(caps, family, strategy) for _, fn in FEATURES)
        groups.setdefault(cells, []).append(strategy.name)
    return [[family.name, ", ".join(names), *cells] for cells, names in groups.items()]


def matrix_markdown() -> str:
    """The docs section: a title, a note on how it is made, and one family x strategy table per platform."""
    lines = [
        SECTION,
        "",
        "Generated from the capability table (`forge_lightning/accelerators/capabilities.py`) and the declared "
        "family and strategy needs (`forge_lightning/accelerators/matrix.py`); regenerate with "
        f"`{REGENERATE}`. A cell is what the `performance` section's `auto` picks there; `refused`: setting the "
        "switch stops the run with a message that names it.",
    ]
    header = ["family", "strategies", *(name for name, _ in FEATURES)]
    for label, caps in PLATFORMS:
        rows = [row for family in FAMILIES for row in _family_rows(caps, family)]
        lines += ["", f"### {label}", "", *_table(header, rows)]
    for label, caps in PLATFORMS:
        refused = [(switch, instead) for field, switch, instead in REFUSALS if not getattr(caps, field)]
        if refused:
            lines += ["", f"Refused on {label} (the message names the switch):", ""]
            lines += [f"- {switch}: set {instead}" for switch, instead in refused]
    for label, caps in PLATFORMS:
        notes = []
        if not caps.cuda_streams:
            notes.append(
                "DDP's `bf16` / `fp8` communication hooks reduce on the current stream (no side-stream overlap)"
            )
        if caps.peak_bf16_tflops is None:
            notes.append(
                "the throughput callback logs no MFU (no public per-device peak: pass "
                "`ThroughputMonitor(peak_tflops=...)`)"
            )
        if notes:
            lines += ["", f"Also on {label}: " + "; ".join(notes) + "."]
    missing = [family.name for family in FAMILIES if not family.megatron]
    lines += [
        "",
        f"Not in the tables: {', '.join(missing)} under MegatronStrategy (no megatron-core twin; refused on every "
        "platform). Packed rows on Kunlun run SDPA with a block-diagonal document mask: the same result as "
        "FlexAttention / varlen, with the `[B, 1, S, S]` mask in memory.",
    ]
    return "\n".join(lines) + "\n"


def section_of(text: str) -> str:
    """The ``## Compatibility matrix`` section of a markdown text, up to the next ``## `` heading and without the
    blank lines before it ("" if there is none)."""
    start = text.find(SECTION + "\n")
    if start < 0:
        return ""
    end = text.find("\n## ", start + len(SECTION))
    return text[start : len(text) if end < 0 else end].rstrip("\n") + "\n"


def write_section(path: Path) -> None:
    """Replace (or append) the ``## Compatibility matrix`` section of ``path`` with the generated one."""
    text = path.read_text() if path.exists() else ""
    old = section_of(text)
    if old:
        text = text.replace(old, matrix_markdown(), 1)
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + matrix_markdown()
    path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    """Print the matrix section, or write it into a markdown file (``--write docs/kunlun.md``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", type=Path, help="markdown file whose compatibility-matrix section to replace"
    )
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(matrix_markdown())
    else:
        write_section(args.write)


if __name__ == "__main__":
    main()

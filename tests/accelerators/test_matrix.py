"""The compatibility matrix: generated from the capability table, and committed in docs/kunlun.md as generated."""

import dataclasses
from pathlib import Path

import pytest

from forge_lightning.accelerators import matrix
from forge_lightning.accelerators.capabilities import KUNLUN, NVIDIA

DOCS = Path(__file__).resolve().parents[2] / "docs" / "kunlun.md"


def _family(name: str) -> matrix.Family:
    return next(f for f in matrix.FAMILIES if f.name == name)


def _strategy(name: str) -> matrix.Strategy:
    return next(s for s in matrix.STRATEGIES if s.name == name)


def test_docs_carry_the_generated_matrix():
    committed = matrix.section_of(DOCS.read_text())
    assert committed == matrix.matrix_markdown(), (
        f"docs/kunlun.md's '{matrix.SECTION}' is stale: regenerate it with `{matrix.REGENERATE}`"
    )


def test_cells_come_from_the_capability_table():
    llm, fsdp2 = _family("LLM dense"), _strategy("FSDP2")
    assert matrix.cell(NVIDIA, llm, fsdp2, "packed attention") == "flex, or FA4 varlen"
    assert matrix.cell(KUNLUN, llm, fsdp2, "packed attention") == "SDPA document mask"
    assert matrix.cell(KUNLUN, llm, fsdp2, "Triton kernels") == "torch reference"
    assert matrix.cell(KUNLUN, llm, fsdp2, "fused AdamW") == "foreach"
    # A platform that gains Triton and FlashAttention gets NVIDIA's packed kernels and compile in the matrix.
    upgraded = dataclasses.replace(KUNLUN, triton=True, compile=True, flash_attention=True)
    assert matrix.cell(upgraded, llm, fsdp2, "packed attention") == "flex, or FA4 varlen"
    assert matrix.cell(upgraded, llm, fsdp2, "compile") == "on (`auto`)"
    # Strategy refusals hold on every platform.
    megatron = _strategy("MegatronStrategy")
    assert matrix.cell(NVIDIA, llm, megatron, "FP8") == "refused"
    assert matrix.cell(NVIDIA, _family("LLM MoE"), fsdp2, "MoE experts") == "grouped mm (sm90+)"
    assert matrix.cell(KUNLUN, _family("LLM MoE"), fsdp2, "MoE experts") == "per-expert matmuls"
    with pytest.raises(ValueError, match=r"feature \('Triton'\) must be one of"):
        matrix.cell(NVIDIA, llm, fsdp2, "Triton")


def test_the_matrix_lists_kunluns_refusals_and_leaves_out_pi05_under_megatron():
    text = matrix.matrix_markdown()
    kunlun = text[text.index("### Kunlun") :]
    assert "`performance.fp8`: set `performance.fp8: null`" in kunlun
    assert "`performance.optimizer: fused`: set `auto` or `foreach`" in kunlun
    assert "Refused on NVIDIA" not in text
    rows = [line for line in text.splitlines() if line.startswith("| embodied")]
    assert rows and not any("MegatronStrategy" in row for row in rows)


def test_write_section_replaces_only_the_matrix(tmp_path):
    path = tmp_path / "kunlun.md"
    path.write_text(f"# Title\n\nIntro.\n\n{matrix.SECTION}\n\nold table\n\n## Launch\n\ntorchrun ...\n")
    matrix.write_section(path)
    text = path.read_text()
    assert text.startswith("# Title\n\nIntro.\n\n") and text.endswith("\n## Launch\n\ntorchrun ...\n")
    assert matrix.section_of(text) == matrix.matrix_markdown() and "old table" not in text
    matrix.write_section(path)
    assert path.read_text() == text
    fresh = tmp_path / "new.md"
    matrix.write_section(fresh)
    assert fresh.read_text() == matrix.matrix_markdown()

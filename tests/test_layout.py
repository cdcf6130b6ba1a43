"""Architecture guards: model code never imports strategies or transformers; strategies never import a model family."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "forge_lightning"


def _imports(path: Path, root: Path = PACKAGE) -> set[str]:
    """Absolute names of the modules ``path`` imports, at any depth (inside functions too): ``import a.b``,
    ``from a import b`` (``a`` and ``a.b``), relative ``from ..a import b`` resolved against the file's package, and
    ``importlib.import_module("a.b")`` / ``__import__("a.b")`` with a literal name."""
    package = path.relative_to(root.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
    return names


def _is_dynamic_import(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )


def _offenders(folder: Path, prefix: str, root: Path = PACKAGE) -> dict[str, list[str]]:
    """``{file: [imported names under prefix]}`` of the files under ``folder`` that import from ``prefix``."""
    found = {
        str(path.relative_to(root)): sorted(
            n for n in _imports(path, root) if n == prefix or n.startswith(f"{prefix}.")
        )
        for path in folder.rglob("*.py")
    }
    return {k: v for k, v in found.items() if v}


def test_modules_never_import_strategies():
    assert _offenders(PACKAGE / "modules", "forge_lightning.strategies") == {}


def test_strategies_never_import_modules():
    """Principle 8: a strategy reaches a family only through the contracts (forge_lightning.contracts)."""
    assert _offenders(PACKAGE / "strategies", "forge_lightning.modules") == {}


def test_import_walk_sees_every_form(tmp_path):
    """The walk above catches the forms a strategy could use to reach a family."""
    fake = tmp_path / "forge_lightning"
    (fake / "strategies" / "megatron").mkdir(parents=True)
    source = (
        "import forge_lightning.modules.llm\n"
        "from forge_lightning import modules\n"
        "from ...modules.llm import CausalLM\n"
        "def f():\n"
        "    from forge_lightning.modules.llm.megatron import DecoderTwin\n"
        "    importlib.import_module('forge_lightning.modules.vlm')\n"
    )
    (fake / "strategies" / "megatron" / "x.py").write_text(source)
    assert _offenders(fake / "strategies", "forge_lightning.modules", root=fake) == {
        "strategies/megatron/x.py": [
            "forge_lightning.modules",
            "forge_lightning.modules.llm",
            "forge_lightning.modules.llm.CausalLM",
            "forge_lightning.modules.llm.megatron",
            "forge_lightning.modules.llm.megatron.DecoderTwin",
            "forge_lightning.modules.vlm",
        ]
    }


def test_model_code_never_imports_transformers_or_distributed():
    for path in [*(PACKAGE / "modules").rglob("model.py"), *(PACKAGE / "modules" / "layers").rglob("*.py")]:
        bad = [n for n in _imports(path) if n.startswith(("transformers", "torch.distributed", "lightning"))]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"

"""Architecture guards: model code never imports strategies or transformers."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "forge_lightning"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_modules_never_import_strategies():
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            n for n in _imports(path) if n.startswith("forge_lightning.strategies")
        )
        for path in (PACKAGE / "modules").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_model_code_never_imports_transformers_or_distributed():
    for path in [*(PACKAGE / "modules").rglob("model.py"), *(PACKAGE / "modules" / "layers").rglob("*.py")]:
        bad = [n for n in _imports(path) if n.startswith(("transformers", "torch.distributed", "lightning"))]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"

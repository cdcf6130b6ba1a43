import importlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import pytest

# Tests never reach a hub, and loggers stay on the local disk.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
# Test helper modules (procs.py, worker_exit.py) import as top-level modules, here and in every worker process a
# test starts (they inherit PYTHONPATH).
TESTS = str(Path(__file__).resolve().parent)
sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small real corpus (standard-library sources), its BPE tokenizer and indexed dataset."""
    from forge_lightning.tools.data import main as forge_data

    root = tmp_path_factory.mktemp("tiny_corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:120]
    docs = [f.read_text(encoding="utf-8", errors="replace")[:3000] for f in files]
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    forge_data(
        ["train-tokenizer", "--input", str(jsonl), "--vocab-size", "512", "--output", str(root / "tok")]
    )
    prefix = root / "docs_text_document"
    forge_data(
        ["pretrain", "--input", str(jsonl), "--tokenizer", str(root / "tok"), "--output-prefix", str(prefix)]
    )
    return {"root": root, "jsonl": jsonl, "tokenizer": root / "tok", "prefix": prefix}


@pytest.fixture(autouse=True)
def _attention_kernel_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention kernel (``performance.attention.kernel``) is process-wide, like the SDPA backends: a test that
    applies it on a GPU must not move the next test off SDPA."""
    layers = importlib.import_module("forge_lightning.modules.layers.attention")
    monkeypatch.setattr(layers, "_kernel", layers._kernel)

"""The quick-start corpus: the Python standard library's own source code, found on every machine.

About 8 MB of real, varied text (code, docstrings, comments) that needs no download: enough to train a
tokenizer and a model of a few million parameters on a CPU (8 MB is about 2.3 M tokens with a 4096-token
byte-level BPE).
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

DEFAULT_MAX_BYTES = 8_000_000
# Third-party code, caches, and generated tables (codec charmaps, pydoc's topic dump) that are not code.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_root() -> Path:
    """Return the directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def collect_stdlib_corpus(
    *, max_bytes: int = DEFAULT_MAX_BYTES, include_tests: bool = False, root: Path | None = None
) -> list[tuple[str, str]]:
    """Collect standard-library ``*.py`` files as documents, up to ``max_bytes`` of UTF-8 text.

    Third-party packages (``site-packages``) are never included. When the library is larger than the
    budget, files are taken in the order of a fixed hash of their path, so the sample spans the whole
    library instead of its alphabetical head, and the result is the same on every run.

    Args:
        max_bytes: Budget for the summed UTF-8 size of the texts.
        include_tests: Also take the library's own test suites (``test/``, ``tests/`` directories).
        root: Library directory to read; the running interpreter's by default.

    Returns:
        ``(path, text)`` pairs sorted by path, the path relative to the library root in POSIX form.

    Raises:
        FileNotFoundError: If no Python source files are found.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = stdlib_root() if root is None else Path(root)
    skipped = _SKIPPED_DIRS if include_tests else _SKIPPED_DIRS | _TEST_DIRS
    paths = [
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if path.is_file() and skipped.isdisjoint(path.relative_to(root).parts[:-1])
    ]
    if not paths:
        raise FileNotFoundError(f"no Python source files under {root} (is the standard library installed?)")
    corpus: list[tuple[str, str]] = []
    budget = max_bytes
    for relative in sorted(paths, key=lambda p: (zlib.crc32(p.encode()), p)):
        if (root / relative).stat().st_size > budget:
            continue
        try:
            text = (root / relative).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few legacy files are not UTF-8; they are not worth a special case
        size = len(text.encode("utf-8"))
        if 0 < size <= budget:
            corpus.append((relative, text))
            budget -= size
    return sorted(corpus)

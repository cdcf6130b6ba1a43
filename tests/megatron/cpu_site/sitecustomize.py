"""Test-only: a Python process started with this folder on ``PYTHONPATH`` installs the CPU shim
(``tests/megatron/cuda_shim.py``) as soon as it imports megatron-core.

The CPU check of ``benchmarks/megatron_throughput.py`` runs megatron-core on gloo, and megatron-core hard-codes
CUDA calls. The script imports nothing from ``tests/``; instead Python's ``site`` imports this module at the
start of the script's process, of each torchrun it launches and of every rank torchrun starts::

    PYTHONPATH=tests/megatron/cpu_site python benchmarks/megatron_throughput.py --device cpu ...

(``tests/test_benchmarks.py`` runs it so, as ``forge_entry.py`` installs the shim for the CLI.) The shim goes in
right after ``megatron.core`` is imported, before any megatron code runs, as the megatron tests install it after
collecting their modules: the processes that never import megatron-core (torchrun's launcher, the ``forge-fsdp2``
ranks) keep the real ``torch.cuda`` and pay no import time. The shim is loaded from its file, so nothing of
``tests/`` lands on ``sys.path``.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path


def _install_shim() -> None:
    path = Path(__file__).resolve().parents[1] / "cuda_shim.py"
    spec = importlib.util.spec_from_file_location("cuda_shim", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.install()


class _ShimAfterMegatronCore(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` with the other finders and installs the shim once its ``__init__`` has run."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core":
            return None
        sys.meta_path.remove(self)  # once: the shim's own megatron imports go the ordinary way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module) -> None:
            exec_module(module)
            _install_shim()

        spec.loader.exec_module = exec_then_install
        return spec


sys.meta_path.insert(0, _ShimAfterMegatronCore())

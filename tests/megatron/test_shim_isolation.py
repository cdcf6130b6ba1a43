"""The CPU shim is test-only: the package never imports it, and importing the package patches nothing."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_package_sources_never_name_the_shim():
    offenders = [p for p in (REPO / "forge_lightning").rglob("*.py") if "cuda_shim" in p.read_text()]
    assert offenders == []


def test_importing_the_megatron_strategy_leaves_torch_cuda_alone():
    code = (
        "import sys, torch; original = torch.cuda.current_device\n"
        "import forge_lightning.strategies.megatron, forge_lightning.modules.llm.megatron\n"
        "assert not any('cuda_shim' in m for m in sys.modules), 'shim imported'\n"
        "assert torch.cuda.current_device is original, 'torch.cuda patched'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "kernels.py"


@pytest.fixture(scope="module")
def benchmark_module():
    spec = importlib.util.spec_from_file_location("kernels_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_dry_run_writes_one_row_per_case(benchmark_module, tmp_path, capsys):
    output = tmp_path / "kernels.json"
    rows = benchmark_module.main(["--dry-run", "--output", str(output), "--only", "rms_norm,rope,ce,fp8"])
    saved = json.loads(output.read_text())
    assert saved["results"] == rows
    assert saved["command"].endswith("--only rms_norm,rope,ce,fp8")
    kernels = [row["kernel"] for row in rows]
    assert "rms_norm+residual" in kernels and "fused_linear_ce vs unfused" in kernels
    assert sum(k.startswith("quantize_fp8") for k in kernels) == 3
    for row in rows:
        assert row["triton_ms"] > 0 and row["torch_ms"] > 0 and row["speedup_vs_torch"] > 0
        assert row["compiled_ms"] is None and row["speedup_vs_compiled"] is None  # nothing is compiled
        assert row["triton_gpu_ms"] is None  # GPU kernel time needs CUDA
        assert row["max_rel_diff"] < 1e-5  # every column ran a torch formulation
    table = capsys.readouterr().out.splitlines()  # markdown: header, separator, one line per row
    assert [cell.strip() for cell in table[0].strip("|").split("|")][:3] == ["kernel", "shape", "dtype"]
    assert len(table) == len(rows) + 2


def test_full_run_needs_a_gpu(benchmark_module):
    if benchmark_module.torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit):
        benchmark_module.main([])

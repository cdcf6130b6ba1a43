"""Loading a Hugging Face checkpoint at TP=2 (2 processes) gives transformers' logits; export is bit-exact."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import free_port
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent


def test_tp2_load_matches_transformers_and_exports_bit_exact(hf_models, tmp_path):
    path, hf = hf_models["qwen3"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, str(HERE / "bridge_worker.py"), str(path), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-4, rtol=0)
    exported, original = load_file(tmp_path / "exported.safetensors"), load_file(path / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)

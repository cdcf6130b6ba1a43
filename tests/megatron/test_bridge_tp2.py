"""Loading a Hugging Face checkpoint at TP=2 (2 processes) gives transformers' logits; export is bit-exact."""

from pathlib import Path

import torch
from conftest import torchrun
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent


def test_tp2_load_matches_transformers_and_exports_bit_exact(hf_models, tmp_path):
    path, hf = hf_models["qwen3"]
    torchrun(HERE / "bridge_worker.py", path, tmp_path)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-4, rtol=0)
    exported, original = load_file(tmp_path / "exported.safetensors"), load_file(path / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)

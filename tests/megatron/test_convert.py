"""``forge-convert hf-to-megatron`` then ``megatron-to-hf`` reproduces the Hugging Face weights bit for bit."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
_MAIN = """
import argparse, sys
sys.path.insert(0, "tests/megatron")
import cuda_shim
cuda_shim.install()  # megatron-core's checkpoint writer calls torch.cuda.synchronize()
from forge_lightning.strategies.megatron.convert import add_commands
parser = argparse.ArgumentParser(prog="forge-convert")
add_commands(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(sys.argv[1:])
args.func(args)
"""


def _convert(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _MAIN, *args], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hf_megatron_hf_round_trip_is_bit_exact(hf_models, tmp_path, arch):
    path, _ = hf_models[arch]
    _convert("hf-to-megatron", "--hf", str(path), "--output", str(tmp_path / "mcore"))
    assert (tmp_path / "mcore" / "config.json").is_file()
    _convert("megatron-to-hf", "--megatron", str(tmp_path / "mcore"), "--output", str(tmp_path / "hf"))
    exported, original = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(path / "model.safetensors"),
    )
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_commands_register_on_a_parser():
    from forge_lightning.strategies.megatron.convert import add_commands

    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    add_commands(sub)
    assert {"hf-to-megatron", "megatron-to-hf"} <= set(sub.choices)

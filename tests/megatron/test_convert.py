"""``forge-convert hf-to-megatron`` then ``megatron-to-hf`` reproduces the Hugging Face weights bit for bit, in
MegatronStrategy's checkpoint format; megatron-core is imported only by those two commands."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
_MAIN = """
import json, sys
sys.path.insert(0, "tests/megatron")
import cuda_shim
cuda_shim.install()  # megatron-core's checkpoint writer calls torch.cuda.synchronize()
from forge_lightning.tools.convert import main
for command in json.loads(sys.argv[1]):
    main(command)
"""


def _convert(*commands: list[str]) -> None:
    """Run ``forge-convert`` commands one after the other in one fresh process."""
    proc = subprocess.run(
        [sys.executable, "-c", _MAIN, json.dumps(commands)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_moe", "deepseek_v3"])
def test_hf_megatron_hf_round_trip_is_bit_exact(hf_models, tmp_path, arch):
    path, _ = hf_models[arch]
    mcore, hf = tmp_path / "mcore", tmp_path / "hf"
    _convert(
        ["hf-to-megatron", "--hf", str(path), "--output", str(mcore)],
        ["megatron-to-hf", "--megatron", str(mcore), "--output", str(hf)],
    )
    # MegatronStrategy's format: megatron-core's dist-checkpoint, Lightning's meta.pt, the HF config.
    assert all((mcore / name).is_file() for name in ("metadata.json", ".metadata", "meta.pt", "config.json"))
    meta = torch.load(mcore / "meta.pt", weights_only=True)
    assert (
        meta["megatron"]["format"] == "forge-megatron-dist-checkpoint"
        and meta["megatron"]["optimizer"] is None
    )
    exported, original = load_file(hf / "model.safetensors"), load_file(path / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_megatron_commands_import_megatron_core_only_when_run():
    code = (
        "import sys\n"
        "from forge_lightning.tools.convert import main\n"
        "for command in ('ckpt-to-hf', 'hf-to-megatron', 'megatron-to-hf'):\n"
        "    try:\n"
        "        main([command, '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert not [m for m in sys.modules if m.startswith('megatron')], 'megatron-core imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--megatron" in proc.stdout and "--hf" in proc.stdout

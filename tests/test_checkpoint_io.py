import signal
import subprocess
import sys
import time

import pytest
import torch
from lightning.pytorch import Callback

from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO, atomic_torch_save

_KILLED_WRITER = r"""
import sys, torch
from forge_lightning.strategies.checkpoint_io import atomic_torch_save
path = sys.argv[1]
big = {"state_dict": {"w": torch.zeros(64 * 1024 * 1024)}}  # 256 MB: the save takes long enough to be killed mid-write
print("saving", flush=True)
while True:
    atomic_torch_save(big, path)
"""


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"state_dict": {"step": torch.tensor(3)}}, path)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "saving"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    loaded = AtomicCheckpointIO().load_checkpoint(path)["state_dict"]
    # Either the previous checkpoint or a complete new one: never a torn file.
    assert set(loaded) in ({"step"}, {"w"})
    if "step" in loaded:
        assert int(loaded["step"]) == 3


def test_load_refuses_pickled_code_and_missing_files(tmp_path):
    bad = tmp_path / "bad.ckpt"
    torch.save({"fn": print}, bad)
    with pytest.raises(RuntimeError, match="no pickled code is ever loaded"):
        AtomicCheckpointIO().load_checkpoint(bad)
    with pytest.raises(FileNotFoundError, match="pass an existing file to --ckpt_path"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")
    torn = tmp_path / "torn.ckpt"
    atomic_torch_save({"w": torch.ones(1000)}, torn)
    torn.write_bytes(torn.read_bytes()[:100])
    with pytest.raises(RuntimeError, match="is corrupt"):
        AtomicCheckpointIO().load_checkpoint(torn)
    plain = tmp_path / "plain.pt"
    torch.save({"layer.weight": torch.ones(2)}, plain)
    with pytest.raises(ValueError, match="is a plain state dict, not a training checkpoint"):
        AtomicCheckpointIO().load_checkpoint(plain)


class _Holder(Callback):
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def test_callback_tensors_in_dcp_load_into_tensors_like_the_live_callbacks(tmp_path):
    from torch.distributed.checkpoint import save

    from forge_lightning.strategies.distributed_checkpoint import _load_callback_dtensors

    saved = {"callbacks/_Holder/avg/w": torch.arange(4.0), "callbacks/_Holder/avg/gone": torch.ones(2)}
    save(saved, checkpoint_id=tmp_path)
    stand_ins = {"w": "dcp:callbacks/_Holder/avg/w", "gone": "dcp:callbacks/_Holder/avg/gone"}
    meta = {"callbacks": {"_Holder": {"avg": stand_ins, "step": 3}}}
    # The live callback holds "w" (the template) but no longer "gone": that entry is left out, with a warning.
    with pytest.warns(UserWarning, match=r"1 sharded callback tensors .* were not loaded .*avg/gone"):
        _load_callback_dtensors(meta, tmp_path, [_Holder({"avg": {"w": torch.zeros(4)}, "step": 0})])
    assert meta["callbacks"]["_Holder"]["step"] == 3 and set(meta["callbacks"]["_Holder"]["avg"]) == {"w"}
    assert torch.equal(meta["callbacks"]["_Holder"]["avg"]["w"], torch.arange(4.0))


def test_host_copy_leaves_cpu_tensors_and_keeps_a_state_dicts_metadata():
    from torch import nn

    from forge_lightning.strategies.checkpoint_io import host_copy

    state = nn.BatchNorm1d(4).state_dict()
    tree = {"state_dict": state, "losses": [torch.tensor(1.0), 2], "pair": (torch.zeros(2), "x")}
    copied = host_copy(tree)
    assert copied["state_dict"]._metadata == state._metadata and copied["state_dict"] is not state
    assert all(copied["state_dict"][k] is v for k, v in state.items())  # CPU tensors are not copied
    assert copied["losses"][0] is tree["losses"][0] and copied["pair"][1] == "x"

"""The single-file checkpoint I/O's host copy on CUDA: values, dtypes and views kept, a storage shared by tied
weights written once, a state dict's ``_metadata`` kept, and a checkpoint that loads back equal."""

import pytest
import torch
from torch import nn

from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO, host_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_host_copy_keeps_values_views_and_shared_storages():
    embed = nn.Embedding(64, 16).cuda()
    head = nn.Linear(16, 64, bias=False).cuda()
    head.weight = embed.weight  # tied
    state = nn.ModuleDict({"embed": embed, "head": head}).state_dict()
    flat = torch.randn(100, device="cuda", dtype=torch.bfloat16)
    tree = {
        "state_dict": state,
        "view": flat[10:30].view(4, 5),
        "rows": [flat[:10], 3],
        "step": torch.tensor(7),
    }

    copied = host_copy(tree)

    assert copied["state_dict"]._metadata == state._metadata
    for key, tensor in state.items():
        assert copied["state_dict"][key].device.type == "cpu" and copied["state_dict"][key].is_pinned()
        assert torch.equal(copied["state_dict"][key], tensor.cpu()), key
    tied = copied["state_dict"]["embed.weight"], copied["state_dict"]["head.weight"]
    assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()
    assert copied["view"].dtype == torch.bfloat16 and torch.equal(
        copied["view"], flat[10:30].view(4, 5).cpu()
    )
    assert copied["rows"][0].untyped_storage().data_ptr() == copied["view"].untyped_storage().data_ptr()
    assert copied["rows"][1] == 3 and copied["step"] is tree["step"]


def test_a_checkpoint_of_cuda_tensors_loads_back_equal_and_holds_a_tied_weight_once(tmp_path):
    weight = torch.randn(1024, 1024, device="cuda")
    tied = {"state_dict": {"embed.weight": weight, "head.weight": weight}, "global_step": 3}
    untied = {"state_dict": {"embed.weight": weight, "head.weight": weight.clone()}, "global_step": 3}
    io = AtomicCheckpointIO()
    io.save_checkpoint(tied, tmp_path / "tied.ckpt")
    io.save_checkpoint(untied, tmp_path / "untied.ckpt")
    loaded = io.load_checkpoint(tmp_path / "tied.ckpt")
    assert torch.equal(loaded["state_dict"]["head.weight"], weight.cpu()) and loaded["global_step"] == 3
    tied_size, untied_size = ((tmp_path / f"{n}.ckpt").stat().st_size for n in ("tied", "untied"))
    assert untied_size - tied_size > 0.9 * weight.numel() * 4, (tied_size, untied_size)

"""Content manifests: every checkpoint file and export carries the size and hash of its files, and a changed,
truncated or missing file refuses the load, naming the file. ``forge-convert verify`` checks one."""

import json
import os

import pytest
import torch
from faults import overwrite_middle

from forge_lightning import manifest
from forge_lightning.manifest import ManifestError
from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO
from forge_lightning.tools.convert import main as forge_convert


def _checkpoint() -> dict:
    torch.manual_seed(0)
    return {"state_dict": {"w": torch.randn(64, 64), "b": torch.randn(64)}, "global_step": 3}


def test_a_directory_manifest_names_every_changed_missing_or_truncated_file(tmp_path):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    for name, size in [("a.bin", 50_000), ("b.bin", 20_000), ("sub/c.bin", 10_000)]:
        (root / name).write_bytes(os.urandom(size))
    records = manifest.write_directory_manifest(root)
    assert sorted(records) == ["a.bin", "b.bin", "sub/c.bin"]
    document = json.loads((root / manifest.MANIFEST_FILE).read_text())
    assert document["algorithm"] == "xxh3_128" and document["files"]["a.bin"]["size"] == 50_000
    assert manifest.verify(root).ok and manifest.sizes_match(root)

    overwrite_middle(root / "a.bin")
    (root / "b.bin").unlink()
    with (root / "sub" / "c.bin").open("r+b") as f:
        f.truncate(9_000)
    (root / "extra.txt").write_text("added later")
    result = manifest.verify(root)
    assert not result.ok and result.unlisted == ["extra.txt"]
    assert [p.split(":")[0] for p in sorted(result.problems)] == ["a.bin", "b.bin", "sub/c.bin"]
    assert manifest.sizes_match(root) is False
    with pytest.raises(ManifestError, match=r"does not match its manifest(.|\n)*a\.bin: content changed"):
        manifest.verify_before_load(root)


def test_the_share_of_each_rank_covers_the_files_once(tmp_path):
    for k in range(5):
        (tmp_path / f"__{k % 2}_{k}.distcp").write_bytes(os.urandom(1000 + k))
    known = {**manifest.hash_own_files(tmp_path, 0), **manifest.hash_own_files(tmp_path, 1)}
    assert sorted(known) == sorted(p.name for p in tmp_path.iterdir())
    manifest.write_directory_manifest(tmp_path, known)
    parts = [manifest.verify(tmp_path, share=lambda names, r=r: names[r::2]) for r in range(2)]
    assert sum(p.checked for p in parts) == 5 and all(p.ok for p in parts)


def test_an_unreadable_manifest_refuses_the_load(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"x")
    (tmp_path / manifest.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ManifestError, match="is unreadable"):
        manifest.verify(tmp_path)


def test_a_lightning_checkpoint_with_4_kib_overwritten_is_refused_naming_the_file(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "epoch=0-step=3.ckpt"
    io.save_checkpoint(_checkpoint(), path)
    sidecar = manifest.sidecar(path)
    assert sidecar.is_file() and sorted(p.name for p in tmp_path.iterdir()) == [path.name, sidecar.name]
    (recorded,) = manifest.read_manifest(sidecar).values()
    assert recorded == manifest.hash_file(path)  # hashed while written equals hashed from disk
    assert io.load_checkpoint(path)["global_step"] == 3

    overwrite_middle(path)
    with pytest.raises(ManifestError, match=r"epoch=0-step=3\.ckpt: content changed"):
        io.load_checkpoint(path)


def test_removing_a_checkpoint_removes_its_manifest_and_removing_a_link_keeps_them(tmp_path):
    io = AtomicCheckpointIO()
    path, link = tmp_path / "epoch=0-step=3.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(), path)
    link.symlink_to(path.name)
    assert manifest.sidecar(link) == manifest.sidecar(path)
    assert io.load_checkpoint(link)["global_step"] == 3  # verified through the link
    io.remove_checkpoint(link)
    assert path.is_file() and manifest.sidecar(path).is_file()
    io.remove_checkpoint(path)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_without_manifest_loads_with_a_warning(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save(_checkpoint(), path)
    with pytest.warns(UserWarning, match="has no old.ckpt.manifest.json.*without checking its content"):
        assert AtomicCheckpointIO().load_checkpoint(path)["global_step"] == 3


def test_a_hugging_face_export_with_a_changed_shard_is_refused(tmp_path):
    from tiny import TINY_LLM

    from forge_lightning.modules.llm import DecoderLM, LLMConfig, load_pretrained, save_pretrained
    from forge_lightning.modules.llm.megatron.bridge import SafetensorsSlices

    config = LLMConfig.load(TINY_LLM)
    out = save_pretrained(DecoderLM(config), config, tmp_path / "hf", max_shard_size=60_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and manifest.verify(out).ok
    load_pretrained(DecoderLM(config), out)

    overwrite_middle(shards[-1])
    with pytest.raises(ManifestError, match=rf"{shards[-1].name}: .*the manifest says"):
        load_pretrained(DecoderLM(config), out)
    with SafetensorsSlices(out) as slices, pytest.raises(ManifestError, match=shards[-1].name):
        for file in sorted(set(slices.weight_map.values())):
            slices._handle(file)


def test_forge_convert_verify(tmp_path, capsys):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_checkpoint(), path)
    forge_convert(["verify", str(path)])
    assert "verified" in capsys.readouterr().out

    overwrite_middle(path)
    with pytest.raises(SystemExit, match=r"last\.ckpt: content changed.*\n(.|\n)*forge-convert verify"):
        forge_convert(["verify", str(path)])
    torch.save(_checkpoint(), tmp_path / "plain.ckpt")
    with pytest.raises(SystemExit, match="has no manifest"):
        forge_convert(["verify", str(tmp_path / "plain.ckpt")])
    with pytest.raises(SystemExit, match="does not exist"):
        forge_convert(["verify", str(tmp_path / "absent")])

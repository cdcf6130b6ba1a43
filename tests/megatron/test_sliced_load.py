"""Per-rank loading of pretrained weights: each rank reads only its shards from the safetensors files, and the
megatron parameters are bit-identical to filling them from the full native model (the reference path)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import torchrun
from safetensors.torch import load_file, save_file

import forge_lightning.modules.llm.hf as hf_io
import forge_lightning.modules.llm.module as llm_module
from forge_lightning.contracts import MegatronBuild, MegatronDims, deferred_pretrained
from forge_lightning.modules.llm.hf import fuse_experts
from forge_lightning.modules.llm.megatron import bridge
from forge_lightning.modules.llm.module import CausalLM

HERE = Path(__file__).resolve().parent


def _chunk_params(module):
    """The parameters of the twin ``MegatronStrategy`` would train (one process: TP = PP = 1)."""
    build = MegatronBuild(
        dims=MegatronDims(), device=torch.device("cpu"), bf16=False, use_transformer_engine=False
    )
    (chunk,) = module.megatron_model(build).build_chunks()
    return dict(chunk.named_parameters())


def _assert_identical(got, expected):
    assert sorted(got) == sorted(expected)
    for name, param in expected.items():
        assert got[name].dtype == param.dtype and torch.equal(got[name], param), name


def _refuse_full_load(monkeypatch):
    """Any full read of the checkpoint or the full-model path fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the full model was loaded")

    monkeypatch.setattr(hf_io, "load_hf_state_dict", refuse)
    monkeypatch.setattr(hf_io, "load_pretrained", refuse)
    monkeypatch.setattr(llm_module, "load_pretrained", refuse)
    monkeypatch.setattr(bridge, "load_state", refuse)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "qwen3_moe", "qwen2_moe"])
def test_deferred_module_reads_slices_bit_identical_to_full_model(
    megatron_world, hf_models, arch, monkeypatch
):
    path = str(hf_models[arch][0])
    expected = _chunk_params(CausalLM(config=path, pretrained=path))  # the full native model's weights
    _refuse_full_load(monkeypatch)
    with deferred_pretrained():
        module = CausalLM(config=path, pretrained=path)
    assert all(p.is_meta for p in module.model.parameters())  # the native model is never materialised
    _assert_identical(_chunk_params(module), expected)


def _rewrite(src: Path, dst: Path, tensors: dict, shards: int) -> Path:
    """``src``'s config with ``tensors`` written as ``shards`` files and an index."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (dst / hf_io.SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_sharded_and_fused_expert_checkpoints(megatron_world, hf_models, arch, tmp_path, monkeypatch):
    """A sharded checkpoint (index + 3 files), with MoE experts stored per expert and as fused 3-D tensors."""
    path = hf_models[arch][0]
    expected = _chunk_params(CausalLM(config=str(path), pretrained=str(path)))
    tensors = load_file(path / "model.safetensors")
    layouts = {"per_expert": tensors, "fused": fuse_experts(tensors)} if "moe" in arch else {"plain": tensors}
    _refuse_full_load(monkeypatch)
    for name, state in layouts.items():
        sharded = _rewrite(path, tmp_path / name, state, shards=3)
        with deferred_pretrained():
            module = CausalLM(config=str(sharded), pretrained=str(sharded))
        _assert_identical(_chunk_params(module), expected)


def test_missing_and_misshaped_tensors_are_named(megatron_world, hf_models, tmp_path):
    path = hf_models["qwen3"][0]
    tensors = load_file(path / "model.safetensors")
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.o_proj.weight"]
    wrong = dict(tensors)
    wrong["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 48)
    for name, state, error, words in [
        ("missing", missing, KeyError, ["no tensor 'model.layers.1.self_attn.o_proj.weight'", "(64, 128)"]),
        (
            "wrong",
            wrong,
            ValueError,
            ["model.layers.0.mlp.down_proj.weight", "(64, 48)", "expected (64, 96)"],
        ),
    ]:
        broken = _rewrite(path, tmp_path / name, state, shards=2)
        with deferred_pretrained():
            module = CausalLM(config=str(broken), pretrained=str(broken))
        with pytest.raises(error) as info:
            _chunk_params(module)
        message = str(info.value)
        assert all(w in message for w in words), message
        assert "model.safetensors.index.json" in message or ".safetensors" in message, message
    lost = _rewrite(path, tmp_path / "lost_file", tensors, shards=2)
    (lost / "model-00002-of-00002.safetensors").unlink()
    with deferred_pretrained():
        module = CausalLM(config=str(lost), pretrained=str(lost))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        _chunk_params(module)


def test_meta_module_without_pretrained_is_refused(megatron_world, hf_models):
    path = str(hf_models["qwen3"][0])
    with deferred_pretrained():
        module = CausalLM(config=path, pretrained=path)
    module.pretrained = None
    with pytest.raises(ValueError, match="meta device"):
        _chunk_params(module)


def test_two_processes_tp_pp_ep_read_only_their_shards(hf_models, tmp_path):
    cases = {
        "qwen3": (2, 1, 1),  # dense, tied embeddings
        "llama": (1, 2, 1),  # pipeline stages: each reads its own layers
        "qwen2_moe": (2, 1, 1),  # experts and the gated shared expert split over TP
        "qwen3_moe": (1, 1, 2),  # experts split over EP
    }
    args = [f"{a}:{hf_models[a][0]}:{tp}:{pp}:{ep}" for a, (tp, pp, ep) in cases.items()]
    out = tmp_path / "results.json"
    torchrun(HERE / "sliced_load_worker.py", out, *args)
    for rank, results in enumerate(json.loads(out.read_text())):
        assert len(results) == len(cases)
        for case, r in results.items():
            assert r["differ"] == [], (rank, case, r["differ"])
            # Each rank reads exactly its parameters' elements: well under the full model.
            assert r["read"] == r["rank_params"] < 0.75 * r["total"], (rank, case, r)


def test_cli_defers_pretrained_for_megatron_only():
    from jsonargparse import Namespace

    from forge_lightning.cli import strategy_traits

    megatron = Namespace(
        class_path="forge_lightning.strategies.megatron.MegatronStrategy", init_args=Namespace()
    )
    assert (
        strategy_traits("megatron").reads_pretrained_shards
        and strategy_traits(megatron).reads_pretrained_shards
    )
    assert (
        not strategy_traits("fsdp2").reads_pretrained_shards
        and not strategy_traits(None).reads_pretrained_shards
    )

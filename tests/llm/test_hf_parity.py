"""Numerical parity with transformers and safetensors interchange, on tiny random models (fp32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from llm_parity import assert_matches_transformers, load_forge, randomize_weights
from safetensors.torch import load_file, save_file

from forge_lightning.modules.layers import state_dict as state_dict_io
from forge_lightning.modules.llm import (
    DecoderLM,
    LLMConfig,
    load_hf_state_dict,
    load_pretrained,
    save_pretrained,
)

_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 16 and this short original context, the three llama3 frequency bands are all populated.
    "original_max_position_embeddings": 64,
}

VARIANTS = {
    "llama": (transformers.LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-bias-linear-rope": (
        transformers.LlamaConfig,
        dict(
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            rope_theta=10000.0,
            rope_scaling={"type": "linear", "factor": 4.0},  # classic config style
        ),
    ),
    "llama3-rope-tied": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE),
    ),
    "qwen2": (transformers.Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "mistral": (
        transformers.MistralConfig,
        dict(
            num_key_value_heads=2,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    "mqa": (transformers.LlamaConfig, dict(num_key_value_heads=1)),
}

# config.json fields that define the architecture; a round trip must keep each one the source file has.
ARCH_FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
)


def build_hf(variant: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A transformers model with random weights, norms and biases (so every parameter matters)."""
    config_cls, overrides = VARIANTS[variant]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**_BASE, **overrides), attn_implementation="eager"
    )
    randomize_weights(model, 0.08)
    return model


@pytest.fixture(params=list(VARIANTS))
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def hf_checkpoint(variant: str, tmp_path: Path) -> tuple[transformers.PreTrainedModel, Path]:
    model = build_hf(variant)
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def test_logits_loss_and_gradients_match_transformers(hf_checkpoint: tuple) -> None:
    hf_model, path = hf_checkpoint
    model = load_forge(path)
    input_ids = torch.randint(0, _BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))

    assert model(input_ids).shape == (2, 24, _BASE["vocab_size"])
    assert_matches_transformers(model, hf_model, input_ids)


def test_round_trip_keeps_every_tensor_and_the_architecture(hf_checkpoint: tuple, tmp_path: Path) -> None:
    hf_model, path = hf_checkpoint
    model = load_forge(path)
    out = save_pretrained(model, model.config, tmp_path / "export")

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    expected, actual = hf_model.state_dict(), reloaded.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    assert load_file(path / "model.safetensors").keys() == load_file(out / "model.safetensors").keys()

    source, exported = (
        json.loads((path / "config.json").read_text()),
        json.loads((out / "config.json").read_text()),
    )
    source["rope_parameters"].pop(
        "type", None
    )  # transformers keeps the classic alias of rope_type next to it
    for field in ARCH_FIELDS:
        if field in source:
            assert exported[field] == source[field], field


def test_sharded_transformers_checkpoint_loads(tmp_path: Path) -> None:
    hf_model = build_hf("llama")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1

    model = load_forge(tmp_path)
    input_ids = torch.randint(0, _BASE["vocab_size"], (1, 16))
    assert (model(input_ids) - hf_model(input_ids).logits).abs().max().item() <= 1e-4


def test_sharded_export_loads_in_transformers(tmp_path: Path) -> None:
    hf_model = build_hf("qwen3")
    hf_model.save_pretrained(tmp_path / "hf")
    model = load_forge(tmp_path / "hf")
    out = save_pretrained(model, model.config, tmp_path / "export", max_shard_size="40KB")

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / shard).is_file() for shard in shards)
    assert not (out / "model.safetensors").exists()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_export_dtype_is_applied_and_recorded(tmp_path: Path) -> None:
    model = DecoderLM(LLMConfig.from_preset("debug"))
    out = save_pretrained(model, model.config, tmp_path / "bf16", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"


def test_packed_documents_match_separate_transformers_forwards() -> None:
    hf_model = build_hf("qwen3")
    model = DecoderLM(LLMConfig.from_hf(hf_model.config.to_dict()))
    model.load_state_dict(hf_model.state_dict(), strict=False)
    lengths = [10, 14]
    docs = [torch.randint(0, _BASE["vocab_size"], (1, n)) for n in lengths]
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    same_doc = doc_ids[:, None] == doc_ids[None, :]  # [S, S], True inside a document
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]

    packed = model(torch.cat(docs, dim=1), position_ids, attention_mask=same_doc[None, None])
    for doc, chunk in zip(docs, packed.split(lengths, dim=1)):
        assert (chunk - hf_model(doc).logits).abs().max().item() <= 1e-4

    additive = torch.zeros(same_doc.shape).masked_fill(~same_doc, float("-inf"))
    assert torch.allclose(
        model(torch.cat(docs, dim=1), position_ids, attention_mask=additive), packed, atol=1e-6
    )


# ------------------------------------------------------------------------------------------- errors


def test_load_errors_are_explicit(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_state_dict(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        load_hf_state_dict(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"pickle weights \(pytorch_model\.bin\).*safe_serialization=True"):
        load_hf_state_dict(tmp_path)


def test_index_naming_a_missing_shard_is_reported(tmp_path: Path) -> None:
    build_hf("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"][
        "model.norm.weight"
    ]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"names shard '{shard}', which is missing"):
        load_hf_state_dict(tmp_path)


def test_missing_unexpected_and_incompatible_are_named(tmp_path: Path) -> None:
    build_hf("llama").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.mlp.extra.weight"] = state.pop("model.norm.weight")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = DecoderLM(LLMConfig.load(tmp_path))
    with pytest.raises(
        ValueError, match=r"missing: model\.norm\.weight\n  unexpected: model\.layers\.0\.mlp\.extra"
    ):
        load_pretrained(model, tmp_path)

    # A model built on the meta device is refused alike, before any tensor is assigned.
    with torch.device("meta"):
        meta_model = DecoderLM(LLMConfig.load(tmp_path))
    with pytest.raises(ValueError, match=r"missing: model\.norm\.weight"):
        load_pretrained(meta_model, tmp_path)
    assert all(p.is_meta for p in meta_model.parameters())

    other = DecoderLM(LLMConfig.from_preset("debug", hidden_size=32, num_kv_heads=4))
    with pytest.raises(
        ValueError, match=r"hidden_size: checkpoint 64, model 32\n  num_kv_heads: checkpoint 2, model 4"
    ):
        load_pretrained(other, tmp_path)


def test_export_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = DecoderLM(LLMConfig.from_preset("debug"))
    calls = []

    def failing_save_file(*args: object, **kwargs: object) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(*args, **kwargs)

    monkeypatch.setattr(state_dict_io, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, model.config, tmp_path / "export", max_shard_size="100KB")
    assert list(tmp_path.iterdir()) == []  # neither the export nor its temporary directory remains


def test_existing_export_is_only_replaced_on_request(tmp_path: Path) -> None:
    model = DecoderLM(LLMConfig.from_preset("debug", bos_token_id=1, eos_token_id=[2, 3]))
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_pretrained(model, model.config, out)
    save_pretrained(model, model.config, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "forge-manifest.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2, 3]}


@pytest.mark.parametrize("variant", ["llama-bias-linear-rope", "llama3-rope-tied"])
def test_pretrained_modules_are_built_on_the_meta_device(variant: str, tmp_path: Path) -> None:
    """``CausalLM(pretrained=...)`` builds on the meta device and takes the checkpoint's tensors: its parameters,
    rebuilt rotary frequencies, tying and logits equal those of a CPU-built model filled by copying."""
    from forge_lightning.modules.llm import CausalLM

    build_hf(variant).save_pretrained(tmp_path)
    module = CausalLM.from_pretrained(tmp_path)
    copied = load_pretrained(DecoderLM(LLMConfig.load(tmp_path)), tmp_path)
    for name, tensor in [*copied.state_dict().items(), *copied.named_buffers()]:
        got = dict(module.model.named_buffers()).get(name, module.model.state_dict().get(name))
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    assert (
        module.model.lm_head.weight is module.model.model.embed_tokens.weight
    ) == copied.config.tie_word_embeddings
    ids = torch.randint(0, _BASE["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(module.model(ids), copied(ids))

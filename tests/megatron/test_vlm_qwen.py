"""Qwen2.5-VL and Qwen3-VL under MegatronStrategy train to the one-process losses and weights.

One 2-process launch (vlm_qwen_worker.py) runs the four cases; the reference is the same ``VisionLanguageModule``
under Lightning's default strategy on this process, with the same batches (fp32, AdamW lr 1e-3, 3 steps of 3
micro-batches of 3 samples: an image and a video, text only with right padding, two images; validation on 2 batches
after every step):

    qwen2_5_vl_tp2    chunked M-RoPE [3, B, S] positions, the LLM at TP 2, the ViT at TP 1 data-parallel over the TP
                      group (each rank encodes its samples' images and videos, by their grids), its blocks recomputed
    qwen2_5_vl_pp2    the LLM at PP 2: both stages rotate by the batch's positions; the encoder side decoupled on the
                      first stage
    qwen3_vl_tp2_sp   interleaved M-RoPE, DeepStack features added after the LLM's first two layers, TP 2 with
                      sequence parallelism (each TP rank adds its share of the sequence)
    qwen3_vl_pp2      the same at PP 2 (the DeepStack layers on the first stage)
"""

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import torchrun
from vlm_qwen_worker import CASES, MODELS, build_module, collate, data, fit_kwargs, samples, write_configs

from forge_lightning.contracts import MegatronBuild, MegatronDims
from forge_lightning.modules.vlm import VisionLanguageModule
from forge_lightning.modules.vlm.megatron import check_supported, composition

HERE = Path(__file__).resolve().parent
LOSS_TOL = 1e-5  # |train/loss or val/loss - one process| per step, as test_vlm.py (measured <= 9.5e-7)
# |weights after 3 steps - one process|: Adam amplifies fp32 rounding where a gradient entry is near zero (as
# test_vlm.py; measured <= 6.3e-5, Qwen3-VL's first LLM gate_proj)
PARAM_TOL = 1e-4


def _losses(root: Path, name: str, key: str = "train/loss") -> dict[int, float]:
    rows = csv.DictReader((root / name / "version_0" / "metrics.csv").open())
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm_qwen")
    write_configs(root)
    return root


@pytest.fixture(scope="module")
def runs(configs):
    torchrun(HERE / "vlm_qwen_worker.py", configs, *CASES)
    return configs


_REFERENCES: dict[str, tuple] = {}


def _reference(root: Path, model: str) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """train/loss, val/loss and the state dict of the one-process run of ``model`` (cached)."""
    if model not in _REFERENCES:
        module = build_module(root, model)
        name = f"{model}_reference"
        pl.Trainer(devices=1, **fit_kwargs(root, name)).fit(
            module, train_dataloaders=data(model), val_dataloaders=data(model)
        )
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        _REFERENCES[model] = _losses(root, name), _losses(root, name, "val/loss"), state
    return _REFERENCES[model]


@pytest.mark.parametrize("name", list(CASES))
def test_qwen_vl_matches_one_process(runs, name):
    model = CASES[name]["model"]
    expected, expected_val, expected_state = _reference(runs, model)
    losses, val = _losses(runs, name), _losses(runs, name, "val/loss")
    assert sorted(losses) == sorted(val) == sorted(expected) == sorted(expected_val) == [0, 1, 2]
    deltas = {s: abs(losses[s] - expected[s]) for s in losses}
    assert max(deltas.values()) <= LOSS_TOL, deltas
    val_deltas = {s: abs(val[s] - expected_val[s]) for s in val}
    assert max(val_deltas.values()) <= LOSS_TOL, val_deltas
    initial = build_module(runs, model).state_dict()
    for rank in (0, 1):
        state = torch.load(runs / f"{name}_rank{rank}.pt")["state"]
        assert list(state) == list(expected_state)
        for key, value in state.items():
            assert (value - expected_state[key]).abs().max() <= PARAM_TOL, key
        trained = {k for k, v in state.items() if not torch.equal(v, initial[k])}
        assert trained == set(state), sorted(set(state) - trained)  # every weight, the ViT's and mergers' too


# ----------------------------------------------------------------------------------------------- the composition


@pytest.mark.parametrize("model", list(MODELS))
def test_composition_gives_the_native_decoder_inputs(configs, model):
    """encode + merge equal the native model's input embeddings, the layer residuals its DeepStack features and
    position_ids its positions; encoding the samples in parts (each with its own images and videos) gives the same."""
    vlm = build_module(configs, model).model
    plan = composition(vlm)
    batch = collate(samples(model, 6))
    seen = _native_layer_inputs(vlm, batch)
    tokens_BSH = vlm.llm.model.embed_tokens(batch["input_ids"])
    encoded = plan.encode(batch)
    merged_BSH, labels = plan.merge(tokens_BSH, encoded, batch)
    assert torch.equal(labels, batch["labels"])
    torch.testing.assert_close(merged_BSH, seen["inputs"], rtol=0, atol=1e-6)
    native_positions = vlm.position_ids(
        batch["input_ids"], batch["attention_mask"], batch["image_grid_thw"], batch["video_grid_thw"]
    )[0]
    assert torch.equal(plan.position_ids(batch), native_positions)
    assert plan.position_ids(batch).shape == (3, 6, batch["input_ids"].shape[1])
    if model == "qwen3_vl":
        residuals = plan.layer_residuals(encoded, batch)
        assert len(residuals) == 2 and all(r.abs().sum() > 0 for r in residuals)
        # the native layer i's output + its residual = layer i+1's input
        for i, residual in enumerate(residuals):
            torch.testing.assert_close(
                seen["outputs"][i] + residual, seen["layer_inputs"][i + 1], rtol=0, atol=0
            )
    else:
        assert plan.layer_residuals is None and encoded.ndim == 3
    # the second part holds no video, the third pads with a repeat
    rows = [torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([3, 4, 5, 5])]
    parts = torch.cat([plan.encode(plan.select(batch, r)) for r in rows])[:6]
    torch.testing.assert_close(parts, encoded, rtol=0, atol=1e-6)
    picked = plan.select(batch, torch.tensor([2, 0]))  # two images; an image and a video
    assert picked["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4], [1, 4, 6]]
    assert picked["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert picked["pixel_values"].shape[0] == 16 + 24 + 24 and picked["pixel_values_videos"].shape[0] == 32
    assert plan.select(batch, torch.tensor([1]))["pixel_values"].shape[0] == 0  # text only


def _native_layer_inputs(vlm, batch) -> dict[str, list[torch.Tensor]]:
    """The native model's input of its first decoder layer, and each layer's input and output."""
    seen = {"layer_inputs": [], "outputs": []}
    hooks = []
    for layer in vlm.llm.model.layers:
        hooks.append(layer.register_forward_pre_hook(lambda m, args: seen["layer_inputs"].append(args[0])))
        hooks.append(layer.register_forward_hook(lambda m, args, out: seen["outputs"].append(out)))
    inputs = {
        k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    }
    try:
        vlm.hidden_states(batch["input_ids"], batch["attention_mask"], **inputs)
    finally:
        for hook in hooks:
            hook.remove()
    seen["inputs"] = seen["layer_inputs"][0]
    return seen


def test_select_names_a_sample_that_ends_inside_an_image(configs):
    vlm = build_module(configs, "qwen2_5_vl").model
    batch = collate(samples("qwen2_5_vl", 3))
    ids = batch["input_ids"].clone()
    ids[0, (ids[0] == 250).nonzero()[0]] = 5  # one placeholder of sample 0's image removed
    with pytest.raises(
        ValueError,
        match=r"sample 0 of the micro-batch does not hold whole images: the samples hold \[5, 0, 10\]",
    ):
        composition(vlm).select({**batch, "input_ids": ids}, torch.tensor([1]))


# ----------------------------------------------------------------------------------------------- refusals


def _build(**kwargs) -> MegatronBuild:
    recompute = kwargs.pop("recompute", "none")
    return MegatronBuild(
        dims=MegatronDims(**kwargs), device=torch.device("cpu"), bf16=False, recompute=recompute
    )


def test_deepstack_beyond_the_first_pipeline_stage_is_refused(configs):
    module = VisionLanguageModule(str(configs / "qwen3_vl"))
    # 2 layers per stage: the first holds both DeepStack layers
    check_supported(module, _build(pipeline_model_parallel_size=2))
    with pytest.raises(NotImplementedError, match=r"the first pipeline chunk holds 1 \(num_layers 4"):
        check_supported(module, _build(pipeline_model_parallel_size=4))
    with pytest.raises(NotImplementedError, match="megatron's recomputed layers would not add the DeepStack"):
        check_supported(module, _build(recompute="full"))


# ----------------------------------------------------------------------------------------------- the twin's RoPE


@pytest.mark.parametrize("interleaved", [False, True], ids=["chunked", "interleaved"])
def test_twin_rotary_table_is_the_native_multimodal_rope(interleaved):
    """The twin's rotary table of ``[3, b, s]`` positions turns each frequency by the native model's angle (both
    halves, megatron's layout); megatron-core's own M-RoPE table equals it in the chunked layout only."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding as MegatronMRoPE,
    )

    from forge_lightning.modules.layers.rope import MultimodalRotaryEmbedding
    from forge_lightning.modules.llm.megatron.gpt import forge_gpt_model_class

    section = [6, 5, 5] if interleaved else [2, 3, 3]
    half = sum(section)
    native = MultimodalRotaryEmbedding(2 * half, section, 10000.0, interleaved=interleaved)
    positions = torch.randint(0, 60, (3, 2, 9), generator=torch.Generator().manual_seed(0))
    twin = SimpleNamespace(
        mrope_axes=native.axis_of_freq, rotary_pos_emb=SimpleNamespace(inv_freq=native.inv_freq)
    )
    emb_SB1D = forge_gpt_model_class()._multimodal_emb(twin, positions)
    assert emb_SB1D.shape == (9, 2, 1, 2 * half)
    cos_BSF, sin_BSF = native(positions)
    for part in (emb_SB1D[..., :half], emb_SB1D[..., half:]):
        assert torch.equal(part[:, :, 0].cos().transpose(0, 1), cos_BSF)
        assert torch.equal(part[:, :, 0].sin().transpose(0, 1), sin_BSF)
    megatron = MegatronMRoPE(kv_channels=2 * half, rotary_percent=1.0)(positions, section)
    assert torch.allclose(megatron, emb_SB1D, rtol=0, atol=1e-5) == (not interleaved)


@pytest.mark.parametrize("multimodal", [True, False], ids=["positions_3BS", "positions_BS"])
def test_twin_matches_the_native_decoder(megatron_world, configs, multimodal):
    """One process: Qwen3-VL's LLM as the twin gives the native logits at the batch's ``[3, B, S]`` positions with
    DeepStack-like layer residuals, and at ``[B, S]`` positions (plain RoPE, as a text-only M-RoPE model)."""
    from forge_lightning.modules.llm.hf import split_experts
    from forge_lightning.modules.llm.megatron import build_gpt_model, gpt_decoder_spec, transformer_config
    from forge_lightning.modules.llm.megatron.bridge import load_state

    vlm = build_module(configs, "qwen3_vl").model
    llm, config = vlm.llm, vlm.llm.config
    tf = transformer_config(config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    twin = build_gpt_model(config, tf, gpt_decoder_spec(tf), pre_process=True, post_process=True).eval()
    load_state([twin], config, split_experts(llm.state_dict()).__getitem__)
    batch = collate(samples("qwen3_vl", 3))
    ids = batch["input_ids"]
    if multimodal:
        positions = composition(vlm).position_ids(batch)
        g = torch.Generator().manual_seed(2)
        residuals = [torch.randn(*ids.shape, config.hidden_size, generator=g) for _ in range(2)]
    else:
        positions, residuals = torch.arange(ids.shape[1]).expand_as(ids) + 3, []
    with torch.no_grad():
        expected = llm.lm_head(llm.hidden_states(ids, positions, layer_residuals=residuals or None))
        logits = twin(ids, positions, None, layer_residuals=residuals)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)

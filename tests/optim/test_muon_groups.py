"""Which parameters Muon takes on our tiny models (LLM dense / MoE / MLA, a LLaVA-style VLM, the Wan DiT, Pi0.5),
``optimizer.muon`` patterns and their errors, per-component learning rates, the start-up summary, the YAML
section through the ``forge`` parser, and a few CPU training steps of the MoE debug LLM with ``optimizer: muon``."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from tiny import TINY_LLM
from torch.utils.data import DataLoader

from forge_lightning.contracts import Component
from forge_lightning.modules.diffusion.wan_config import preset as wan_preset
from forge_lightning.modules.diffusion.wan_model import WanDiT
from forge_lightning.modules.embodied.config import Pi05Config
from forge_lightning.modules.embodied.model import Pi05
from forge_lightning.modules.llm import CausalLM
from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.model import DecoderLM
from forge_lightning.modules.vlm.config import VLMConfig
from forge_lightning.modules.vlm.model import VisionLanguageModel
from forge_lightning.modules.vlm.qwen2_5_vit import Qwen25VisionConfig, Qwen25VisionTransformer
from forge_lightning.modules.vlm.siglip import SiglipVisionConfig
from forge_lightning.optim import (
    Muon,
    MuonOptions,
    OptimizerConfig,
    SplitRows,
    choose_params,
    component_param_groups,
    muon_groups,
    muon_summary,
    optimizer_for_groups,
)

REPO = Path(__file__).resolve().parents[2]


def _choices(model: torch.nn.Module, **options) -> dict[str, object]:
    return {c.name: c for c in choose_params([("", model)], MuonOptions(**options))}


def _muon_names(choices: dict) -> set[str]:
    return {n for n, c in choices.items() if c.use_muon}


def _layer0(names: set[str]) -> set[str]:
    """The names of layer / block 0 and of the parameters outside the repeated layers."""
    return {n for n in names if not re.search(r"\.(layers|blocks)\.[1-9]", n)}


def test_llm_hidden_matrices_go_to_muon_embeddings_head_and_norms_to_adamw():
    torch.manual_seed(0)
    choices = _choices(DecoderLM(LLMConfig.from_preset("debug")))
    projections = {f"self_attn.{p}_proj" for p in "qkvo"} | {f"mlp.{p}_proj" for p in ("gate", "up", "down")}
    assert _layer0(_muon_names(choices)) == {f"model.layers.0.{p}.weight" for p in projections}
    assert all(c.kind == "matrix" and c.parts is None for c in choices.values() if c.use_muon)
    adamw = {n: (c.kind, c.decayed) for n, c in choices.items() if not c.use_muon}
    assert adamw["model.embed_tokens.weight"] == ("embedding", False)
    assert adamw["lm_head.weight"] == ("by name", True)  # a matrix: AdamW decays it
    assert adamw["model.norm.weight"] == ("1-D", False)
    assert len(adamw) == 2 + 1 + 2 * 2  # embedding, head, final norm, two norms per layer


def test_tied_head_is_counted_once_and_stays_with_the_embedding():
    choices = _choices(DecoderLM(LLMConfig.from_hf(TINY_LLM)))
    assert "lm_head.weight" not in choices
    assert choices["model.embed_tokens.weight"].kind == "embedding"
    params = [c.param for c in choices.values()]
    assert len({id(p) for p in params}) == len(params)


def test_moe_expert_stacks_go_to_muon_with_gate_up_split_in_halves():
    torch.manual_seed(0)
    model = DecoderLM(LLMConfig.from_preset("debug-moe"))
    choices = _choices(model)
    gate_up = choices["model.layers.0.mlp.experts.gate_up_proj"]
    down = choices["model.layers.0.mlp.experts.down_proj"]
    intermediate = model.config.moe.intermediate_size
    assert (gate_up.use_muon, gate_up.kind, gate_up.parts) == (True, "stack", (intermediate, intermediate))
    assert (down.use_muon, down.kind, down.parts) == (True, "stack", None)  # one part: nothing to split
    assert choices["model.layers.0.mlp.gate.weight"].kind == "matrix"  # the router is a hidden matrix
    unsplit = _choices(model, split_fused=False)
    assert unsplit["model.layers.0.mlp.experts.gate_up_proj"].parts is None
    assert unsplit["model.layers.0.mlp.experts.gate_up_proj"].use_muon


def test_mla_latent_and_rotary_key_rows_are_split():
    config = LLMConfig.from_preset("debug-deepseek")
    choices = _choices(DecoderLM(config))
    fused = choices["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert fused.use_muon and fused.parts == (config.mla.kv_lora_rank, config.mla.qk_rope_head_dim)
    assert choices["model.layers.1.mlp.shared_experts.gate_proj.weight"].parts is None


def test_qwen_vit_fused_qkv_is_split_in_thirds_and_its_patch_convolution_stays_on_adamw():
    config = Qwen25VisionConfig.from_preset("debug")
    choices = _choices(Qwen25VisionTransformer(config))
    width = config.hidden_size
    assert choices["blocks.0.attn.qkv.weight"].parts == (width, width, width)
    assert choices["blocks.0.attn.proj.weight"].parts is None
    assert choices["patch_embed.proj.weight"].kind == "N-D"


def _vlm() -> VisionLanguageModel:
    vision = {"type": "siglip", **dataclasses.asdict(SiglipVisionConfig.from_preset("debug"))}
    llm = LLMConfig.from_hf({**TINY_LLM, "vocab_size": 300})
    return VisionLanguageModel(VLMConfig(vision=vision, llm=llm, image_token_id=299))


def test_vlm_patch_and_position_embeddings_go_to_adamw_projector_to_muon():
    choices = _choices(_vlm())
    assert choices["vision.embeddings.patch_embedding.weight"].kind == "N-D"  # a convolution, never flattened
    assert choices["vision.embeddings.position_embedding.weight"].kind == "embedding"
    assert choices["llm.model.embed_tokens.weight"].kind == "embedding"
    muon = _muon_names(choices)
    assert {"projector.linear_1.weight", "projector.linear_2.weight"} <= muon
    assert "vision.encoder.layers.0.self_attn.q_proj.weight" in muon
    assert not any(n.endswith(".bias") for n in muon)


def test_wan_dit_patch_embedding_modulation_tables_and_output_projection_go_to_adamw():
    choices = _choices(WanDiT(wan_preset("debug", in_channels=4, out_channels=4)))
    kinds = {n: c.kind for n, c in choices.items() if not c.use_muon and c.param.ndim >= 2}
    assert kinds == {
        "patch_embedding.weight": "N-D",
        "scale_shift_table": "N-D",
        "blocks.0.scale_shift_table": "N-D",
        "blocks.1.scale_shift_table": "N-D",
        "proj_out.weight": "by name",
    }
    muon = _muon_names(choices)
    assert {"condition_embedder.time_proj.weight", "condition_embedder.text_embedder.linear_1.weight"} <= muon
    assert "blocks.1.ffn.net.2.weight" in muon


def test_pi05_action_projections_go_to_adamw():
    choices = _choices(Pi05(Pi05Config.from_preset("debug")))
    for name in ("action_expert.action_in_proj.weight", "action_expert.action_out_proj.weight"):
        assert choices[name].kind == "by name"
    assert choices["llm.embed_tokens.weight"].kind == "embedding"
    muon = _muon_names(choices)
    assert {"action_expert.time_mlp_in.weight", "vision.projector.weight"} <= muon
    assert "action_expert.layers.0.input_layernorm.dense.weight" in muon  # adaptive-norm projection


def test_patterns_force_either_way_and_muon_params_win():
    model = DecoderLM(LLMConfig.from_preset("debug"))
    choices = _choices(
        model,
        adamw_params=["*embed_tokens*", "*lm_head*", "*.q_proj.*"],
        muon_params=["lm_head.weight", "model.embed_tokens.weight"],
    )
    assert choices["lm_head.weight"].use_muon and choices["model.embed_tokens.weight"].use_muon
    assert not choices["model.layers.1.self_attn.q_proj.weight"].use_muon
    assert choices["model.layers.1.self_attn.q_proj.weight"].decayed
    assert _choices(model, adamw_params=[])["lm_head.weight"].use_muon  # without the patterns: a matrix


@pytest.mark.parametrize(
    ("model", "pattern", "message"),
    [
        (
            "llm",
            "*norm*",
            r"matches model.layers.0.input_layernorm.weight of shape \[64\]: Muon updates matrices",
        ),
        (
            "wan",
            "patch_embedding.*",
            r"patch_embedding.weight of shape \[24, 4, 1, 2, 2\]: Muon does not flatten",
        ),
        ("llm", "model.layer.*", r"patterns \['model.layer.\*'\] match no trainable parameter"),
    ],
)
def test_forcing_what_muon_cannot_take_is_refused(model, pattern, message):
    built = (
        DecoderLM(LLMConfig.from_preset("debug"))
        if model == "llm"
        else WanDiT(wan_preset("debug", in_channels=4, out_channels=4))
    )
    with pytest.raises(ValueError, match=message):
        _choices(built, muon_params=[pattern])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": 0.0}, r"optimizer.muon.lr \(0.0\) must be positive"),
        ({"weight_decay": -1.0}, r"optimizer.muon.weight_decay \(-1.0\) must be >= 0"),
        ({"momentum": 1.0}, r"optimizer.muon.momentum \(1.0\) must be in \[0, 1\)"),
        ({"ns_steps": 0}, r"optimizer.muon.ns_steps \(0\) must be a positive integer"),
        ({"ns_coefficients": (1.0, 2.0)}, r"ns_coefficients \(\[1.0, 2.0\]\) must be three numbers"),
        ({"eps": 0.0}, r"optimizer.muon.eps \(0.0\) must be positive"),
        (
            {"adjust_lr_fn": "spectral"},
            r"adjust_lr_fn \('spectral'\) must be one of \('original', 'match_rms",
        ),
        ({"ns_dtype": "float16"}, r"ns_dtype \('float16'\) must be one of \('bfloat16', 'float32'\)"),
        ({"adamw_params": "*lm_head*"}, r"adamw_params \('\*lm_head\*'\) must be a list"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        MuonOptions(**options)


def test_config_round_trips_through_saved_hyperparameters_and_warns_when_unused():
    config = OptimizerConfig(name="muon", lr=1e-3, muon={"lr": 0.02, "ns_coefficients": [3.0, -4.0, 2.0]})
    assert isinstance(config.muon, MuonOptions) and config.muon.ns_coefficients == (3.0, -4.0, 2.0)
    assert OptimizerConfig(**dataclasses.asdict(config)) == config
    assert (config.muon_lr, config.muon_weight_decay) == (0.02, 0.1)
    with pytest.warns(UserWarning, match="optimizer.muon is set but optimizer.name is 'adamw'"):
        OptimizerConfig(muon={"lr": 0.02})


def test_groups_carry_names_rates_decay_and_splits():
    model = DecoderLM(LLMConfig.from_preset("debug-moe"))
    config = OptimizerConfig(name="muon", lr=1e-3, weight_decay=0.1, muon={"lr": 0.02, "weight_decay": 0.01})
    choices = choose_params([("", model)], config.muon)
    groups = muon_groups(
        choices,
        lr=config.lr,
        muon_lr=config.muon_lr,
        weight_decay=config.weight_decay,
        muon_weight_decay=config.muon_weight_decay,
    )
    by_name = {g["name"]: g for g in groups}
    assert list(by_name) == ["muon", "decay", "no_decay"]
    assert [(g["use_muon"], g["lr"], g["weight_decay"]) for g in groups] == [
        (True, 0.02, 0.01),
        (False, 1e-3, 0.1),
        (False, 1e-3, 0.0),
    ]
    assert by_name["decay"]["param_names"] == ["lm_head.weight"]
    muon = by_name["muon"]
    assert len(muon["params"]) == len(muon["param_names"]) == len(muon["row_splits"]) == 14
    splits = dict(zip(muon["param_names"], muon["row_splits"], strict=True))
    assert splits["model.layers.1.mlp.experts.gate_up_proj"] == [32, 32]
    assert splits["model.layers.1.mlp.experts.down_proj"] is None
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_component_learning_rates_scale_muon_rates_by_the_same_ratio():
    model = Pi05(Pi05Config.from_preset("debug"))
    components = [
        Component(name="vision", module=model.vision, frozen=True),
        Component(name="llm", module=model.llm),
        Component(name="action_expert", module=model.action_expert),
    ]
    config = OptimizerConfig(name="muon", lr=1e-3, muon={"lr": 0.02})
    groups = component_param_groups(components, config, {"llm": 1e-4})
    rates = {g["name"]: g["lr"] for g in groups}
    assert rates == pytest.approx(
        {
            "llm/muon": 0.002,
            "llm/no_decay": 1e-4,
            "action_expert/muon": 0.02,
            "action_expert/decay": 1e-3,
            "action_expert/no_decay": 1e-3,
        }
    )
    names = {n for g in groups for n in g["param_names"]}
    assert "llm.layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("vision.") for n in names)
    decayed = next(g for g in groups if g["name"] == "action_expert/decay")["param_names"]
    assert decayed == ["action_expert.action_in_proj.weight", "action_expert.action_out_proj.weight"]
    with pytest.raises(ValueError, match=r"patterns \['vision\.\*'\] match no trainable parameter"):
        component_param_groups(components, OptimizerConfig(name="muon", muon={"muon_params": ["vision.*"]}))


def test_summary_counts_matrices_by_shape_and_adamw_tensors_by_kind():
    model = DecoderLM(LLMConfig.from_preset("debug-moe"))
    choices = choose_params([("", model)], MuonOptions())
    summary = muon_summary(
        muon_groups(choices, lr=1e-3, muon_lr=0.02, weight_decay=0.1, muon_weight_decay=0.1)
    )
    lines = summary.splitlines()
    assert lines[0].startswith("Muon: 14 tensors (42 matrices), 0.12M params: [64, 64] x4, [32, 64] x4")
    assert "[8, 64, 64] x2 (stack)" in lines[0]
    assert lines[1] == (
        "  parts orthogonalised separately: 2 fused (model.layers.0.mlp.experts.gate_up_proj, "
        "model.layers.1.mlp.experts.gate_up_proj)"
    )
    assert lines[2].startswith(
        "AdamW: 11 tensors, 0.03M params: 2-D (embeddings, heads) 2 (lm_head.weight, model.embed_tokens.weight); "
        "1-D (norms, biases) 9 (model.layers.0.self_attn.q_norm.weight, "
    )
    assert lines[2].endswith("... (+6))")
    unnamed = [
        {"params": [torch.zeros(4, 8)], "use_muon": True},
        {"params": [torch.zeros(4)], "use_muon": False},
    ]
    assert (
        muon_summary(unnamed).splitlines()[1]
        == "AdamW: 1 tensors, 0.00M params: 1-D (norms, biases) 1 (group[0])"
    )


def test_yaml_section_reaches_the_module_through_the_forge_parser(tmp_path):
    from forge_lightning.cli import ForgeCLI

    extra = tmp_path / "muon.yaml"
    extra.write_text(
        "optimizer:\n"
        "  name: muon\n"
        "  muon:\n"
        "    lr: 0.02\n"
        "    adjust_lr_fn: match_rms_adamw\n"
        "    muon_params: [lm_head.weight]\n"
    )
    tiny = REPO / "tests" / "configs" / "tiny_llm.yaml"
    cli = ForgeCLI(args=["--config", str(tiny), "--config", str(extra)], run=False)
    config = cli.model.optimizer_config
    assert config.name == "muon" and isinstance(config.muon, MuonOptions)
    assert (config.muon.lr, config.muon.adjust_lr_fn, config.muon.muon_params) == (
        0.02,
        "match_rms_adamw",
        ["lm_head.weight"],
    )
    assert config.muon.ns_steps == 5 and "*embed_tokens*" in config.muon.adamw_params
    assert cli.model.hparams["optimizer"]["muon"]["lr"] == 0.02


def _token_batches(steps: int, vocab: int) -> DataLoader:
    tokens = torch.randint(0, vocab, (steps, 4, 17))
    return DataLoader([{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens], batch_size=None)


def test_llm_module_trains_with_muon_and_updates_both_kinds_of_parameters(monkeypatch, caplog):
    splits = {}
    set_split = Muon.set_matrix_split
    monkeypatch.setattr(
        Muon,
        "set_matrix_split",
        lambda self, p, split: (splits.update({id(p): split}), set_split(self, p, split)),
    )
    torch.manual_seed(0)
    module = CausalLM(
        config="debug-moe",
        optimizer={"name": "muon", "lr": 1e-3, "muon": {"lr": 0.02}},
        scheduler={"name": "constant"},
        performance={"compile": False},
    )
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(module, train_dataloaders=_token_batches(3, module.config.vocab_size))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, Muon) and trainer.global_step == 3
    assert "Muon: 14 tensors (42 matrices)" in caplog.text
    assert all("row_splits" not in g for g in optimizer.param_groups)
    for group in optimizer.param_groups:
        key = "momentum_buffer" if group["use_muon"] else "exp_avg"
        for name, param in zip(group["param_names"], group["params"], strict=True):
            assert not torch.equal(param.detach(), before[name]), f"{name} did not change"
            assert key in optimizer.state[param], name
    gate_up = module.model.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(splits.pop(id(gate_up)), SplitRows)
    assert len(splits) == 1  # the other layer's gate_up_proj


def test_optimizer_for_component_groups_keeps_their_rates_and_checks_its_input():
    model = Pi05(Pi05Config.from_preset("debug"))
    components = [Component(name=n, module=getattr(model, n)) for n in ("vision", "llm", "action_expert")]
    config = OptimizerConfig(name="muon", lr=1e-3, muon={"lr": 0.02, "ns_dtype": "float32"})
    groups = component_param_groups(components, config, {"vision": 1e-4})
    optimizer = optimizer_for_groups(groups, config, implementation="fused")  # fused: AdamW's kernels only
    assert isinstance(optimizer, Muon)
    assert [(g["name"], g["lr"]) for g in optimizer.param_groups] == [(g["name"], g["lr"]) for g in groups]
    assert next(g for g in optimizer.param_groups if g["name"] == "vision/muon")["lr"] == pytest.approx(0.002)
    with pytest.raises(ValueError, match=r"optimizer implementation \('fast'\) must be one of"):
        optimizer_for_groups(groups, config, implementation="fast")
    plain = [{"params": list(model.llm.parameters())}]
    with pytest.raises(ValueError, match=r"parameter groups \[0\] have no 'use_muon'"):
        optimizer_for_groups(plain, config)


def test_lora_adapters_go_to_muon_and_frozen_fused_weights_are_left_out():
    from forge_lightning.modules.lora import LoRAConfig, apply_lora

    model = DecoderLM(LLMConfig.from_preset("debug-deepseek"))
    apply_lora(model, LoRAConfig(rank=4, target_modules=["kv_a_proj_with_mqa"]))
    choices = _choices(model)
    assert choices and all("lora_" in n for n in choices)
    assert all(c.use_muon and c.parts is None for c in choices.values())

"""``VisionLanguageModule``: training from config through Lightning (a SigLIP and a Qwen3 checkpoint composed, the
quick start's data), per-component freezing, learning rates, LoRA (merged into the HF export that transformers
loads), per-component checkpointing / compile in the plan, generation with images equal to transformers' greedy
``generate`` (Qwen2.5-VL: multimodal positions shifted by the rope deltas; LLaVA), FLOP counts and setup checks."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from llm_parity import randomize_weights
from qwen2_5_vl_case import IMAGE, IMG_A, IMG_B, hf_config, patches, text_ids, vision_ids
from tiny import TINY_QWEN3_TEXT, TINY_SIGLIP_VISION
from transformers import (
    AutoModelForCausalLM,
    LlavaForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
)
from transformers import SiglipVisionConfig as HFSiglipVisionConfig
from transformers import SiglipVisionModel as HFSiglipVisionModel

from forge_lightning.datamodules.vlm import VLMDataModule
from forge_lightning.datamodules.vlm.shapes import IMAGE_TOKEN, write_shapes_dataset
from forge_lightning.modules.vlm import VisionLanguageModule
from forge_lightning.tools.data import build_vlm_quickstart

VOCAB = 512


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    randomize_weights(model, weight_std=0.1)
    return model.float().eval()


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """The quick start's data (small) and tokenizer."""
    out = tmp_path_factory.mktemp("shapes")
    build_vlm_quickstart(out, num_train=64, num_val=8)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, shapes: Path) -> dict:
    """A SigLIP vision checkpoint (48 x 48 images in 16 x 16 patches, the quick start's boards) and a Qwen3 one."""
    out = tmp_path_factory.mktemp("parts")
    vision = {**TINY_SIGLIP_VISION, "image_size": 48, "patch_size": 16}
    _randomize(HFSiglipVisionModel(HFSiglipVisionConfig(**vision)), 0).save_pretrained(out / "siglip")
    text = {**TINY_QWEN3_TEXT, "vocab_size": VOCAB}
    _randomize(AutoModelForCausalLM.from_config(Qwen3Config(**text)), 1).save_pretrained(out / "qwen3")
    tokenizer = json.loads((shapes / "tokenizer" / "tokenizer.json").read_text())
    image_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == IMAGE_TOKEN)
    return {
        "vision": {"pretrained": str(out / "siglip"), "feature_layer": -1},
        "projector": "mlp",
        "llm": {"pretrained": str(out / "qwen3")},
        "image_token_id": image_id,
    }


def _data(shapes: Path, **overrides) -> VLMDataModule:
    options = dict(
        train_files=str(shapes / "train.jsonl"),
        val_files=str(shapes / "val.jsonl"),
        tokenizer=str(shapes / "tokenizer"),
        processor="fixed",
        image_size=48,
        patch_size=16,
        seq_length=64,
        batch_size=4,
        num_workers=0,
        pin_memory=False,
    )
    return VLMDataModule(**{**options, **overrides})


def _trainer(tmp_path: Path, steps: int) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )


def _fit_lowers_the_loss(module: VisionLanguageModule, shapes: Path, tmp_path: Path) -> pl.Trainer:
    """12 steps on the shapes data; the loss of the first batch must drop by 20%. Returns the trainer."""
    data = _data(shapes)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        before = (lambda s: (s[0] / s[1]).item())(module.loss_sum(batch))
    trainer = _trainer(tmp_path, 12)
    trainer.fit(module, datamodule=data)
    with torch.no_grad():
        after = (lambda s: (s[0] / s[1]).item())(module.loss_sum(batch))
    assert after < 0.8 * before, (before, after)
    return trainer


def test_a_composed_model_trains_from_config_with_frozen_and_per_component_settings(
    checkpoints: dict, shapes: Path, tmp_path: Path
) -> None:
    module = VisionLanguageModule(
        checkpoints,
        components={"vision": {"freeze": True}, "projector": {"lr": 1e-2}, "llm": {"lr": 1e-3}},
        optimizer={"lr": 5e-3, "weight_decay": 0.0},
        scheduler={"name": "constant", "warmup_steps": 0},
    )
    vision_before = {k: v.clone() for k, v in module.model.vision.state_dict().items()}
    trainer = _fit_lowers_the_loss(module, shapes, tmp_path)
    assert all(torch.equal(v, module.model.vision.state_dict()[k]) for k, v in vision_before.items())
    groups = {g["name"]: g for g in trainer.optimizers[0].param_groups}
    assert {name.split("/")[0] for name in groups} == {"projector", "llm"}
    assert groups["projector/decay"]["initial_lr"] == 1e-2 and groups["llm/decay"]["initial_lr"] == 1e-3
    assert not any(p.requires_grad for p in module.model.vision.parameters())


def test_a_composed_model_trains_with_muon_at_per_component_rates(
    checkpoints: dict, shapes: Path, tmp_path: Path
) -> None:
    """``optimizer: {name: muon}``: each component's hidden matrices in its ``<component>/muon`` group, whose rate is
    Muon's scaled by the component's ratio to ``optimizer.lr``; embeddings, head and vectors on AdamW."""
    module = VisionLanguageModule(
        checkpoints,
        components={"vision": {"freeze": True}, "projector": {"lr": 1e-2}, "llm": {"lr": 2.5e-3}},
        optimizer={"name": "muon", "lr": 5e-3, "weight_decay": 0.0, "muon": {"lr": 0.02}},
        scheduler={"name": "constant", "warmup_steps": 0},
    )
    trainer = _fit_lowers_the_loss(module, shapes, tmp_path)
    groups = {g["name"]: g for g in trainer.optimizers[0].param_groups}
    assert groups["projector/muon"]["initial_lr"] == pytest.approx(0.04)
    assert groups["llm/muon"]["initial_lr"] == pytest.approx(0.01)
    assert groups["llm/no_decay"]["initial_lr"] == 2.5e-3
    muon_names = {n for g in groups.values() if g["use_muon"] for n in g["param_names"]}
    assert "llm.model.layers.0.self_attn.q_proj.weight" in muon_names
    assert not any("embed_tokens" in n or "lm_head" in n or n.endswith(".bias") for n in muon_names)


def test_lora_trains_adapters_only_and_the_export_merges_them(
    checkpoints: dict, shapes: Path, tmp_path: Path
) -> None:
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    module = VisionLanguageModule(checkpoints, components={"vision": {"freeze": True}, "llm": {"lora": lora}})
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all(
        n.startswith("projector.") or ("lora_" in n and n.startswith("llm.")) for n in trainable
    ), sorted(trainable)
    assert any(n.startswith("projector.") for n in trainable)
    with torch.no_grad():  # non-zero adapters, so that merging them matters
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    data = _data(shapes)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    module.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "adapters" / "llm" / "adapter_config.json").is_file()
    hf = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values")}
    with torch.no_grad():
        ours = module.model(**inputs)
        theirs = hf(**inputs).logits
    keep = batch["attention_mask"].bool()
    assert (ours - theirs)[keep].abs().max().item() <= 1e-4


def test_per_component_checkpointing_and_compile_reach_the_plan(checkpoints: dict) -> None:
    module = VisionLanguageModule(
        checkpoints,
        components={
            "vision": {"activation_checkpointing": "full", "compile": False},
            "llm": {"compile": True},
        },
    )
    plan = {c.name: c for c in module.parallel_plan()}
    assert plan["vision"].activation_checkpointing == "full" and plan["vision"].compile is False
    assert plan["llm"].activation_checkpointing is None and plan["llm"].compile is True
    assert len(plan["vision"].blocks) == TINY_SIGLIP_VISION["num_hidden_layers"]
    assert plan["llm"].blocks == list(module.model.llm.model.layers) and plan["projector"].blocks == []


@pytest.mark.parametrize(
    ("components", "match"),
    [
        ({"encoder": {}}, "components.encoder: unknown component"),
        ({"llm": {"freeze": True, "lora": {}}}, "freeze and lora exclude each other"),
        ({"vision": {"activation_checkpointing": "most"}}, "components.vision: activation_checkpointing"),
        ({"projector": {"learning_rate": 1.0}}, "components.projector: .*learning_rate"),
    ],
)
def test_bad_component_settings_are_named(checkpoints: dict, components: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VisionLanguageModule(checkpoints, components=components)


def test_the_tokenizers_image_token_must_be_the_models(
    checkpoints: dict, shapes: Path, tmp_path: Path
) -> None:
    module = VisionLanguageModule({**checkpoints, "image_token_id": checkpoints["image_token_id"] - 1})
    with pytest.raises(ValueError, match="the model's image_token_id is .* but the tokenizer's token is"):
        _trainer(tmp_path, 1).fit(module, datamodule=_data(shapes))


def test_batch_stats_count_real_tokens_and_the_encoder(checkpoints: dict, shapes: Path) -> None:
    module = VisionLanguageModule(checkpoints)
    data = _data(shapes)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    stats = module.batch_stats(batch)
    assert stats["tokens"] == int(batch["attention_mask"].sum()) < batch["input_ids"].numel()
    without = module.batch_stats({k: v for k, v in batch.items() if k != "pixel_values"})
    vision = module.model.tower.training_flops(module.model.vision, batch["pixel_values"], None)
    assert stats["flops"] - without["flops"] == pytest.approx(vision) and vision > 0


def test_generation_with_images_equals_transformers_qwen2_5_vl(tmp_path: Path) -> None:
    hf = _randomize(Qwen2_5_VLForConditionalGeneration(hf_config()), 0)
    hf.save_pretrained(tmp_path)
    module = VisionLanguageModule.from_pretrained(tmp_path)
    prompt = (
        text_ids(3, 0) + vision_ids(IMAGE, IMG_A) + text_ids(4, 1) + vision_ids(IMAGE, IMG_B) + text_ids(2, 2)
    )
    input_ids = torch.tensor([prompt])
    media = {"pixel_values": patches([IMG_A, IMG_B], 0), "image_grid_thw": torch.tensor([IMG_A, IMG_B])}
    step_logits = []  # what our decoder's head gives at each step
    head = module.model.llm.lm_head
    hook = head.register_forward_hook(lambda _m, _i, out: step_logits.append(out.detach()))
    ours = module.generate(input_ids, max_new_tokens=6, **media)
    hook.remove()
    theirs = hf.generate(  # mm_token_type_ids: as transformers' processor gives them (else 1-D positions)
        input_ids,
        mm_token_type_ids=(input_ids == IMAGE).int(),
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **media,
    )
    assert ours.tolist() == theirs.sequences.tolist()
    # The logits of every step, not only their argmax: new tokens sit at positions shifted by the rope deltas.
    assert len(step_logits) == len(theirs.logits) == 6
    for mine, want in zip(step_logits, theirs.logits):
        assert (mine.reshape(want.shape) - want).abs().max().item() <= 1e-4
    _, deltas = module.model.position_ids(input_ids, None, media["image_grid_thw"])
    assert int(deltas) != 0


def test_generation_with_images_equals_transformers_llava(
    checkpoints: dict, shapes: Path, tmp_path: Path
) -> None:
    module = VisionLanguageModule(checkpoints)
    module.save_pretrained(tmp_path / "hf")
    hf = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    data = _data(shapes)
    reference = data.generation_references("val")[0]
    input_ids = torch.tensor([reference.prompt_ids])
    ours = module.generate(input_ids, max_new_tokens=5, **reference.inputs)
    theirs = hf.generate(input_ids, max_new_tokens=5, do_sample=False, **reference.inputs)
    assert ours.tolist() == theirs.tolist()


def test_the_shapes_set_asks_answerable_questions(tmp_path: Path) -> None:
    record = write_shapes_dataset(tmp_path, num_train=20, num_val=5, seed=3)
    assert record["train"] == 20 and record["val"] == 5 and record["image_size"] == 48
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert all(r["conversations"][0]["value"].startswith(IMAGE_TOKEN) for r in rows)
    assert all((tmp_path / r["image"]).is_file() for r in rows)
    assert {r["conversations"][1]["value"] for r in rows} <= {
        "red", "green", "blue", "yellow", "triangle", "square", "circle", "one", "two", "three", "four", "five",
    }  # fmt: skip


def test_the_quickstart_recipe_trains_and_exports_through_the_cli(shapes: Path, tmp_path: Path) -> None:
    from forge_lightning.cli import ForgeCLI

    recipe = Path(__file__).resolve().parents[2] / "configs" / "quickstart" / "vlm.yaml"
    ForgeCLI(
        args=[
            "fit",
            "--config",
            str(recipe),
            f"--data.init_args.train_files={shapes / 'train.jsonl'}",
            f"--data.init_args.val_files={shapes / 'val.jsonl'}",
            f"--data.init_args.tokenizer={shapes / 'tokenizer'}",
            "--data.init_args.num_workers=0",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=4",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    exports = list(tmp_path.rglob("config.json"))
    assert exports, "no HF export"
    hf = LlavaForConditionalGeneration.from_pretrained(exports[0].parent)
    assert hf.config.image_token_index == json.loads(exports[0].read_text())["image_token_index"]


def test_the_datas_video_rate_must_be_the_models(tmp_path: Path) -> None:
    """Packed rows take their video positions from the data module's tokens_per_second: a value other than the
    model's is refused at setup, before any step."""
    from vlm_pack_case import datamodule, hf_config, write_data

    tokenizer, train = write_data(tmp_path)
    data = datamodule(tokenizer, train, tokens_per_second=4.0)
    assert data.vision_settings == {"tokens_per_second": 4.0}
    Qwen2_5_VLForConditionalGeneration(hf_config(data)).save_pretrained(tmp_path / "hf")
    module = VisionLanguageModule.from_pretrained(tmp_path / "hf")
    assert module.config.tokens_per_second == 2
    with pytest.raises(
        ValueError, match=r"the model's tokens_per_second is 2.* but the data module's is 4.0"
    ):
        _trainer(tmp_path, 1).fit(module, datamodule=data)
    # Qwen3-VL's prompts (time as text) would pass a Qwen2.5-VL model's packed rows unnoticed: refused too
    qwen3 = datamodule(tokenizer, train, processor="qwen3_vl")
    assert qwen3.vision_settings == {"tokens_per_second": None}
    with pytest.raises(ValueError, match=r"tokens_per_second is 2.* but the data module's videos have none"):
        _trainer(tmp_path, 1).fit(module, datamodule=qwen3)

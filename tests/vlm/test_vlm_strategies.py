"""``VisionLanguageModule`` + ``VLMDataModule`` under the native strategies, through ``python -m forge_lightning fit``
(gloo, fp32, 4 steps; a SigLIP and a Qwen3 checkpoint composed with an MLP projector, coloured-shape records).

* FSDP2 on 2 processes with per-component settings (the frozen encoder left unsharded and replicated, the LLM
  sharded with full activation checkpointing, the encoder without): per-step losses equal to one plain process
  within 2e-6; the exported LLaVA checkpoint loads in transformers with the same logits (1e-4) and the encoder's
  weights bit for bit those of the SigLIP checkpoint; its step-2 checkpoint resumed on ONE process under FSDP2
  reproduces steps 2-3.
* DDP, ZeRO-1 and FSDP2 (the encoder sharded as well) on 2 processes with LoRA on the LLM, the projector trained and
  the encoder at a lower rate: the losses of one plain process within 2e-6; the ZeRO-1 and FSDP2 exports (adapters
  merged) load in transformers with the same logits.
* The recipes in configs/vlm/ build their model and data module with their checkpoints pointed at tiny local ones
  and compute a finite loss; the Qwen2.5-VL one, as shipped (bf16 parameters, packed rows), trains on 2 processes
  as on one within 2e-4 and exports a checkpoint transformers loads.

Each launch is shared by the tests that read it (module-scoped fixtures).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from procs import assert_clean_exit
from safetensors.torch import load_file
from tiny import TINY_QWEN3_TEXT, TINY_SIGLIP_VISION, write_vlm_tokenizer
from transformers import (
    AutoModelForCausalLM,
    LlavaForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
)
from transformers import SiglipVisionConfig as HFSiglipVisionConfig
from transformers import SiglipVisionModel as HFSiglipVisionModel
from vlm_pack_case import OPTIONS, datamodule, hf_config, write_data

from forge_lightning.cli import ForgeCLI
from forge_lightning.datamodules.vlm.shapes import write_shapes_dataset
from forge_lightning.modules.vlm import VisionLanguageModule, from_pretrained

REPO = Path(__file__).resolve().parents[2]
STEPS = [0, 1, 2, 3]
LOSS_TOL, LOGITS_TOL = 2e-6, 1e-4
SIZE, PATCH = TINY_SIGLIP_VISION["image_size"], TINY_SIGLIP_VISION["patch_size"]


@dataclass(frozen=True)
class Case:
    """The files every run of this module reads."""

    root: Path
    siglip: Path
    qwen3: Path
    tokenizer: Path
    train: Path
    image_token_id: int


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("vlm_strategies")
    torch.manual_seed(0)
    HFSiglipVisionModel(HFSiglipVisionConfig(**TINY_SIGLIP_VISION)).save_pretrained(root / "siglip")
    qwen3 = AutoModelForCausalLM.from_config(Qwen3Config(**TINY_QWEN3_TEXT, vocab_size=512))
    qwen3.save_pretrained(root / "qwen3")
    tokenizer = write_vlm_tokenizer(root / "tokenizer")
    write_shapes_dataset(root / "data", num_train=32, num_val=0, grid=2, cell=SIZE // 2)
    vocab = json.loads((tokenizer / "tokenizer.json").read_text())["added_tokens"]
    image = next(t["id"] for t in vocab if t["content"] == "<image>")
    return Case(root, root / "siglip", root / "qwen3", tokenizer, root / "data" / "train.jsonl", image)


def _model(case: Case, components: dict) -> dict:
    config = {
        "vision": {"pretrained": str(case.siglip), "feature_layer": -1},
        "projector": "mlp",
        "llm": {"pretrained": str(case.qwen3)},
        "image_token_id": case.image_token_id,
    }
    return {
        "class_path": "forge_lightning.modules.vlm.VisionLanguageModule",
        "init_args": {"config": config, "components": components},
    }


def _fit(
    case: Case,
    name: str,
    components: dict,
    *,
    strategy: dict | str = "auto",
    devices: int = 1,
    callbacks: list[dict] | None = None,
    ckpt_path: Path | None = None,
) -> tuple[dict[int, float], str]:
    """Train 4 steps of global batch 4 (``4 / devices`` per rank); return the logged losses by step and the log."""
    config = {
        "seed_everything": 3,
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "precision": "32-true",
            "max_steps": len(STEPS),
            "strategy": strategy,
            "enable_checkpointing": bool(callbacks),
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "log_every_n_steps": 1,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(case.root), "name": name}},
            "callbacks": callbacks or [],
        },
        "model": _model(case, components),
        "data": {
            "class_path": "forge_lightning.datamodules.vlm.VLMDataModule",
            "init_args": {
                "train_files": str(case.train),
                "tokenizer": str(case.tokenizer),
                "processor": "fixed",
                "image_size": SIZE,
                "patch_size": PATCH,
                "seq_length": 64,
                "batch_size": 4 // devices,
                "num_workers": 0,
                "pin_memory": False,
            },
        },
        "optimizer": {"name": "adamw", "lr": 2e-3},
        "scheduler": {"name": "constant"},
    }  # fmt: skip
    path = case.root / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return _launch(path, case.root / name, *(["--ckpt_path", str(ckpt_path)] if ckpt_path else []))


def _launch(config: Path, log_dir: Path, *args: str) -> tuple[dict[int, float], str]:
    """``forge fit --config config args`` whose CSV logger writes to ``log_dir``: the losses by step and the log."""
    command = [sys.executable, "-m", "forge_lightning", "fit", "--config", str(config), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)
    assert_clean_exit(proc)
    rows = csv.DictReader((log_dir / "version_0" / "metrics.csv").open())
    return {
        int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")
    }, proc.stdout + proc.stderr


def _assert_same(losses: dict[int, float], reference: dict[int, float], steps: list[int] = STEPS) -> None:
    assert sorted(losses) == steps
    deltas = {s: abs(losses[s] - reference[s]) for s in steps}
    assert max(deltas.values()) <= LOSS_TOL, deltas


def _fsdp2(**options) -> dict:
    return {"class_path": "forge_lightning.strategies.FSDP2Strategy", "init_args": options}


def _export(dirpath: Path) -> dict:
    return {"class_path": "forge_lightning.callbacks.HFExport", "init_args": {"dirpath": str(dirpath)}}


# ----- FSDP2 with heterogeneous components ---------------------------------------------------------------------
FROZEN_VISION = {"vision": {"freeze": True}, "llm": {"activation_checkpointing": "full"}}


@pytest.fixture(scope="module")
def fsdp2(case) -> dict:
    one, _ = _fit(case, "one", FROZEN_VISION)
    assert len(set(one.values())) == len(STEPS)  # it trains
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(case.root / "ckpt"), "every_n_train_steps": 2, "save_top_k": -1},
    }
    losses, log = _fit(
        case,
        "fsdp2",
        FROZEN_VISION,
        strategy=_fsdp2(unsharded_components=["vision"]),
        devices=2,
        callbacks=[checkpoint, _export(case.root / "hf_fsdp2")],
    )
    resumed, _ = _fit(
        case,
        "fsdp2_resume",
        FROZEN_VISION,
        strategy=_fsdp2(unsharded_components=["vision"]),
        ckpt_path=case.root / "ckpt" / "epoch=0-step=2.ckpt",
    )
    return {"one": one, "losses": losses, "log": log, "resumed": resumed, "export": case.root / "hf_fsdp2"}


def test_fsdp2_with_an_unsharded_frozen_encoder_matches_one_process(fsdp2):
    _assert_same(fsdp2["losses"], fsdp2["one"])
    log = fsdp2["log"]
    assert "over 2 ranks (FSDP)" in log and "unsharded components ['vision']" in log, log[-3000:]
    assert "activation checkpointing: llm full: 2 blocks" in log and "vision full" not in log, log[-3000:]


def test_fsdp2_checkpoint_resumes_on_one_process_with_the_same_losses(fsdp2):
    _assert_same(fsdp2["resumed"], fsdp2["losses"], steps=[2, 3])


def _image_batch(case: Case) -> dict[str, torch.Tensor]:
    tokens = (SIZE // PATCH) ** 2
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 300, (2, tokens + 12), generator=generator)
    ids[:, 3 : 3 + tokens] = case.image_token_id
    pixels = torch.randn(2, 3, SIZE, SIZE, generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def _assert_export_loads(case: Case, out: Path) -> LlavaForConditionalGeneration:
    hf, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    batch = _image_batch(case)
    with torch.no_grad():
        ours = from_pretrained(out).eval()(**batch)
        theirs = hf.eval()(**batch).logits
    assert (ours - theirs).abs().max().item() <= LOGITS_TOL
    return hf


def test_fsdp2_export_loads_in_transformers_with_the_encoder_unchanged(case, fsdp2):
    hf = _assert_export_loads(case, fsdp2["export"])
    exported = hf.model.vision_tower.state_dict()
    original = HFSiglipVisionModel.from_pretrained(case.siglip).state_dict()
    assert exported and set(exported) <= set(original)
    changed = [k for k, v in exported.items() if not torch.equal(v, original[k])]
    assert not changed, changed
    qwen3 = AutoModelForCausalLM.from_pretrained(case.qwen3).state_dict()
    assert not torch.equal(hf.lm_head.weight, qwen3["lm_head.weight"])  # the LLM trained


# ----- DDP and ZeRO-1 with LoRA on the LLM ----------------------------------------------------------------------
LORA = {"vision": {"lr": 1e-4}, "llm": {"lora": {"rank": 4}}}


@pytest.fixture(scope="module")
def lora_one(case) -> dict[int, float]:
    losses, log = _fit(case, "lora_one", LORA)
    assert "vision: 2 parameters frozen, outside the features the LLM gets (post_layernorm)" in log
    return losses


@pytest.mark.parametrize("strategy", ["DDPStrategy", "ZeRO1Strategy", "FSDP2Strategy"])
def test_lora_llm_with_a_trained_encoder_matches_one_process(case, lora_one, strategy):
    """Under FSDP2 the encoder's blocks are sharded too (it trains); ZeRO-1 and FSDP2 also export, adapters
    merged."""
    out = case.root / f"hf_{strategy}"
    export = strategy != "DDPStrategy"
    losses, _ = _fit(
        case,
        strategy,
        LORA,
        strategy={"class_path": f"forge_lightning.strategies.{strategy}"},
        devices=2,
        callbacks=[_export(out)] if export else None,
    )
    _assert_same(losses, lora_one)
    if export:
        _assert_export_loads(case, out)
        adapter = load_file(out / "adapters" / "llm" / "adapter_model.safetensors")
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())  # trained adapters


def test_encoder_parameters_outside_the_features_are_frozen(case):
    """With feature layer -2 of 3, the last layer and ``post_layernorm`` get no gradient (DDP would refuse them):
    they are frozen, the rest of the trained encoder is not, and one backward reaches every trainable parameter."""
    config = {
        **_model(case, {})["init_args"]["config"],
        "vision": {"pretrained": str(case.siglip), "feature_layer": -2},
    }
    module = VisionLanguageModule(config, components={"llm": {"freeze": True}})
    names = [n for n, _ in module.model.vision.named_parameters()]
    frozen = [n for n, p in module.model.vision.named_parameters() if not p.requires_grad]
    assert frozen and frozen == [n for n in names if n.startswith(("post_layernorm.", "encoder.layers.2."))]
    batch = _image_batch(case)
    module.loss_sum({**batch, "labels": batch["input_ids"]})[0].backward()
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)


# ----- the recipes ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QwenCase:
    """A tiny random Qwen2.5-VL checkpoint whose token ids are those of a small tokenizer, and 48 records of 0 to 3
    images of varied sizes."""

    checkpoint: Path
    tokenizer: Path
    train: Path


@pytest.fixture(scope="module")
def qwen_case(case) -> QwenCase:
    root = case.root / "qwen2_5_vl_case"
    root.mkdir()
    tokenizer, train = write_data(root, num_records=48)
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(hf_config(datamodule(tokenizer, train, **OPTIONS)))
    hf.save_pretrained(root / "qwen2_5_vl")
    return QwenCase(root / "qwen2_5_vl", tokenizer, train)


def _recipe(case: Case, qwen_case: QwenCase, name: str) -> tuple[Path, dict[str, object]]:
    """A shipped recipe and the values that point it at tiny local checkpoints and data (dotted paths)."""
    if name == QWEN_RECIPE:
        options = {k: v for k, v in OPTIONS.items() if k != "processor"}
        return REPO / "configs" / "vlm" / name, {
            "model.init_args.pretrained": str(qwen_case.checkpoint),
            "data.init_args.tokenizer": str(qwen_case.tokenizer),
            "data.init_args.train_files": str(qwen_case.train),
            **{f"data.init_args.{k}": v for k, v in options.items()},
            "data.init_args.max_patches_per_row": 256,
            "performance.attention.packed": "sdpa",  # the recipe's varlen needs CUDA
        }
    return REPO / "configs" / "vlm" / name, {
        "model.init_args.config.vision.pretrained": str(case.siglip),
        "model.init_args.config.llm.pretrained": str(case.qwen3),
        "model.init_args.config.image_token_id": case.image_token_id,
        "data.init_args.tokenizer": str(case.tokenizer),
        "data.init_args.train_files": str(case.train),
        "data.init_args.image_root": str(case.train.parent),
        "data.init_args.image_size": SIZE,
        "data.init_args.patch_size": PATCH,
        "data.init_args.seq_length": 64,
    }


QWEN_RECIPE = "qwen2.5-vl-3b/sft_fsdp2.yaml"
# One process on the CPU, nothing written, small batches.
CPU = {
    "trainer.accelerator": "cpu",
    "trainer.devices": 1,
    "trainer.logger": False,
    "data.init_args.batch_size": 2,
    "data.init_args.num_workers": 0,
    "data.init_args.pin_memory": False,
}


def _pointed(recipe: Path, values: dict[str, object], out: Path) -> tuple[Path, dict]:
    """``recipe`` with ``values`` and :data:`CPU` set; each path of ``values`` must already be in the recipe (a
    renamed key fails); returns the written file and the recipe as shipped."""
    shipped = yaml.safe_load(recipe.read_text())
    config = yaml.safe_load(recipe.read_text())
    for dotted, value in {**values, **CPU}.items():
        *parents, key = dotted.split(".")
        node = config
        for part in parents:
            node = node[part]
        assert key in node or dotted in CPU, f"{recipe.name} has no {dotted}"
        node[key] = value
    out.write_text(yaml.safe_dump(config))
    return out, shipped


@pytest.mark.parametrize("name", [QWEN_RECIPE, "compose/siglip_qwen3_sft.yaml"])
def test_recipe_builds_on_tiny_checkpoints_and_computes_a_loss(case, qwen_case, name):
    recipe, values = _recipe(case, qwen_case, name)
    config, shipped = _pointed(recipe, values, case.root / name.replace("/", "_"))
    cli = ForgeCLI(args=["--config", str(config)], run=False)
    module, data = cli.model, cli.datamodule
    plan = {c.name: c for c in module.parallel_plan()}
    for component, options in shipped["model"]["init_args"]["components"].items():
        assert plan[component].frozen == bool(options.get("freeze", False))
        assert plan[component].activation_checkpointing == options.get("activation_checkpointing")
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    loss_sum, tokens = module.loss_sum(batch)
    assert tokens > 0 and torch.isfinite(loss_sum)
    if name == QWEN_RECIPE:
        assert cli.trainer.strategy.mp_dtypes[:2] == (torch.bfloat16, torch.float32)
        assert "document_ids" in batch  # packed rows
        assert module.components["vision"].lr < module.optimizer_config.lr
    else:
        trainable = {n.split(".")[1] for n, p in module.named_parameters() if p.requires_grad}
        assert trainable == {"projector"}


def test_the_qwen2_5_vl_recipe_trains_packed_rows_on_2_processes_as_on_one(case, qwen_case):
    """The recipe as shipped (bf16 parameters, fp32 reduction, the ViT sharded and trained, full checkpointing on
    the LLM, packed and balanced rows, 2 accumulated micro-batches) on tiny weights: 2 processes of 1 row per
    micro-batch against 1 process of 2 (bf16 compute: within 2e-4); the export loads in transformers with every
    tensor, the ViT's changed."""
    recipe, values = _recipe(case, qwen_case, QWEN_RECIPE)
    config, _ = _pointed(recipe, values, case.root / "qwen_recipe.yaml")
    out = case.root / "hf_qwen_recipe"
    common = [
        "--trainer.max_steps",
        "3",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.log_every_n_steps",
        "1",
    ]
    logger = "--trainer.logger={class_path: lightning.pytorch.loggers.CSVLogger, init_args: {save_dir: %s, name: %s}}"
    export = f"--trainer.callbacks=[{{class_path: forge_lightning.callbacks.HFExport, init_args: {{dirpath: {out}}}}}]"
    two, log = _launch(
        config, case.root / "qwen_two", *common, logger % (case.root, "qwen_two"), export,
        "--trainer.devices", "2", "--data.init_args.batch_size", "1",
    )  # fmt: skip
    one, _ = _launch(
        config,
        case.root / "qwen_one",
        *common,
        logger % (case.root, "qwen_one"),
        "--trainer.callbacks",
        "null",
    )
    assert sorted(two) == sorted(one) == [0, 1, 2]
    assert max(abs(two[s] - one[s]) for s in one) <= 2e-4, (two, one)
    assert (
        "params torch.bfloat16, reduce torch.float32" in log and "activation checkpointing: llm full" in log
    )
    assert "VLM packing: 48 samples into" in log, log[-3000:]
    hf, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    before = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        qwen_case.checkpoint
    ).model.visual.state_dict()
    assert any(not torch.equal(v, before[k]) for k, v in hf.model.visual.state_dict().items())

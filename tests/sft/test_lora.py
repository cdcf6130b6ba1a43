"""LoRA: only adapters train, exact resume, PEFT-format adapters that transformers + peft load, and merging."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors import safe_open

from forge_lightning.datamodules.sft import SFTDataModule
from forge_lightning.modules.llm import CausalLM, DecoderLM, LLMConfig, save_pretrained
from forge_lightning.modules.lora import LoRAConfig
from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO
from forge_lightning.tools.convert import main as forge_convert

LORA = {
    "rank": 4,
    "alpha": 8.0,
    "target_modules": ["q_proj", "v_proj", "down_proj"],
    "modules_to_save": ["embed_tokens"],
}
RECORDS = [{"instruction": f"hello there {i}", "output": "fine thanks " * (1 + i % 3)} for i in range(8)]


class _Losses(Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])


def _base(tmp_path, tiny_config):
    torch.manual_seed(0)
    config = LLMConfig.from_hf({**tiny_config, "tie_word_embeddings": False})
    path = tmp_path / "base"
    save_pretrained(DecoderLM(config), config, path)
    return path


def _fit(base, data_file, tokenizer_dir, root, *, max_steps, ckpt_path=None, callbacks=()):
    torch.manual_seed(123)
    model = CausalLM.from_pretrained(
        base,
        lora=LORA,
        optimizer={"lr": 1e-2},
        scheduler={"name": "cosine", "warmup_steps": 1, "total_steps": 4},
    )
    data = SFTDataModule(
        str(data_file), str(tokenizer_dir), seq_length=48, batch_size=2, num_workers=0, pin_memory=False
    )
    losses = _Losses()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        callbacks=[losses, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        limit_val_batches=0,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=root,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path, weights_only=True)
    return model, losses.losses


def test_lora_trains_adapters_resumes_and_exports_to_peft(
    tmp_path, tiny_config, chat_tokenizer_dir, write_jsonl
):
    base = _base(tmp_path, tiny_config)
    data_file = write_jsonl("train.jsonl", RECORDS)
    model, full = _fit(base, data_file, chat_tokenizer_dir, tmp_path / "full", max_steps=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(("lora_" in n) or ("modules_to_save" in n) for n in trainable)
    assert any("lora_B" in n for n in trainable) and any(
        "embed_tokens.modules_to_save" in n for n in trainable
    )
    assert (
        float(model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.detach().abs().sum()) > 0
    )

    # A LoRA run's Lightning checkpoint resumes exactly.
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    _, first = _fit(base, data_file, chat_tokenizer_dir, tmp_path / "a", max_steps=2, callbacks=[ckpt])
    _, second = _fit(
        base,
        data_file,
        chat_tokenizer_dir,
        tmp_path / "b",
        max_steps=4,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert first == {k: full[k] for k in (1, 2)} and second == {k: full[k] for k in (3, 4)}

    # The adapter is a PEFT adapter: only adapter (and fully trained) weights, loadable on the transformers model.
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as f:
        keys = list(f.keys())
    assert keys and all(("lora_" in k) or ("embed_tokens" in k) for k in keys)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    ids = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        ours = model.eval()(ids)
        torch.testing.assert_close(hf(ids).logits, ours, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(base)(ids).logits, ours, atol=1e-3)

    # Merging gives a plain fp32 checkpoint with the adapter model's logits.
    forge_convert(
        ["merge-lora", "--base", str(base), "--adapter", str(adapter), "--output", str(tmp_path / "merged")]
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, ours, atol=1e-4, rtol=1e-4)


def test_lora_config_validation_and_tied_embeddings():
    with pytest.raises(ValueError, match=r"lora.rank \(0\) must be a positive integer"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match=r"lora.dropout \(1.5\)"):
        LoRAConfig(dropout=1.5)
    with pytest.raises(ValueError, match="names a tied embedding"):
        tied = LLMConfig.from_preset("debug", tie_word_embeddings=True).to_hf()
        CausalLM.from_config(tied, lora={"modules_to_save": ["embed_tokens"]})
    model = CausalLM.from_config(
        "debug", lora={"rank": 2, "target_modules": ".*layers\\.0\\.self_attn\\.q_proj"}
    )
    adapted = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapted == [
        "model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "model.model.layers.0.self_attn.q_proj.lora_B.default.weight",
    ]

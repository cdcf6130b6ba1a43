"""Packed sequences: the same per-token loss and training as unpacked samples, and packed-batch FLOPs."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer

from forge_lightning.datamodules.gpt_dataset import TokenSequenceDataset
from forge_lightning.datamodules.indexed import IndexedDataset
from forge_lightning.datamodules.packing import PackedDataset, pad_collate
from forge_lightning.datamodules.sft import SFTDataModule
from forge_lightning.modules.layers import DocumentMask
from forge_lightning.modules.llm import CausalLM, DecoderLM, LLMConfig
from forge_lightning.modules.llm.config import attention_flops_per_token, llm_flops_per_token


def _samples(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(0, vocab, (n + 1,), generator=g)
        labels = tokens[1:].clone()
        labels[: n // 3] = -100  # a masked prompt
        out.append({"input_ids": tokens[:-1], "labels": labels})
    return out


def _token_losses(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_per_token_loss_equals_unpacked(backend):
    torch.manual_seed(0)
    model = DecoderLM(LLMConfig.from_preset("debug"), attention_backend=backend)
    samples = _samples([7, 12, 5, 9])
    packed = PackedDataset(samples, [[0, 1, 2, 3]], seq_length=40)[0]
    assert packed["position_ids"][:12].tolist() == [*range(7), *range(5)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention on CPU warns that it is unfused
        alone = torch.cat([_token_losses(model(s["input_ids"][None]), s["labels"]) for s in samples])
        batch = {k: v[None] for k, v in packed.items()}
        together = _token_losses(
            model(batch["input_ids"], document_ids=batch["document_ids"]), batch["labels"]
        )
    torch.testing.assert_close(together[:33], alone, rtol=1e-5, atol=1e-5)
    assert (together[33:] == 0).all()  # padding is ignored


def test_packed_gradients_equal_unpacked():
    torch.manual_seed(0)
    model = DecoderLM(LLMConfig.from_preset("debug"))
    samples = _samples([6, 11, 8], seed=1)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    alone = grads(sum(_token_losses(model(s["input_ids"][None]), s["labels"]).sum() for s in samples))
    batch = pad_collate([PackedDataset(samples, [[0, 1], [2]], seq_length=20)[i] for i in range(2)])
    logits = model(batch["input_ids"], document_ids=batch["document_ids"])
    together = grads(_token_losses(logits, batch["labels"]).sum())
    for name in alone:
        torch.testing.assert_close(together[name], alone[name], rtol=1e-4, atol=1e-6, msg=name)


class _Losses(Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])


def _records(count):
    words = ["hello there", "how are you", "fine thanks", "the weather", "kilometers", "goodbye"]
    return [
        {
            "instruction": " ".join(words[(i + k) % 6] for k in range(1 + i % 4)),
            "output": " ".join(words[(i * 5 + k) % 6] for k in range(1 + (i * 3) % 5)),
        }
        for i in range(count)
    ]


def _fit(tiny_config, tokenizer_dir, train, *, pack, batch_size, steps=3):
    torch.manual_seed(5)
    model = CausalLM.from_config(tiny_config, optimizer={"lr": 1e-2})
    data = SFTDataModule(
        str(train),
        str(tokenizer_dir),
        seq_length=64,
        pack=pack,
        batch_size=batch_size,
        num_workers=0,
        pin_memory=False,
    )
    losses = _Losses()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        callbacks=[losses],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(model, data)
    return losses.losses, data


def test_packed_and_unpacked_training_give_the_same_losses(tiny_config, chat_tokenizer_dir, write_jsonl):
    train = write_jsonl("train.jsonl", _records(10))
    # One step covers the whole data set either way, so both runs train on the same samples at every step.
    unpacked, _ = _fit(tiny_config, chat_tokenizer_dir, train, pack=False, batch_size=10)
    probe = SFTDataModule(str(train), str(chat_tokenizer_dir), seq_length=64, pack=True)
    probe.setup("fit")
    num_packs = len(probe.train_dataset)
    assert num_packs < 10
    packed, data = _fit(tiny_config, chat_tokenizer_dir, train, pack=True, batch_size=num_packs)
    assert sorted(unpacked) == sorted(packed) == [1, 2, 3]
    for step in unpacked:
        assert packed[step] == pytest.approx(unpacked[step], rel=1e-5)
    assert data.stats["train"].samples == 10


def test_packed_flops_count_actual_documents():
    model = CausalLM.from_config("debug")
    cfg = model.config
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1]])
    stats = model.batch_stats(
        {"input_ids": torch.zeros(2, 8, dtype=torch.long), "document_ids": document_ids}
    )
    dense = llm_flops_per_token(cfg, 8) - attention_flops_per_token(cfg, [8])
    expected = dense * 16 + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (9 + 4 + 9 + 36 + 4)
    assert stats["flops"] == pytest.approx(expected)
    assert stats["tokens"] == 16


def test_pretraining_with_reset_position_ids_uses_the_document_mask(tiny_corpus):
    data = TokenSequenceDataset(IndexedDataset(tiny_corpus["prefix"]), 64, reset_position_ids=True, seed=1)
    sample = next(data[i] for i in range(len(data)) if data[i]["document_ids"].max() > 0)
    torch.manual_seed(0)
    model = CausalLM.from_config({**LLMConfig.from_preset("debug", vocab_size=512).to_hf()})
    with torch.no_grad():
        packed_loss, tokens = model.loss_sum({k: v[None] for k, v in sample.items()})
        pieces = torch.unique_consecutive(sample["document_ids"], return_counts=True)[1].tolist()
        alone = sum(
            model.loss_sum({"input_ids": ids[None], "labels": labels[None]})[0]
            for ids, labels in zip(sample["input_ids"].split(pieces), sample["labels"].split(pieces))
        )
    assert tokens == 64
    torch.testing.assert_close(packed_loss, alone, rtol=1e-5, atol=1e-4)
    assert DocumentMask.build(sample["document_ids"][None], "sdpa").dense.shape == (1, 1, 64, 64)

"""Callbacks on a real tiny run: throughput figures, samples, HF export and the validation summary."""

import csv
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from tiny import TINY_LLM

from forge_lightning.callbacks import HFExport, TextSample, ThroughputMonitor, ValidationSummary
from forge_lightning.datamodules import PretrainDataModule
from forge_lightning.modules.llm import CausalLM, llm_flops_per_token

TINY = TINY_LLM


def test_callbacks_on_a_tiny_run(tiny_corpus, tmp_path):
    model = CausalLM.from_config(TINY, optimizer={"lr": 3e-3})
    data = PretrainDataModule(
        str(tiny_corpus["prefix"]),
        str(tiny_corpus["tokenizer"]),
        seq_length=32,
        batch_size=4,
        num_workers=0,
        pin_memory=False,
    )
    sample = TextSample(prompt="import ", max_new_tokens=6, every_n_steps=4)
    summary = ValidationSummary()
    export = HFExport()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=8,
        logger=CSVLogger(tmp_path, name="cb"),
        log_every_n_steps=1,
        callbacks=[ThroughputMonitor(window=2, peak_tflops=0.5), sample, summary, export],
        enable_progress_bar=False,
        enable_checkpointing=False,
        val_check_interval=8,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=-1,
    )
    trainer.fit(model, data)

    rows = list(csv.DictReader((Path(trainer.log_dir) / "metrics.csv").read_text().splitlines()))
    tput = [r for r in rows if r.get("throughput/tokens_per_sec")]
    assert len(tput) == 3  # 4 windows of 2 steps, the first skipped as warm-up
    flops_per_token = llm_flops_per_token(model.config, 32)
    for row in tput:
        tokens_per_s = float(row["throughput/tokens_per_sec_per_device"])
        assert float(row["throughput/tokens_per_sec"]) == pytest.approx(tokens_per_s)  # one device
        assert float(row["throughput/samples_per_sec"]) == pytest.approx(tokens_per_s / 32, rel=1e-6)
        tflops = float(row["throughput/tflops_per_device"])
        assert tflops == pytest.approx(tokens_per_s * flops_per_token / 1e12, rel=1e-6)
        assert float(row["throughput/mfu"]) == pytest.approx(tflops / 0.5, rel=1e-6)
        assert 0.0 <= float(row["throughput/data_wait_pct"]) < 100.0
        assert float(row["memory/peak_gb"]) > 0.0
        assert float(row["throughput/step_time_s"]) == pytest.approx(
            4 * 32 / tokens_per_s, rel=1e-6
        )  # 4 x 32 tokens a step

    assert [step for step, _ in sample.samples] == [4, 8, 8]  # every 4 steps, and at the end
    assert all(text.startswith("import ") and len(text) > len("import ") for _, text in sample.samples)

    # The sanity check (full validation before training) and the validation after step 8.
    assert [step for step, _ in summary.history] == [0, 8]
    first, last, rel = summary.change()
    assert last < first and rel == pytest.approx((last - first) / first)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert export.exported_to == Path(trainer.log_dir) / "hf"
    AutoModelForCausalLM.from_pretrained(export.exported_to)
    tok = AutoTokenizer.from_pretrained(export.exported_to)
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"

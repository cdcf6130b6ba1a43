"""Text samples from a language model during and after training."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override


class TextSample(Callback):
    """Generates a continuation of ``prompt`` with the model's KV-cache ``generate`` and prints / logs it.

    The tokenizer comes from the datamodule (``trainer.datamodule.tokenizer``).

    Args:
        prompt: text to continue.
        max_new_tokens: tokens to generate.
        temperature: 0 for greedy decoding, otherwise the sampling temperature.
        top_k: sample from the ``top_k`` most likely tokens (``None``: all).
        every_n_steps: also sample every ``n`` optimizer steps (``None``: only at the end of training).
        seed: seed of the sampling generator, so samples are reproducible.
    """

    def __init__(
        self,
        prompt: str = "def ",
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        every_n_steps: int | None = None,
        seed: int = 0,
    ) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.every_n_steps = every_n_steps
        self.seed = seed
        self.samples: list[tuple[int, str]] = []

    def sample(self, trainer: Trainer, pl_module: LightningModule) -> str:
        """Generate one continuation of the prompt and return prompt + continuation."""
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("TextSample needs a datamodule with a `tokenizer` attribute")
        ids = torch.tensor([tokenizer.encode(self.prompt)], device=pl_module.device)
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        out = pl_module.generate(
            ids,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            eos_token_id=getattr(tokenizer, "eos_token_id", None),
            generator=generator,
        )
        return self.prompt + tokenizer.decode(out[0, ids.shape[1] :].tolist())

    def _emit(self, trainer: Trainer, pl_module: LightningModule) -> None:
        text = self.sample(trainer, pl_module)
        self.samples.append((trainer.global_step, text))
        if trainer.is_global_zero:
            print(f"\n--- sample after {trainer.global_step} steps ---\n{text}\n---", flush=True)
            for logger in trainer.loggers:
                experiment: Any = getattr(logger, "experiment", None)
                if hasattr(experiment, "add_text"):
                    experiment.add_text("sample", text, trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        already = bool(self.samples) and self.samples[-1][0] == step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and not already:
            self._emit(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._emit(trainer, pl_module)


class TextPredictionWriter(BasePredictionWriter):
    """Decodes ``forge predict`` outputs (token ids) with the datamodule's tokenizer, prints them and writes JSONL.

    Args:
        output: JSONL file to append ``{"prompt", "completion"}`` records to (``None``: print only).
    """

    def __init__(self, output: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output = output

    @override
    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        import json

        tokenizer = trainer.datamodule.tokenizer
        prompt_len = batch["input_ids"].shape[1]
        for row_prompt, row in zip(batch["input_ids"], prediction):
            record = {
                "prompt": tokenizer.decode(row_prompt.tolist()),
                "completion": tokenizer.decode(row[prompt_len:].tolist()),
            }
            print(record["prompt"] + record["completion"], flush=True)
            if self.output is not None:
                with open(self.output, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")

"""Text samples from a language model during and after training, and what the generating callbacks share.

Under every strategy each rank calls the module's ``generate`` (a sharded model needs all its ranks for a
forward). Under several processes the ranks decode in lockstep: a forward may run collectives (FSDP2 gathers
each block's weights), so every rank runs the same number of ``generate`` calls of ``max_new_tokens`` steps each,
without stopping early at an end-of-sequence token; the answers are cut there afterwards, which gives the same
text as the early stop of a single process.

The module generates with the trained weights: under a strategy that trains another model than the module's own
(``MegatronStrategy``'s twin, :class:`~forge_lightning.contracts.SeparateWeights`) the callbacks decode within
:func:`~forge_lightning.contracts.module_weights`, which copies them, whole, into the module on every rank (a
collective every rank enters, once per evaluation); elsewhere it does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from forge_lightning.contracts import SeparateWeights, TextData, module_weights, tensor_parallel_size


def check_generation_layout(callback: Callback, trainer: Trainer) -> None:
    """Refuse, before any step, a parallel layout under which the module's ``generate`` is not supported.

    Tensor-parallel weights are refused: the model sizes its KV cache for all key / value heads, not for the
    share a tensor-parallel rank computes, and with ``sequence_parallel`` a rank holds only part of the positions,
    so decoding on TP shards fails or reads the wrong position. A strategy with separate weights (MegatronStrategy,
    whatever its TP size) is not refused: the module generates with whole weights copied in (``module_weights``).
    """
    if isinstance(trainer.strategy, SeparateWeights):
        return
    tp = tensor_parallel_size(trainer.strategy)
    if tp > 1:
        name = type(callback).__name__
        raise ValueError(
            f"{name} cannot generate under {type(trainer.strategy).__name__} with tensor_parallel_size={tp}: "
            "generation on tensor-parallel shards is not supported (the KV cache is sized for all heads). Use "
            f"tensor_parallel_size: 1 (FSDP2 alone shards the weights and generates), or leave {name} out and "
            "generate from the HFExport directory after training"
        )


def lockstep(trainer: Trainer) -> bool:
    """Whether the ranks must run the same decoding steps (see the module docstring): under several processes."""
    return trainer.world_size > 1


def through_first(ids: list[int], stop: int | Sequence[int] | None) -> list[int]:
    """``ids`` up to and including the first token in ``stop`` (all of them without one)."""
    stops = {stop} if isinstance(stop, int) else set(stop or ())
    for k, token in enumerate(ids):
        if token in stops:
            return ids[: k + 1]
    return ids


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

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_generation_layout(self, trainer)

    def sample(self, trainer: Trainer, pl_module: LightningModule) -> str:
        """Generate one continuation of the prompt and return prompt + continuation. Collective: every rank calls
        it (and gets the same text)."""
        if not isinstance(trainer.datamodule, TextData):
            raise ValueError(
                "TextSample needs a text datamodule (forge_lightning.contracts.TextData: a `tokenizer`, "
                f"`vocab_size` and `seq_length`), got {type(trainer.datamodule).__name__}"
            )
        tokenizer = trainer.datamodule.tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        with module_weights(trainer.strategy):  # the module's device is known within it
            ids = torch.tensor([tokenizer.encode(self.prompt)], device=pl_module.device)
            generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
            out = pl_module.generate(
                ids,
                max_new_tokens=self.max_new_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
                eos_token_id=None if lockstep(trainer) else eos,
                generator=generator,
            )
        return self.prompt + tokenizer.decode(through_first(out[0, ids.shape[1] :].tolist(), eos))

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

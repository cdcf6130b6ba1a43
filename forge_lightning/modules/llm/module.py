"""``CausalLM``: the LightningModule of decoder-only language models (pre-training; SFT and LoRA build on it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from forge_lightning.kernels import fused_linear_cross_entropy
from forge_lightning.modules.layers.attention import document_lengths
from forge_lightning.modules.llm.config import LLMConfig, attention_flops_per_token, llm_flops_per_token
from forge_lightning.modules.llm.generation import generate
from forge_lightning.modules.llm.hf import load_pretrained, save_pretrained
from forge_lightning.modules.llm.model import DecoderLM, block_tp_plan
from forge_lightning.modules.lora import LoRAConfig, apply_lora, save_adapter
from forge_lightning.modules.plan import Component, ParallelPlan
from forge_lightning.optim import OptimizerConfig, SchedulerConfig, build_optimizer, build_scheduler
from forge_lightning.optim.clipping import UnscaledGradientClipping
from forge_lightning.performance import PerformanceConfig, ResolvedPerformance, configure_performance, resolve

# Tensor-parallel styles of one decoder layer (relative names) and of the modules around the layers.
LLM_TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
    "input_layernorm": "sequence",
    "post_attention_layernorm": "sequence",
    "<root>.model.embed_tokens": "rowwise_embedding",
    "<root>.model.norm": "sequence",
    "<root>.lm_head": "colwise_output",
}


@dataclasses.dataclass(kw_only=True)
class GenerationConfig:
    """Decoding settings for ``predict`` and text samples.

    Args:
        max_new_tokens: tokens to generate per prompt.
        temperature: 0 for greedy decoding, otherwise the sampling temperature.
        top_k: sample only from the ``top_k`` most likely tokens (``None``: all).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None


def _as(cls: type, value: Any) -> Any:
    if value is None:
        return cls()
    return cls(**value) if isinstance(value, dict) else value


_DEFER_PRETRAINED: ContextVar[bool] = ContextVar("defer_pretrained", default=False)


@contextmanager
def deferred_pretrained() -> Iterator[None]:
    """Within it, ``CausalLM(pretrained=...)`` leaves its weights in the files: the native model is built on the
    meta device, and a strategy that builds its own model from the directory (``MegatronStrategy``, whose
    ``reads_pretrained_shards`` the CLI checks) reads on each rank only that rank's shards. Without LoRA only.
    """
    token = _DEFER_PRETRAINED.set(True)
    try:
        yield
    finally:
        _DEFER_PRETRAINED.reset(token)


class CausalLM(UnscaledGradientClipping, pl.LightningModule):
    """Decoder-only language model (Llama / Qwen2 / Qwen3 / Mistral style) built from a Hugging Face config.

    The loss is the mean cross-entropy over all trainable tokens (labels != ``ignore_index``) of the global batch,
    across gradient accumulation and data-parallel ranks, computed from the final hidden states with a fused
    linear + cross-entropy that never materialises the full fp32 logits.

    Args:
        config: HF config: a model directory, a ``config.json`` path, a dict, or a preset name (see
            ``forge_lightning.modules.llm.config.PRESETS``).
        pretrained: HF model directory to load weights from (``None``: random initialisation). Under
            :func:`deferred_pretrained` the weights stay in the files and the native model on the meta device.
        optimizer: optimizer settings (the CLI fills it from the top-level ``optimizer`` section).
        scheduler: learning-rate schedule (the CLI fills it from the top-level ``scheduler`` section).
        generation: decoding settings for ``predict`` and samples.
        z_loss: weight of the z-loss (``z_loss * logsumexp(logits)^2`` per token) that keeps logits small.
        ignore_index: label value excluded from the loss.
        performance: kernels, attention backends, FP8, activation checkpointing, compile and the optimizer
            implementation (see :class:`~forge_lightning.performance.PerformanceConfig`; the CLI fills it from the
            top-level ``performance`` section). Every strategy applies it.
        lora: LoRA adapters (see :class:`~forge_lightning.modules.lora.LoRAConfig`); only they (and
            ``modules_to_save``) train, and :meth:`save_pretrained` writes a PEFT adapter.
    """

    def __init__(
        self,
        config: str | dict[str, Any] = "quickstart",
        pretrained: str | None = None,
        *,
        optimizer: OptimizerConfig | dict[str, Any] | None = None,
        scheduler: SchedulerConfig | dict[str, Any] | None = None,
        generation: GenerationConfig | dict[str, Any] | None = None,
        z_loss: float = 0.0,
        ignore_index: int = -100,
        performance: PerformanceConfig | dict[str, Any] | None = None,
        lora: LoRAConfig | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = LLMConfig.load(config)
        self.optimizer_config: OptimizerConfig = _as(OptimizerConfig, optimizer)
        self.scheduler_config: SchedulerConfig = _as(SchedulerConfig, scheduler)
        self.generation_config: GenerationConfig = _as(GenerationConfig, generation)
        self.z_loss = z_loss
        self.ignore_index = ignore_index
        self.performance: PerformanceConfig = _as(PerformanceConfig, performance)
        self.lora_config: LoRAConfig | None = None if lora is None else _as(LoRAConfig, lora)
        # Plain containers only, so checkpoints load with weights_only=True.
        self.save_hyperparameters(
            {
                "config": self.config.to_hf(),
                "optimizer": dataclasses.asdict(self.optimizer_config),
                "scheduler": dataclasses.asdict(self.scheduler_config),
                "generation": dataclasses.asdict(self.generation_config),
                "z_loss": z_loss,
                "ignore_index": ignore_index,
                "performance": self.performance.to_dict(),
                "lora": None if self.lora_config is None else dataclasses.asdict(self.lora_config),
            }
        )
        self.pretrained = None if pretrained is None else str(pretrained)
        if pretrained is not None and _DEFER_PRETRAINED.get() and self.lora_config is None:
            # A strategy reads its own shards of the files (see deferred_pretrained): no full copy on this rank.
            with torch.device("meta"):
                self.model = DecoderLM(self.config, attention_backend=self.performance.attention.packed)
        else:
            self.model = DecoderLM(self.config, attention_backend=self.performance.attention.packed)
            if pretrained is not None:
                load_pretrained(self.model, pretrained)
        # The PEFT wrapper is kept outside the module tree: the adapted layers already live in self.model.
        self.__dict__["_peft_model"] = None
        if self.lora_config is not None:
            self.__dict__["_peft_model"] = apply_lora(
                self.model, self.lora_config, base_model_name_or_path=pretrained
            )
        self._loss_norm: tuple[int, torch.Tensor] | None = None
        self._step_loss_sum: torch.Tensor | None = None
        self._step_expert_load: torch.Tensor | None = None  # [MoE layers, experts] over the optimizer step
        self._eval_sums: torch.Tensor | None = None
        self._warned_no_step_tokens = False

    # ----- construction and interchange -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> CausalLM:
        """Build from a Hugging Face model directory (config.json + safetensors) and load its weights."""
        return cls(config=str(path), pretrained=str(path), **kwargs)

    @classmethod
    def from_config(cls, config: str | Path | dict[str, Any], **kwargs: Any) -> CausalLM:
        """Build with random weights from a HF config (directory, config.json, dict or preset name)."""
        return cls(config=config if isinstance(config, dict) else str(config), pretrained=None, **kwargs)

    def save_pretrained(
        self, path: str | Path, dtype: torch.dtype | None = None, overwrite: bool = False
    ) -> None:
        """Write a Hugging Face directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

        Under a strategy that shards parameters, every rank must call this. With LoRA, write the PEFT adapter
        instead (``adapter_config.json`` + ``adapter_model.safetensors``), which
        ``peft.PeftModel.from_pretrained`` loads onto the base model and ``forge-convert merge-lora`` merges.
        """
        if self._peft_model is not None:
            if self._trainer is None or self.trainer.is_global_zero:
                save_adapter(self._peft_model, path)
        else:
            # A strategy that shards parameters gathers them (collectively) to host memory on rank 0.
            gather = getattr(self.trainer.strategy, "full_model_state_dict", None) if self._trainer else None
            state = gather(self.model) if callable(gather) else None
            if self._trainer is None or self.trainer.is_global_zero:
                save_pretrained(
                    self.model, self.config, path, dtype=dtype, overwrite=overwrite, state_dict=state
                )
        if self._trainer is not None:
            self.trainer.strategy.barrier("save_pretrained")

    @override
    def configure_model(self) -> None:
        configure_performance(self)

    def _resolved_performance(self, device: torch.device) -> ResolvedPerformance:
        """The performance settings with every ``auto`` decided for ``device`` (cached per device type)."""
        cache = self.__dict__.setdefault("_resolved", {})
        if device.type not in cache:
            cache[device.type] = resolve(self.performance, device)
        return cache[device.type]

    def parallel_plan(self) -> ParallelPlan:
        """One component, ``llm``: its decoder layers are the repeated blocks."""
        layers = list(self.model.model.layers)
        # MoE and MLA layers shard other modules than LLM_TP_PLAN's dense ones: the model gives the block entries.
        root = {k: v for k, v in LLM_TP_PLAN.items() if k.startswith("<root>.")}
        tp_plan = {**block_tp_plan(layers), **root}
        return ParallelPlan(
            components=[Component(name="llm", module=self.model, blocks=layers, tp_plan=tp_plan)]
        )

    # ----- forward and loss ----------------------------------------------------------------------------------
    @override
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` of ``input_ids`` ``[batch, seq]`` (packed rows: with ``document_ids``)."""
        return self.model(input_ids, position_ids=position_ids, document_ids=document_ids)

    def loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-token losses, number of trainable tokens) of a micro-batch.

        A packed batch (``document_ids`` present) attends within each document only.
        """
        hidden_BSH = self.model.hidden_states(
            batch["input_ids"], position_ids=batch.get("position_ids"), document_ids=batch.get("document_ids")
        )
        labels_N = batch["labels"].reshape(-1)
        performance = self._resolved_performance(hidden_BSH.device)
        fp8 = performance.fp8
        loss = fused_linear_cross_entropy(
            hidden_BSH.reshape(-1, hidden_BSH.shape[-1]),
            self.model.lm_head.weight,
            labels_N,
            ignore_index=self.ignore_index,
            reduction="sum",
            z_loss=self.z_loss,
            backend=performance.kernels["cross_entropy"],
            fp8=fp8 is not None and fp8.lm_head,
            fast_accum=fp8 is not None and fp8.fast_accum,
        )
        return loss, (labels_N != self.ignore_index).sum()

    def _data_parallel_size(self) -> int:
        strategy = self.trainer.strategy
        return getattr(strategy, "data_parallel_size", None) or self.trainer.world_size

    def _global_step_tokens(self, batch: dict[str, torch.Tensor], local_tokens: torch.Tensor) -> torch.Tensor:
        """Trainable tokens in this optimizer step over all micro-batches and data-parallel ranks."""
        step = self.trainer.global_step
        if self._loss_norm is not None and self._loss_norm[0] == step:
            return self._loss_norm[1]
        step_tokens = batch.get("step_tokens")
        if step_tokens is None:
            if not self._warned_no_step_tokens:
                rank_zero_warn(
                    "batches carry no `step_tokens`: the loss is normalised per micro-batch, so gradient "
                    "accumulation weights micro-batches equally. Use a forge-lightning datamodule for exact "
                    "global-batch normalisation."
                )
                self._warned_no_step_tokens = True
            step_tokens = local_tokens * self.trainer.accumulate_grad_batches
        total = self.trainer.strategy.reduce(
            step_tokens.to(self.device, torch.float64).clone(), reduce_op="sum"
        )
        self._loss_norm = (step, total.clamp_min(1))
        return self._loss_norm[1]

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss_sum, local_tokens = self.loss_sum(batch)
        total = self._global_step_tokens(batch, local_tokens)
        detached = loss_sum.detach().to(torch.float64)
        self._step_loss_sum = detached if self._step_loss_sum is None else self._step_loss_sum + detached
        # Lightning divides by accumulate_grad_batches and data parallelism averages over ranks: undo both so
        # the gradient is that of (sum of token losses of the global batch) / (its trainable tokens).
        scale = self.trainer.accumulate_grad_batches * self._data_parallel_size()
        loss = loss_sum * (scale / total).to(loss_sum.dtype)
        router_loss = self._moe_aux_losses()
        return loss if router_loss is None else loss + router_loss.to(loss.dtype)

    def _moe_aux_losses(self) -> torch.Tensor | None:
        """Weighted router losses of the last forward (``None`` for a dense model), logging them and the expert load.

        They are per-micro-batch means, so Lightning's division by the accumulation steps and the data-parallel
        gradient average make the optimizer step use their mean over the global batch.
        """
        router = self.model.router_losses()
        if router is None:
            return None
        moe = self.config.moe
        load_LE = router.tokens_per_expert
        if moe.bias_update_rate:
            step = self._step_expert_load
            self._step_expert_load = load_LE if step is None else step + load_LE
        self.log("train/router_aux_loss", router.aux_loss.detach().float(), rank_zero_only=True)
        self.log("train/router_z_loss", router.z_loss.detach().float(), rank_zero_only=True)
        self.log(
            "moe/expert_load_max_over_mean", (load_LE.amax(-1) / load_LE.mean(-1)).mean(), rank_zero_only=True
        )
        return moe.aux_loss_coef * router.aux_loss + moe.z_loss_coef * router.z_loss

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._update_expert_bias()
        if self._step_loss_sum is None or self._loss_norm is None:
            return
        total_loss = self.trainer.strategy.reduce(self._step_loss_sum, reduce_op="sum")
        self.log("train/loss", (total_loss / self._loss_norm[1]).float(), prog_bar=True, rank_zero_only=True)
        self._step_loss_sum = None

    @torch.no_grad()
    def _update_expert_bias(self) -> None:
        """Auxiliary-loss-free balancing (``moe.bias_update_rate``): move each MoE layer's selection bias towards
        balance by the loads of the step's global batch (summed over its micro-batches and data-parallel ranks)."""
        load_LE, self._step_expert_load = self._step_expert_load, None
        if load_LE is None:
            return
        load_LE = self.trainer.strategy.reduce(load_LE, reduce_op="sum")
        step_LE = torch.sign(load_LE.mean(dim=-1, keepdim=True) - load_LE) * self.config.moe.bias_update_rate
        for block, step_E in zip(self.model.moe_blocks(), step_LE, strict=True):
            bias = block.gate.e_score_correction_bias
            bias.add_(step_E.to(bias.device, bias.dtype))

    # ----- evaluation ----------------------------------------------------------------------------------------
    def _eval_step(self, batch: dict[str, torch.Tensor]) -> None:
        loss_sum, tokens = self.loss_sum(batch)
        sums = torch.stack([loss_sum.detach().double(), tokens.double()])
        self._eval_sums = sums if self._eval_sums is None else self._eval_sums + sums

    def _eval_log(self, prefix: str) -> None:
        sums = self._eval_sums if self._eval_sums is not None else torch.zeros(2, dtype=torch.float64)
        sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum")
        self._eval_sums = None
        if sums[1] > 0:
            loss = (sums[0] / sums[1]).float()
            self.log(f"{prefix}/loss", loss, prog_bar=True, rank_zero_only=True)
            self.log(f"{prefix}/ppl", loss.exp(), rank_zero_only=True)

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    @override
    def on_validation_epoch_end(self) -> None:
        self._eval_log("val")

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    @override
    def on_test_epoch_end(self) -> None:
        self._eval_log("test")

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        cfg = self.generation_config
        return self.generate(
            batch["input_ids"],
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
        )

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Greedy or sampled continuation with a KV cache; see ``forge_lightning.modules.llm.generation``."""
        return generate(self.model, input_ids, **kwargs)

    # ----- optimisation and bookkeeping ------------------------------------------------------------------------
    @override
    def configure_optimizers(self) -> dict[str, Any]:
        device = next(self.model.parameters()).device
        implementation = self._resolved_performance(device).optimizer
        optimizer = build_optimizer(self.model, self.optimizer_config, implementation=implementation)
        total = self.scheduler_config.total_steps or int(self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(optimizer, self.scheduler_config, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def batch_stats(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Samples, tokens and training FLOPs of a micro-batch (for the throughput monitor).

        For packed batches the attention FLOPs are those of the actual documents (``document_ids``), not of a
        full ``seq x seq`` square per row.
        """
        batch_size, seq_len = batch["input_ids"].shape
        tokens = batch_size * seq_len
        flops = llm_flops_per_token(self.config, seq_len) * tokens
        document_ids = batch.get("document_ids")
        if document_ids is not None:
            lengths = document_lengths(document_ids).tolist()
            dense = attention_flops_per_token(self.config, [seq_len])
            flops += (attention_flops_per_token(self.config, lengths) - dense) * tokens
        return {"samples": batch_size, "tokens": tokens, "flops": flops}

    @override
    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        seq_length = getattr(datamodule, "seq_length", None)
        if seq_length is not None and seq_length > self.config.max_position_embeddings:
            raise ValueError(
                f"data.seq_length ({seq_length}) is longer than the model's max_position_embeddings "
                f"({self.config.max_position_embeddings}): shorten the sequences or use a model with longer context"
            )
        vocab = getattr(datamodule, "vocab_size", None)
        if vocab is not None and vocab > self.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} tokens but the model's vocab_size is {self.config.vocab_size}: "
                "use the model's own tokenizer or set vocab_size in the model config to at least the tokenizer's"
            )

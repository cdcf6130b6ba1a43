"""``CausalLM``: the LightningModule of decoder-only language models (pre-training; SFT and LoRA build on it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from forge_lightning.contracts import (
    Component,
    ParallelPlan,
    TextData,
    full_state_dict,
    pretrained_deferred,
)
from forge_lightning.modules.layers.attention import document_lengths
from forge_lightning.modules.layers.moe import RouterLosses
from forge_lightning.modules.llm.config import LLMConfig, attention_flops_per_token, llm_flops_per_token
from forge_lightning.modules.llm.generation import generate
from forge_lightning.modules.llm.hf import load_pretrained, save_pretrained
from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.model import DecoderLM
from forge_lightning.modules.llm.mtp import mtp_loss_sum
from forge_lightning.modules.lora import LoRAConfig, apply_lora, save_adapter
from forge_lightning.modules.objective import GlobalBatchLoss, TokenLossSteps
from forge_lightning.optim import OptimizerConfig, SchedulerConfig, build_optimizer, build_scheduler
from forge_lightning.optim.clipping import UnscaledGradientClipping
from forge_lightning.performance import PerformanceConfig, configure_performance, resolve_for

if TYPE_CHECKING:
    from forge_lightning.contracts import MegatronBuild
    from forge_lightning.modules.llm.megatron import DecoderTwin


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


def router_loss_term(module: pl.LightningModule, config: LLMConfig, router: RouterLosses) -> torch.Tensor:
    """The weighted router losses a training step adds to its loss (``moe.aux_loss_coef`` times the load-balancing
    loss plus ``moe.z_loss_coef`` times the z-loss), logging both and the expert load on ``module``.

    They are per-micro-batch means, so Lightning's division by the accumulation steps and the data-parallel gradient
    average make the optimizer step use their mean over the global batch.

    Args:
        module: the LightningModule that logs them.
        config: the LLM's config (its ``moe`` weights).
        router: the LLM's router losses of the step's forward (:meth:`DecoderLM.router_losses`).
    """
    load_LE = router.tokens_per_expert
    module.log("train/router_aux_loss", router.aux_loss.detach().float(), rank_zero_only=True)
    module.log("train/router_z_loss", router.z_loss.detach().float(), rank_zero_only=True)
    module.log(
        "moe/expert_load_max_over_mean", (load_LE.amax(-1) / load_LE.mean(-1)).mean(), rank_zero_only=True
    )
    return config.moe.aux_loss_coef * router.aux_loss + config.moe.z_loss_coef * router.z_loss


def _check_mtp(config: LLMConfig, weight: float) -> None:
    """Multi-token prediction needs both its modules and a positive weight (modules without one never train)."""
    depths = config.num_nextn_predict_layers
    if weight < 0:
        raise ValueError(f"mtp_loss_weight ({weight}) must be non-negative")
    if weight and not depths:
        raise ValueError(
            f"mtp_loss_weight ({weight}) needs multi-token prediction modules: set num_nextn_predict_layers "
            "(DeepSeek-V3: 1) in the model config, or mtp_loss_weight to 0"
        )
    if depths and not weight:
        raise ValueError(
            f"num_nextn_predict_layers ({depths}) builds multi-token prediction modules that only a positive "
            "mtp_loss_weight trains (DeepSeek-V3: 0.3, then 0.1): set it, or num_nextn_predict_layers to 0"
        )


class CausalLM(UnscaledGradientClipping, TokenLossSteps, pl.LightningModule):
    """Decoder-only language model (Llama / Qwen2 / Qwen3 / Mistral style) built from a Hugging Face config.

    The loss (:class:`~forge_lightning.modules.llm.loss.LMLoss`) is the mean cross-entropy over all trainable tokens
    (labels != ``ignore_index``) of the global batch, across gradient accumulation and data-parallel ranks
    (:class:`~forge_lightning.modules.objective.GlobalBatchLoss`), computed from the final hidden states with a
    fused linear + cross-entropy that never materialises the full fp32 logits. Under ``MegatronStrategy`` the same
    loss runs on the module's megatron-core twin (:meth:`megatron_model`).

    Args:
        config: HF config: a model directory, a ``config.json`` path, a dict, or a preset name (see
            ``forge_lightning.modules.llm.config.PRESETS``).
        pretrained: HF model directory to load weights from (``None``: random initialisation). Under
            :func:`~forge_lightning.contracts.deferred_pretrained` the weights stay in the files and the native
            model on the meta device (without LoRA).
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
        num_nextn_predict_layers: DeepSeek-V3's multi-token prediction modules to build and train (``D``; the
            config's field of that name, which a Hugging Face ``config.json`` does not set: see
            :class:`~forge_lightning.modules.llm.config.LLMConfig`); 0 keeps the config's (none unless a preset or
            config object sets it).
        mtp_loss_weight: DeepSeek-V3's multi-token prediction weight ``lambda`` (0.3, then 0.1 in its pre-training):
            the training loss adds ``lambda / D`` times the ``D = config.num_nextn_predict_layers`` depths' summed
            cross-entropies over the main loss's trainable tokens (see ``forge_lightning.modules.llm.mtp``), logged
            as ``train/mtp_loss`` (their mean over depths). Must be positive with MTP modules, 0 without.
    """

    # The performance switches the module applies itself (the strategy applies the others; see
    # forge_lightning.performance.switches): the loss kernel and its FP8 head, the packed-attention kernel, the
    # optimizer implementation.
    performance_switches = frozenset(
        {"kernels.cross_entropy", "attention.packed", "optimizer", "fp8.lm_head", "fp8.fast_accum"}
    )

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
        num_nextn_predict_layers: int = 0,
        mtp_loss_weight: float = 0.0,
    ) -> None:
        super().__init__()
        self.config = LLMConfig.load(config)
        if num_nextn_predict_layers:
            self.config = dataclasses.replace(self.config, num_nextn_predict_layers=num_nextn_predict_layers)
        _check_mtp(self.config, mtp_loss_weight)
        self.mtp_loss_weight = mtp_loss_weight
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
                "num_nextn_predict_layers": num_nextn_predict_layers,
                "mtp_loss_weight": mtp_loss_weight,
            }
        )
        self.pretrained = None if pretrained is None else str(pretrained)
        if pretrained is not None and pretrained_deferred() and self.lora_config is None:
            # A strategy reads its own shards of the files (see deferred_pretrained): no full copy on this rank.
            with torch.device("meta"):
                self.model = DecoderLM(self.config, attention_backend=self.performance.attention.packed)
        elif pretrained is not None:
            # Built on the meta device, the checkpoint's tensors become the parameters: no random init first.
            with torch.device("meta"):
                self.model = DecoderLM(self.config, attention_backend=self.performance.attention.packed)
            load_pretrained(self.model, pretrained)
        else:
            self.model = DecoderLM(self.config, attention_backend=self.performance.attention.packed)
        # The PEFT wrapper is kept outside the module tree: the adapted layers already live in self.model.
        self.__dict__["_peft_model"] = None
        if self.lora_config is not None:
            self.__dict__["_peft_model"] = apply_lora(
                self.model, self.lora_config, base_model_name_or_path=pretrained
            )
        self.objective = GlobalBatchLoss()
        self._step_expert_load: torch.Tensor | None = None  # [MoE layers, experts] over the optimizer step

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
            # Under a sharding strategy the adapted model's own tensors are shards: gather them first.
            state = full_state_dict(self.trainer.strategy, self.model) if self._trainer is not None else None
            if self._trainer is None or self.trainer.is_global_zero:
                save_adapter(self._peft_model, path, state_dict=state)
        else:
            # A strategy that shards parameters (or trains another copy) gathers them collectively to rank 0.
            state = full_state_dict(self.trainer.strategy, self.model) if self._trainer is not None else None
            if self._trainer is None or self.trainer.is_global_zero:
                save_pretrained(
                    self.model, self.config, path, dtype=dtype, overwrite=overwrite, state_dict=state
                )
        if self._trainer is not None:
            self.trainer.strategy.barrier("save_pretrained")

    @override
    def configure_model(self) -> None:
        configure_performance(self)

    def parallel_plan(self) -> ParallelPlan:
        """One component, ``llm``: its decoder layers are the repeated blocks; the model gives its TP plan and the
        sizes a TP degree must divide; the MoE layers' routed experts are its expert stacks."""
        component = Component(
            name="llm",
            module=self.model,
            blocks=list(self.model.model.layers),
            tp_plan=self.model.tp_plan(),
            tp_dims=self.model.tp_dims(),
            experts=[block.experts for block in self.model.moe_blocks()],
        )
        return ParallelPlan(components=[component])

    def megatron_model(self, build: MegatronBuild) -> DecoderTwin:
        """The megatron-core twin of the decoder for ``MegatronStrategy`` (the strategy's contract,
        :class:`~forge_lightning.contracts.MegatronModule`): the same loss and bookkeeping as natively."""
        from forge_lightning.modules.llm.megatron import DecoderTwin

        if self.lora_config is not None:
            raise NotImplementedError(
                "LoRA is not yet supported by MegatronStrategy: train LoRA adapters with FSDP2Strategy or "
                "DDPStrategy"
            )
        return DecoderTwin(
            self.model,
            build,
            loss=LMLoss(ignore_index=self.ignore_index, z_loss=self.z_loss),
            objective=self.objective,
            log=self.log,
            pretrained=self.pretrained,
        )

    def lm_loss(self, device: torch.device) -> LMLoss:
        """The loss with the kernel settings resolved for ``device`` (``performance.kernels.cross_entropy``,
        ``performance.fp8.lm_head`` / ``fast_accum``)."""
        return LMLoss.for_run(resolve_for(self, device), ignore_index=self.ignore_index, z_loss=self.z_loss)

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
        return self._loss_sum(self._hidden_states(batch), batch)

    def _hidden_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model.hidden_states(
            batch["input_ids"], position_ids=batch.get("position_ids"), document_ids=batch.get("document_ids")
        )

    def _loss_sum(
        self, hidden_BSH: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self.lm_loss(hidden_BSH.device)
        return loss(
            hidden_BSH.reshape(-1, hidden_BSH.shape[-1]),
            self.model.lm_head.weight,
            batch["labels"].reshape(-1),
        )

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.mtp_loss_weight:  # the main loss from the hidden states the MTP modules start from
            hidden_BSH = self._hidden_states(batch)
            loss_sum, tokens = self._loss_sum(hidden_BSH, batch)
            loss = self.objective.training_loss(self, batch, loss_sum, tokens)
            loss = loss + self._mtp_loss(hidden_BSH, batch, tokens).to(loss.dtype)
        else:
            loss_sum, tokens = self.loss_sum(batch)
            loss = self.objective.training_loss(self, batch, loss_sum, tokens)
        router_loss = self._moe_aux_losses()
        return loss if router_loss is None else loss + router_loss.to(loss.dtype)

    def _mtp_loss(
        self, hidden_BSH: torch.Tensor, batch: dict[str, torch.Tensor], tokens: torch.Tensor
    ) -> torch.Tensor:
        """``lambda / D`` times the MTP depths' summed cross-entropies, scaled by the one batch rule as the main
        loss's sum (over the global batch's main trainable tokens); logs ``train/mtp_loss``, the micro-batch's
        mean over depths of their sums over its main trainable tokens (the paper's ``L_k``)."""
        total, per_depth = mtp_loss_sum(self.model, hidden_BSH, batch, self.lm_loss(hidden_BSH.device))
        depths = per_depth.numel()
        mean = per_depth.detach().float().sum() / depths / tokens.clamp_min(1)
        self.log("train/mtp_loss", mean, rank_zero_only=True)
        return total * self.objective.gradient_scale(self, batch, tokens) * (self.mtp_loss_weight / depths)

    def _moe_aux_losses(self) -> torch.Tensor | None:
        """Weighted router losses of the last forward (``None`` for a dense model), logging them and the expert load
        (see :func:`router_loss_term`); the loads also feed the selection-bias update."""
        router = self.model.router_losses()
        if router is None:
            return None
        if self.config.moe.bias_update_rate:
            step, load_LE = self._step_expert_load, router.tokens_per_expert
            self._step_expert_load = load_LE if step is None else step + load_LE
        return router_loss_term(self, self.config, router)

    def optimizer_step_skipped(self) -> None:
        """The coming step is left out (:class:`~forge_lightning.contracts.SkippedStepAware`): so is its expert-bias
        update."""
        self._step_expert_load = None

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._update_expert_bias()
        self.objective.log_train(self)

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

    # ----- evaluation (steps: TokenLossSteps) ---------------------------------------------------------------
    def _eval_log(self, prefix: str) -> torch.Tensor | None:
        loss = self.objective.log_eval(self, prefix)
        if loss is not None:
            self.log(f"{prefix}/ppl", loss.exp(), rank_zero_only=True)
        return loss

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
        implementation = resolve_for(self, device).optimizer
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
        if not isinstance(datamodule, TextData):
            return
        seq_length = datamodule.seq_length
        if seq_length is not None and seq_length > self.config.max_position_embeddings:
            raise ValueError(
                f"data.seq_length ({seq_length}) is longer than the model's max_position_embeddings "
                f"({self.config.max_position_embeddings}): shorten the sequences or use a model with longer context"
            )
        vocab = datamodule.vocab_size
        if vocab > self.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} tokens but the model's vocab_size is {self.config.vocab_size}: "
                "use the model's own tokenizer or set vocab_size in the model config to at least the tokenizer's"
            )

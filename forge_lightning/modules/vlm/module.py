"""``VisionLanguageModule``: the LightningModule that trains vision-language models composed from config.

A batch is what :class:`~forge_lightning.datamodules.vlm.VLMDataModule` yields (``input_ids``, ``attention_mask``,
pre-shifted ``labels``, the pixel inputs of its images); the loss is the LLM family's (:class:`LMLoss` on the final
hidden states, normalised over the global batch's trainable tokens by :class:`GlobalBatchLoss`)::

    model:
      class_path: forge_lightning.modules.vlm.VisionLanguageModule
      init_args:
        config:                                     # what build_vlm takes: sections, presets, checkpoints
          vision: {pretrained: path/to/siglip}
          projector: mlp
          llm: {pretrained: path/to/qwen3}
          image_token_id: 151655
        components:                                 # per component: vision, projector, llm
          vision: {freeze: true}
          projector: {lr: 1.0e-3}
          llm: {lora: {rank: 16}, activation_checkpointing: full}
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from forge_lightning.contracts import (
    Component,
    MegatronBuild,
    ParallelPlan,
    TextData,
    VisionTextData,
    full_state_dict,
)
from forge_lightning.modules.layers.attention import document_lengths
from forge_lightning.modules.llm.config import attention_flops_per_token, llm_flops_per_token
from forge_lightning.modules.llm.generation import generate
from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.module import GenerationConfig, router_loss_term
from forge_lightning.modules.lora import LoRAConfig, apply_lora, merged_state_dict, save_adapter
from forge_lightning.modules.objective import GlobalBatchLoss, TokenLossSteps
from forge_lightning.modules.vlm.compose import build_vlm
from forge_lightning.modules.vlm.config import VLMConfig
from forge_lightning.modules.vlm.hf import from_pretrained, save_pretrained
from forge_lightning.modules.vlm.megatron import composition, megatron_twin
from forge_lightning.modules.vlm.model import VisionLanguageModel
from forge_lightning.optim import (
    OptimizerConfig,
    SchedulerConfig,
    build_scheduler,
    component_param_groups,
    optimizer_for_groups,
)
from forge_lightning.optim.clipping import UnscaledGradientClipping
from forge_lightning.performance import PerformanceConfig, configure_performance, resolve_for

if TYPE_CHECKING:
    from forge_lightning.modules.llm.megatron import DecoderTwin

COMPONENTS = ("vision", "projector", "llm")
"""The parallel-plan components of a vision-language model."""

MODEL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "image_sizes",
    "batch_num_images",
)
"""Batch keys passed to :class:`VisionLanguageModel` beside ``input_ids`` and ``attention_mask``."""

PACKED_INPUTS = ("document_ids", "position_ids")
"""Batch keys of packed rows (several samples per row) passed to :class:`VisionLanguageModel` for training."""

_AC_MODES = ("none", "full", "selective")


@dataclasses.dataclass(kw_only=True)
class ComponentSettings:
    """How one component trains.

    Args:
        freeze: keep its parameters fixed (no gradients, no optimizer state).
        lr: its peak learning rate (default: ``optimizer.lr``).
        lora: LoRA adapters on its linear layers (:class:`~forge_lightning.modules.lora.LoRAConfig`); then only
            they (and its ``modules_to_save``) train in this component.
        activation_checkpointing: its blocks' mode (``none``, ``full``, ``selective``) in place of the run's
            ``performance.activation_checkpointing``.
        compile: ``torch.compile`` its blocks (or not) in place of the run's ``performance.compile``.
    """

    freeze: bool = False
    lr: float | None = None
    lora: LoRAConfig | None = None
    activation_checkpointing: str | None = None
    compile: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora, Mapping):
            self.lora = LoRAConfig(**self.lora)
        if self.freeze and self.lora is not None:
            raise ValueError("freeze and lora exclude each other: a frozen component trains no adapters")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr ({self.lr}) must be positive")
        if self.activation_checkpointing not in (None, *_AC_MODES):
            raise ValueError(
                f"activation_checkpointing ({self.activation_checkpointing!r}) must be one of {', '.join(_AC_MODES)}"
            )


def _as(cls: type, value: Any) -> Any:
    if value is None:
        return cls()
    return cls(**value) if isinstance(value, Mapping) else value


def _component_settings(components: Mapping[str, Any] | None) -> dict[str, ComponentSettings]:
    settings = {}
    for name, value in dict(components or {}).items():
        if name not in COMPONENTS:
            raise ValueError(
                f"components.{name}: unknown component; the components are {', '.join(COMPONENTS)}"
            )
        try:
            settings[name] = _as(ComponentSettings, value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"components.{name}: {err}") from err
    return {name: settings.get(name, ComponentSettings()) for name in COMPONENTS}


def _plain(value: Any) -> Any:
    """``value`` with dataclasses turned into dicts (checkpoints hold plain containers only)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class VisionLanguageModule(UnscaledGradientClipping, TokenLossSteps, pl.LightningModule):
    """Vision-language model training (SFT of Qwen2.5-VL, LLaVA or a composition of an encoder and an LLM).

    Args:
        config: the model: a mapping for :func:`~forge_lightning.modules.vlm.build_vlm` (``vision``,
            ``projector``, ``llm`` sections, each a config, a type / preset or ``{pretrained: <directory>}``; the
            token ids), or a Hugging Face VLM directory / ``config.json`` path (config only). ``None`` with
            ``pretrained``: that checkpoint's config.
        pretrained: a whole VLM checkpoint (Qwen2.5-VL, LLaVA: ``config.json`` + safetensors) to load.
        components: per-component settings (:class:`ComponentSettings`) by name: ``vision``, ``projector``,
            ``llm``.
        optimizer: optimizer settings (the CLI fills it from the top-level ``optimizer`` section).
        scheduler: learning-rate schedule (the CLI fills it from the top-level ``scheduler`` section).
        generation: decoding settings for ``predict``.
        z_loss: weight of the z-loss (``z_loss * logsumexp(logits)^2`` per trainable token).
        ignore_index: label value excluded from the loss.
        performance: kernels, attention backend, activation checkpointing, compile and the optimizer
            implementation (the CLI fills it from the top-level ``performance`` section); ``components`` may set
            checkpointing and compile per component.
    """

    # The switches the module applies itself (the strategy applies the others): the loss kernel and its FP8 head,
    # the attention kernel of the LLM and the Qwen encoder, the optimizer implementation.
    performance_switches = frozenset(
        {"kernels.cross_entropy", "attention.packed", "optimizer", "fp8.lm_head", "fp8.fast_accum"}
    )

    def __init__(
        self,
        config: str | dict[str, Any] | None = None,
        pretrained: str | None = None,
        *,
        components: dict[str, Any] | None = None,
        optimizer: OptimizerConfig | dict[str, Any] | None = None,
        scheduler: SchedulerConfig | dict[str, Any] | None = None,
        generation: GenerationConfig | dict[str, Any] | None = None,
        z_loss: float = 0.0,
        ignore_index: int = -100,
        performance: PerformanceConfig | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if config is None and pretrained is None:
            raise ValueError("give the model's config, a pretrained checkpoint directory, or both")
        self.components = _component_settings(components)
        self.optimizer_config: OptimizerConfig = _as(OptimizerConfig, optimizer)
        self.scheduler_config: SchedulerConfig = _as(SchedulerConfig, scheduler)
        self.generation_config: GenerationConfig = _as(GenerationConfig, generation)
        self.performance: PerformanceConfig = _as(PerformanceConfig, performance)
        self.z_loss, self.ignore_index = z_loss, ignore_index
        self.pretrained = None if pretrained is None else str(pretrained)
        self.model: VisionLanguageModel = self._build(config, self.performance.attention.packed)
        self.config: VLMConfig = self.model.config
        # Plain containers only, so checkpoints load with weights_only=True.
        self.save_hyperparameters(
            {
                "config": _plain(config),
                "pretrained": self.pretrained,
                "components": {name: _plain(s) for name, s in self.components.items()},
                "optimizer": dataclasses.asdict(self.optimizer_config),
                "scheduler": dataclasses.asdict(self.scheduler_config),
                "generation": dataclasses.asdict(self.generation_config),
                "z_loss": z_loss,
                "ignore_index": ignore_index,
                "performance": self.performance.to_dict(),
            }
        )
        # The PEFT wrappers are kept outside the module tree: the adapted layers already live in self.model.
        self.__dict__["_peft"] = {}
        for name, settings in self.components.items():
            module = getattr(self.model, name)
            if settings.freeze:
                module.requires_grad_(False)
            elif settings.lora is not None:
                self._peft[name] = apply_lora(module, settings.lora, base_model_name_or_path=self.pretrained)
        self._freeze_unused_vision()
        moe = self.config.llm.moe
        if moe is not None and moe.bias_update_rate:
            raise ValueError(
                f"llm.moe.bias_update_rate ({moe.bias_update_rate}) is not supported for a vision-language model: "
                "its selection bias would stay fixed; set it to 0 (or balance with moe.aux_loss_coef)"
            )
        self.objective = GlobalBatchLoss()

    def _freeze_unused_vision(self) -> None:
        """Freeze the encoder's parameters its features never reach (their adapters too): they would get no
        gradient, which DDP refuses ("parameters that were not used in producing the loss") and which would only
        hold optimizer state for nothing. Their values stay as loaded, as in transformers' training."""
        prefixes = tuple(f"{name}." for name in self.model.tower.unused_modules(self.model.vision))
        unused = [
            p
            for n, p in self.model.vision.named_parameters()
            if p.requires_grad and f"{n}.".startswith(prefixes)
        ]
        for param in unused:
            param.requires_grad_(False)
        if unused:
            rank_zero_info(
                f"vision: {len(unused)} parameters frozen, outside the features the LLM gets ({', '.join(p[:-1] for p in prefixes)})"
            )

    def _build(self, config: str | Mapping[str, Any] | None, attention_backend: str) -> VisionLanguageModel:
        if self.pretrained is not None:
            model = from_pretrained(self.pretrained, attention_backend=attention_backend)
            if config is not None:
                expected = _config_of(config)
                if dataclasses.asdict(expected) != dataclasses.asdict(model.config):
                    raise ValueError(
                        f"config differs from the config.json of pretrained ({self.pretrained}): leave config out "
                        "to use the checkpoint's, or compose the model from component checkpoints in config"
                    )
            return model
        if isinstance(config, str):
            return VisionLanguageModel(_config_of(config), attention_backend=attention_backend)
        return build_vlm(config, attention_backend=attention_backend)

    # ----- construction and interchange -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> VisionLanguageModule:
        """Build from a Hugging Face VLM directory (config.json + safetensors) and load its weights."""
        return cls(config=None, pretrained=str(path), **kwargs)

    def save_pretrained(
        self, path: str | Path, dtype: torch.dtype | None = None, overwrite: bool = False
    ) -> None:
        """Write a checkpoint of the model's family that transformers loads (``Qwen2_5_VLForConditionalGeneration``,
        ``LlavaForConditionalGeneration``), LoRA adapters merged into the weights; the adapters themselves go to
        ``adapters/<component>`` (PEFT format, names relative to the component).

        Under a strategy that shards parameters, every rank must call this.
        """
        attached = self._trainer is not None
        # A strategy that shards parameters gathers them collectively to rank 0; the others leave them whole here.
        state = full_state_dict(self.trainer.strategy, self.model) if attached else None
        if state is None:
            state = self.model.state_dict()
        if not attached or self.trainer.is_global_zero:
            adapted = {}  # the adapted components' state dicts, adapters included, names relative to each
            for name, settings in self.components.items():
                if settings.lora is not None:
                    prefix = f"{name}."
                    adapted[name] = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
                    merged = merged_state_dict(adapted[name], settings.lora)
                    state = {k: v for k, v in state.items() if not k.startswith(prefix)}
                    state.update({prefix + k: v for k, v in merged.items()})
            save_pretrained(self.model, self.config, path, dtype=dtype, overwrite=overwrite, state_dict=state)
            for name, peft_model in self._peft.items():
                save_adapter(peft_model, Path(path) / "adapters" / name, state_dict=adapted[name])
        if attached:
            self.trainer.strategy.barrier("save_pretrained")

    @override
    def configure_model(self) -> None:
        if self._trainer is not None:  # ``load_from_checkpoint`` calls it without a trainer: nothing to apply
            configure_performance(self)

    def parallel_plan(self) -> ParallelPlan:
        """Components ``vision`` (its transformer blocks), ``projector`` (no blocks) and ``llm`` (its decoder layers,
        TP plan and the sizes a TP degree must divide), each frozen and checkpointed / compiled as its settings
        say, and how vision and projector feed the LLM (the composition MegatronStrategy recomposes, see
        :mod:`~forge_lightning.modules.vlm.megatron`)."""
        m = self.model
        blocks = {"vision": m.tower.blocks(m.vision), "projector": [], "llm": list(m.llm.model.layers)}
        return ParallelPlan(
            components=[
                Component(
                    name=name,
                    module=getattr(m, name),
                    blocks=blocks[name],
                    tp_plan=m.llm.tp_plan() if name == "llm" else {},
                    tp_dims=m.llm.tp_dims() if name == "llm" else {},
                    frozen=settings.freeze,
                    activation_checkpointing=settings.activation_checkpointing,
                    compile=settings.compile,
                )
                for name, settings in self.components.items()
            ],
            composition=composition(m),
        )

    def megatron_model(self, build: MegatronBuild) -> DecoderTwin:
        """The LLM's megatron-core twin for ``MegatronStrategy`` (:class:`~forge_lightning.contracts.MegatronModule`);
        the strategy runs vision and projector as they are (:func:`~forge_lightning.modules.vlm.megatron.megatron_twin`
        says what is refused)."""
        return megatron_twin(self, build)

    # ----- forward and loss ----------------------------------------------------------------------------------
    @staticmethod
    def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch entries :class:`VisionLanguageModel` takes beside ``input_ids`` (those present), packed rows'
        ``document_ids`` and ``position_ids`` included."""
        keys = ("attention_mask", *MODEL_INPUTS, *PACKED_INPUTS)
        return {k: batch[k] for k in keys if batch.get(k) is not None}

    @override
    def forward(self, input_ids: Tensor, **inputs: Any) -> Tensor:
        """Logits ``[B, S, vocab]``; ``inputs`` as :meth:`VisionLanguageModel.forward` takes them."""
        return self.model(input_ids, **inputs)

    def loss_sum(self, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        """(sum of per-token losses, number of trainable tokens) of a micro-batch."""
        hidden_BSH = self.model.hidden_states(batch["input_ids"], **self.model_inputs(batch))
        loss = LMLoss.for_run(
            resolve_for(self, hidden_BSH.device), ignore_index=self.ignore_index, z_loss=self.z_loss
        )
        return loss(
            hidden_BSH.reshape(-1, hidden_BSH.shape[-1]),
            self.model.llm.lm_head.weight,
            batch["labels"].reshape(-1),
        )

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss_sum, tokens = self.loss_sum(batch)
        loss = self.objective.training_loss(self, batch, loss_sum, tokens)
        # A MoE LLM's router losses, over the tokens the attention mask keeps (as transformers counts them).
        router = self.model.llm.router_losses(batch.get("attention_mask"))
        if router is None:
            return loss
        return loss + router_loss_term(self, self.config.llm, router).to(loss.dtype)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.objective.log_train(self)

    # ----- evaluation and generation ---------------------------------------------------------------------------
    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        cfg = self.generation_config
        inputs = {k: batch[k] for k in MODEL_INPUTS if batch.get(k) is not None}
        return self.generate(
            batch["input_ids"],
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            **inputs,
        )

    def generate(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        """Greedy or sampled continuation of prompts ``[B, S]`` of equal length (no padding) with a KV cache.

        The prompt runs through the whole model once (its images' features in place of their placeholders, at
        the tower's positions); the new tokens continue on the LLM, at positions shifted by the prompt's rope
        deltas (multimodal RoPE advances one step per image row, not per token). ``kwargs``: the pixel inputs
        (:data:`MODEL_INPUTS`) and the decoding options of :func:`~forge_lightning.modules.llm.generation.generate`.
        """
        media = {k: kwargs.pop(k) for k in MODEL_INPUTS if k in kwargs}
        media = {k: v for k, v in media.items() if v is not None}
        grids = {k: media.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
        positions, deltas_B1 = self.model.position_ids(input_ids, None, *grids.values())

        def prefill(kv_cache: list[Any]) -> Tensor:
            return self.model.hidden_states(input_ids, position_ids=positions, kv_cache=kv_cache, **media)

        return generate(self.model.llm, input_ids, prefill=prefill, position_deltas=deltas_B1, **kwargs)

    # ----- optimisation and bookkeeping ------------------------------------------------------------------------
    @override
    def configure_optimizers(self) -> dict[str, Any]:
        rates = {name: s.lr for name, s in self.components.items() if s.lr is not None}
        groups = component_param_groups(self.parallel_plan(), self.optimizer_config, rates)
        implementation = resolve_for(self, self.device).optimizer
        optimizer = optimizer_for_groups(groups, self.optimizer_config, implementation=implementation)
        total = self.scheduler_config.total_steps or int(self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(optimizer, self.scheduler_config, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def batch_stats(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """Samples, real (non-padding) tokens and training FLOPs of a micro-batch, the vision encoder's included.

        The LLM's attention FLOPs are those of each row's real length (or each sample of a packed row, its padding
        left out), not of the padded square; the encoder's are the tower's (see :meth:`~forge_lightning.modules.vlm.towers.VisionTower.training_flops`).
        """
        input_ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        document_ids = batch.get("document_ids")
        if document_ids is not None:
            lengths = self._trained_document_lengths(document_ids, batch["labels"])
        elif mask is not None:
            lengths = [int(n) for n in mask.sum(dim=1).tolist()]
        else:
            lengths = [input_ids.shape[1]] * input_ids.shape[0]
        lengths = [n for n in lengths if n > 0]
        llm = self.config.llm
        tokens = sum(lengths)
        matmuls = llm_flops_per_token(llm, 1) - attention_flops_per_token(llm, [1])  # 6 N per token
        flops = matmuls * tokens + attention_flops_per_token(llm, lengths) * tokens
        tower = self.model.tower
        for kind, pixels_key in {"image": "pixel_values", "video": "pixel_values_videos"}.items():
            pixels = batch.get(pixels_key)
            if pixels is not None and kind in tower.kinds:
                grid = tower.layout(kind, batch)
                flops += tower.training_flops(self.model.vision, pixels, grid)
        samples = len(lengths) if document_ids is not None else input_ids.shape[0]
        return {"samples": samples, "tokens": tokens, "flops": flops}

    def _trained_document_lengths(self, document_ids: Tensor, labels: Tensor) -> list[int]:
        """Token counts of a packed batch's documents that train at least one token: every sample does (the scan
        refuses one without an assistant turn), a row's padding (a document of its own) does not."""
        counts = document_lengths(document_ids)
        B, S = document_ids.shape
        rows_B1 = torch.arange(B, device=document_ids.device)[:, None] * (S + 1)
        _, index = torch.unique_consecutive((document_ids + rows_B1).flatten(), return_inverse=True)
        trained = torch.zeros_like(counts).index_add_(
            0, index, (labels.flatten() != self.ignore_index).long()
        )
        return counts[trained > 0].tolist()

    @override
    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if not isinstance(datamodule, TextData):
            return
        llm = self.config.llm
        if datamodule.seq_length is not None and datamodule.seq_length > llm.max_position_embeddings:
            raise ValueError(
                f"data.seq_length ({datamodule.seq_length}) is longer than the LLM's max_position_embeddings "
                f"({llm.max_position_embeddings}): shorten the sequences or use a model with longer context"
            )
        if datamodule.vocab_size > llm.vocab_size:
            raise ValueError(
                f"the tokenizer has {datamodule.vocab_size} tokens but the LLM's vocab_size is {llm.vocab_size}: "
                "use the model's own tokenizer or set llm.vocab_size to at least the tokenizer's"
            )
        if not isinstance(datamodule, VisionTextData):
            return
        for name, token_id in datamodule.special_token_ids.items():
            ours = getattr(self.config, name)
            if ours is not None and ours != token_id:
                raise ValueError(
                    f"the model's {name} is {ours} but the tokenizer's token is {token_id}: set "
                    f"model.init_args.config.{name} to {token_id}, or use the model's own tokenizer"
                )
        for name, value in datamodule.vision_settings.items():
            ours = getattr(self.config, name)
            if value is None and ours is not None:
                raise ValueError(
                    f"the model's {name} is {ours} but the data module's videos have none (their time is "
                    "timestamp text, Qwen3-VL's): set data.init_args.processor to the model's (qwen2_vl for "
                    "Qwen2-VL / Qwen2.5-VL)"
                )
            if ours is not None and ours != value:
                raise ValueError(
                    f"the model's {name} is {ours} but the data module's is {value}: set data.init_args.{name} to "
                    f"{ours} (packed rows take their video positions from it)"
                )


def _config_of(config: str | Mapping[str, Any]) -> VLMConfig:
    """A :class:`VLMConfig` from a Hugging Face VLM directory / ``config.json`` path or its fields."""
    if isinstance(config, Mapping):
        return VLMConfig(**config)
    path = Path(config)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"config ({config}): no such config.json or directory; give a mapping of vision / projector / llm "
            "sections, or a Hugging Face VLM directory"
        )
    return VLMConfig.from_hf(json.loads(file.read_text()))

"""``Pi05Policy``: the LightningModule that trains and runs Pi0.5 on LeRobot batches.

A batch is what :class:`~forge_lightning.datamodules.lerobot.LeRobotDataModule` yields: camera frames
``observation.images.*`` ``[B, 3, H, W]`` in ``[0, 1]``, ``observation.state`` ``[B, S]``, an action chunk
``action`` ``[B, chunk_size, A]`` (``delta_timestamps``) and ``task`` strings. State and actions are normalised by
the data module (Pi0.5 uses ``quantiles`` for both, mapping them to ``[-1, 1]``); the policy reads the data
module's statistics at setup to map predicted actions back and stores them in its checkpoints::

    frames ── resize with pad, [-1, 1] ─────────────────────┐
    task + normalised state ── prompt ── tokenizer ─────────┴─ Pi05 ── flow-matching loss / action chunk
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from forge_lightning.contracts import Component, ParallelPlan
from forge_lightning.datamodules.lerobot.stats import Normalizer, aggregate_stats, to_jsonable
from forge_lightning.modules.embodied.checkpoint import load_lerobot_checkpoint
from forge_lightning.modules.embodied.config import Pi05Config
from forge_lightning.modules.embodied.model import Pi05, Pi05Inputs
from forge_lightning.modules.embodied.prompt import PromptTokenizer, build_prompts
from forge_lightning.modules.embodied.siglip import preprocess_images
from forge_lightning.optim import (
    OptimizerConfig,
    SchedulerConfig,
    build_scheduler,
    component_param_groups,
    optimizer_for_groups,
)
from forge_lightning.optim.clipping import UnscaledGradientClipping
from forge_lightning.performance import PerformanceConfig, configure_performance, resolve

COMPONENTS = ("vision", "llm", "action_expert")
"""Parallel-plan components of Pi0.5 (SigLIP + projector, Gemma backbone, action expert with its heads)."""

IMAGE_PREFIX = "observation.images."
_BOUNDED_MODES = ("min_max", "quantiles", "quantile10")  # map to [-1, 1], as the state bins assume
_CHECKPOINT_KEY = "pi05_normalization"
PROMPT_TOKENS_KEY, PROMPT_MASK_KEY = "prompt.tokens", "prompt.mask"
"""Batch keys of the tokenised prompt, added on the host before the batch moves to the device."""


def _as(cls: type, value: Any) -> Any:
    if value is None:
        return cls()
    return cls(**value) if isinstance(value, dict) else value


class Pi05Policy(UnscaledGradientClipping, pl.LightningModule):
    """Pi0.5 vision-language-action policy: flow-matching training and action-chunk prediction.

    Args:
        config: model config: a preset name (``debug``, ``pi05-base``), a dict of
            :class:`~forge_lightning.modules.embodied.config.Pi05Config` fields, or a lerobot ``config.json`` /
            policy directory.
        pretrained: lerobot / openpi Pi0.5 checkpoint (directory with ``model.safetensors`` or the file).
        tokenizer: directory of the prompt tokenizer (PaliGemma's ``tokenizer.json`` or ``tokenizer.model``).
        image_keys: cameras in the model's order; a camera missing from a batch becomes an empty, masked image.
            ``None``: every ``observation.images.*`` key of the batch, in batch order.
        state_key: the state feature (normalised by the data module).
        action_key: the action-chunk feature (normalised by the data module).
        task_key: the task strings.
        freeze: components whose parameters stay fixed (``vision``, ``llm``, ``action_expert``).
        learning_rates: peak learning rate per component (others use ``optimizer.lr``).
        optimizer: optimizer settings (the CLI fills it from the top-level ``optimizer`` section).
        scheduler: learning-rate schedule (the CLI fills it from the top-level ``scheduler`` section).
        performance: activation checkpointing, compile, FP8, kernels and the optimizer implementation, applied
            to the plan's blocks (the CLI fills it from the top-level ``performance`` section).
    """

    # The performance switch the module applies itself (the strategy applies the others).
    performance_switches = frozenset({"optimizer"})

    def __init__(
        self,
        config: str | dict[str, Any] = "debug",
        pretrained: str | None = None,
        tokenizer: str | None = None,
        *,
        image_keys: list[str] | None = None,
        state_key: str = "observation.state",
        action_key: str = "action",
        task_key: str = "task",
        freeze: list[str] | None = None,
        learning_rates: dict[str, float] | None = None,
        optimizer: OptimizerConfig | dict[str, Any] | None = None,
        scheduler: SchedulerConfig | dict[str, Any] | None = None,
        performance: PerformanceConfig | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = Pi05Config.load(config)
        self.freeze = list(freeze or [])
        self.learning_rates = dict(learning_rates or {})
        for name in [*self.freeze, *self.learning_rates]:
            if name not in COMPONENTS:
                raise ValueError(
                    f"unknown component {name!r} in freeze / learning_rates; components: {COMPONENTS}"
                )
        self.optimizer_config: OptimizerConfig = _as(OptimizerConfig, optimizer)
        self.scheduler_config: SchedulerConfig = _as(SchedulerConfig, scheduler)
        self.performance: PerformanceConfig = _as(PerformanceConfig, performance)
        self.tokenizer_path, self.image_keys = tokenizer, image_keys
        self.state_key, self.action_key, self.task_key = state_key, action_key, task_key
        self.save_hyperparameters(
            {
                "config": self.config.to_dict(),
                "tokenizer": tokenizer,
                "image_keys": image_keys,
                "state_key": state_key,
                "action_key": action_key,
                "task_key": task_key,
                "freeze": self.freeze,
                "learning_rates": self.learning_rates,
                "optimizer": dataclasses.asdict(self.optimizer_config),
                "scheduler": dataclasses.asdict(self.scheduler_config),
                "performance": self.performance.to_dict(),
            }
        )
        self.model = Pi05(self.config)
        if pretrained is not None:
            load_lerobot_checkpoint(self.model, pretrained)
        # Nothing reads the prefix's last hidden states, so these never get a gradient: freezing them keeps DDP
        # from waiting for their gradients and the optimizer from holding state for them.
        for param in self.model.unused_parameters():
            param.requires_grad_(False)
        for name in self.freeze:
            getattr(self.model, name).requires_grad_(False)
        self._tokenizer: PromptTokenizer | None = None
        self.normalizer: Normalizer | None = None

    # ----- plan and optimisation ----------------------------------------------------------------------------
    @override
    def configure_model(self) -> None:
        if self._trainer is not None:  # ``load_from_checkpoint`` calls it without a trainer: nothing to apply
            configure_performance(self)

    def parallel_plan(self) -> ParallelPlan:
        """Components ``vision``, ``llm``, ``action_expert``, each with its layers as the repeated blocks.

        No tensor-parallel styles: Gemma's single key/value head cannot be split across ranks.
        """
        m = self.model
        blocks = {
            "vision": m.vision.tower.encoder.layers,
            "llm": m.llm.layers,
            "action_expert": m.action_expert.layers,
        }
        return ParallelPlan(
            components=[
                Component(
                    name=name, module=getattr(m, name), blocks=list(blocks[name]), frozen=name in self.freeze
                )
                for name in COMPONENTS
            ]
        )

    def optimizer_groups(self) -> list[dict[str, Any]]:
        """Parameter groups per trainable component (decayed matrices / the rest), each with its learning rate."""
        return component_param_groups(self.parallel_plan(), self.optimizer_config, self.learning_rates)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        implementation = resolve(self.performance, self.device).optimizer
        optimizer = optimizer_for_groups(
            self.optimizer_groups(), self.optimizer_config, implementation=implementation
        )
        total = self.scheduler_config.total_steps or int(self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(optimizer, self.scheduler_config, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----- batches ------------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> PromptTokenizer:
        """The prompt tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            if self.tokenizer_path is None:
                raise ValueError(
                    "Pi05Policy needs tokenizer=DIR (PaliGemma's tokenizer) to build its prompts"
                )
            c = self.config
            self._tokenizer = PromptTokenizer(
                self.tokenizer_path,
                c.tokenizer_max_length,
                padding=c.prompt_padding,
                pad_multiple=c.prompt_pad_multiple,
            )
            if self._tokenizer.vocab_size > self.config.vocab_size:
                raise ValueError(
                    f"the tokenizer has {self._tokenizer.vocab_size} tokens but the model's vocab_size is "
                    f"{self.config.vocab_size}"
                )
        return self._tokenizer

    def _images(self, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        keys = self.image_keys or [
            k for k in batch if k.startswith(IMAGE_PREFIX) and not k.endswith("_is_pad")
        ]
        present = [k for k in keys if k in batch]
        if not present:
            raise ValueError(f"the batch has none of the cameras {keys or IMAGE_PREFIX + '*'}")
        size = self.config.vision.image_size
        reference = batch[present[0]]
        images, masks = [], []
        for key in keys:
            if key not in batch:
                images.append(
                    reference.new_full((reference.shape[0], 3, size, size), -1.0, dtype=torch.float32)
                )
                masks.append(torch.zeros(reference.shape[0], dtype=torch.bool, device=reference.device))
                continue
            if batch[key].ndim != 4:
                raise ValueError(
                    f"{key} has shape {tuple(batch[key].shape)}; Pi0.5 takes one [B, 3, H, W] frame"
                )
            images.append(preprocess_images(batch[key], size))
            masks.append(torch.ones(reference.shape[0], dtype=torch.bool, device=reference.device))
        return torch.stack(images, dim=1), torch.stack(masks, dim=1)

    def prepare_inputs(self, batch: Mapping[str, Any]) -> Pi05Inputs:
        """Model inputs of a batch: preprocessed cameras and the tokenised prompt (task + discretised state)."""
        state = batch[self.state_key]
        if state.ndim != 2 or state.shape[-1] > self.config.max_state_dim:
            raise ValueError(
                f"{self.state_key} has shape {tuple(state.shape)}; Pi0.5 takes one state of at most "
                f"max_state_dim ({self.config.max_state_dim}) values per sample"
            )
        if PROMPT_TOKENS_KEY in batch:
            tokens, token_mask = batch[PROMPT_TOKENS_KEY], batch[PROMPT_MASK_KEY]
        else:
            tokens, token_mask = self.tokenize_prompts(batch)
        images, image_mask = self._images(batch)
        return Pi05Inputs(images, image_mask, tokens.to(state.device), token_mask.to(state.device))

    def tokenize_prompts(self, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        """Token ids and mask ``[B, width]`` of the batch's prompts (task + discretised state; see
        ``Pi05Config.prompt_padding`` for the width)."""
        state = batch[self.state_key]
        tasks = batch[self.task_key]
        tasks = [tasks] * state.shape[0] if isinstance(tasks, str) else list(tasks)
        return self.tokenizer(build_prompts(tasks, state, self.config.state_bins))

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Binning the state reads its values on the host: done here, before the copy, it does not make the host
        # wait for the device at every step.
        if (
            isinstance(batch, dict)
            and self.state_key in batch
            and self.task_key in batch
            and isinstance(batch[self.state_key], Tensor)
            and batch[self.state_key].device.type == "cpu"
            and batch[self.state_key].ndim == 2
        ):
            tokens, mask = self.tokenize_prompts(batch)
            if self.device.type == "cuda":  # pinned, so that the copy does not wait for the device either
                tokens, mask = tokens.pin_memory(), mask.pin_memory()
            batch[PROMPT_TOKENS_KEY], batch[PROMPT_MASK_KEY] = tokens, mask
        return batch

    def prepare_actions(self, batch: Mapping[str, Any]) -> Tensor:
        """The normalised action chunk zero-padded to ``[B, chunk_size, max_action_dim]``."""
        actions = batch[self.action_key].float()
        c = self.config
        if actions.ndim != 3 or actions.shape[1] != c.chunk_size or actions.shape[2] > c.max_action_dim:
            raise ValueError(
                f"{self.action_key} has shape {tuple(actions.shape)}; expected [B, chunk_size ({c.chunk_size}), "
                f"<= max_action_dim ({c.max_action_dim})]: set the data module's delta_timestamps for "
                f"{self.action_key} to chunk_size offsets"
            )
        return F.pad(actions, (0, c.max_action_dim - actions.shape[2]))

    # ----- training and evaluation --------------------------------------------------------------------------
    def loss(
        self, batch: Mapping[str, Any], *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> Tensor:
        """Mean flow-matching loss over the chunk and the real action dimensions of a batch.

        Args:
            batch: a LeRobot batch (normalised state and actions).
            noise: ``[B, chunk_size, max_action_dim]`` (default: drawn).
            time: ``[B]`` flow times (default: drawn from the config's Beta distribution).
        """
        inputs, actions = self.prepare_inputs(batch), self.prepare_actions(batch)
        B = actions.shape[0]
        noise = self.model.sample_noise(B, device=actions.device) if noise is None else noise
        time = self.model.sample_time(B, device=actions.device) if time is None else time
        elements = self.model.forward_loss(inputs, actions, noise, time)
        return elements[..., : batch[self.action_key].shape[-1]].mean()

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=batch[self.state_key].shape[0])
        return loss

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        size = batch[self.state_key].shape[0]
        # The same noise and flow times for a batch at every evaluation, so validation losses compare.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(batch_idx)
            noise, time = self.model.sample_noise(size), self.model.sample_time(size)
        loss = self.loss(batch, noise=noise.to(self.device), time=time.to(self.device))
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=size)

    @torch.no_grad()
    def predict_action_chunk(
        self, batch: Mapping[str, Any], *, num_steps: int | None = None, noise: Tensor | None = None
    ) -> Tensor:
        """Action chunks ``[B, chunk_size, A]`` for a batch of observations (normalised state).

        Actions are mapped back to the dataset's units when the policy knows the statistics (after ``fit`` or
        from a checkpoint; see :meth:`set_normalizer`), else returned normalised. ``A`` is the action width of
        those statistics, else ``max_action_dim``.
        """
        inputs = self.prepare_inputs(batch)
        actions = self.model.predict_action_chunk(inputs, num_steps=num_steps, noise=noise)
        if self.normalizer is None or self.action_key not in self.normalizer.stats:
            return actions
        width = np.asarray(self.normalizer.stats[self.action_key]["mean"]).shape[-1]
        chunk = actions[..., :width].cpu()
        return self.normalizer.unnormalize(self.action_key, chunk).to(actions.device)

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return self.predict_action_chunk(batch)

    def batch_stats(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """Samples of a micro-batch (for the throughput monitor)."""
        return {"samples": batch[self.state_key].shape[0]}

    # ----- normalisation statistics -------------------------------------------------------------------------
    def set_normalizer(self, normalizer: Normalizer | None) -> None:
        """The statistics and modes the data module normalised state and actions with (used to unnormalise)."""
        if normalizer is not None:
            mode = normalizer.modes.get(self.state_key, "identity")
            if mode not in _BOUNDED_MODES:
                rank_zero_warn(
                    f"{self.state_key} is normalised with {mode!r}: Pi0.5 bins the state over [-1, 1], so use one "
                    f"of {_BOUNDED_MODES} (Pi0.5 uses quantiles)"
                )
        self.normalizer = normalizer

    @override
    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        data_config = getattr(datamodule, "config", None)
        modes = dict(getattr(data_config, "normalization", None) or {})
        roots = getattr(data_config, "roots", None)
        if not modes or not roots:
            return
        from forge_lightning.datamodules.lerobot.meta import LeRobotMeta

        all_stats = [LeRobotMeta(root).stats or {} for root in roots]
        # Several datasets are each normalised with their own stats; predictions are mapped back with their
        # count-weighted aggregate.
        stats = all_stats[0] if len(all_stats) == 1 else aggregate_stats(all_stats)
        self.set_normalizer(Normalizer(stats=stats, modes=modes))

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.normalizer is not None:
            modes = dict(self.normalizer.modes)
            stats = {key: self.normalizer.stats[key] for key in modes if key in self.normalizer.stats}
            checkpoint[_CHECKPOINT_KEY] = {"modes": modes, "stats": to_jsonable(stats)}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(_CHECKPOINT_KEY)
        if saved is not None:
            stats = {k: {n: np.asarray(v) for n, v in s.items()} for k, s in saved["stats"].items()}
            self.set_normalizer(Normalizer(stats=stats, modes=saved["modes"]))

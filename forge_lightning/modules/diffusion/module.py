"""``WanDiffusionModule``: the LightningModule that trains a Wan video DiT with the flow-matching loss.

A batch holds either the frozen encoders' features read from a feature cache (``latents``: the Wan VAE's normalised
latents, ``text_embeddings``) or raw ``video`` ``[B, 3, F, H, W]`` in ``[-1, 1]`` and ``caption`` (then ``vae`` and
``text_encoder`` must be configured; they run under ``no_grad`` and stay outside the module's weights)::

    video, caption ──(WanVAE, WanTextEncoder; no_grad)──┐
    latents, text_embeddings (feature cache) ───────────┴─> x0, text ─ per-sample generator (seed, step, sample)
        ─ drop text (empty prompt) ─ FlowMatching.prepare (sigma, noise) ─ WanDiT(x_t, timestep, text)
        ─ FlowMatching.loss [B] ─ sum / samples of the global batch (GlobalBatchLoss)

Each sample's noise, noise level and text dropout come from a generator of its own, seeded from the run's ``seed``,
the global step and the sample (its ``sample_id`` when the batch carries one, else its position in the step's
global batch), so a run is reproducible and a sample gets the same draws whatever the data-parallel layout::

    model:
      class_path: forge_lightning.modules.diffusion.WanDiffusionModule
      init_args:
        pretrained: Wan2.1-T2V-1.3B-Diffusers/transformer     # or config: wan2.1-t2v-1.3b
        flow_matching: {timestep_sampling: logit_normal, shift: 3.0, text_dropout: 0.1}
        text_encoder: Wan2.1-T2V-1.3B-Diffusers               # for online batches, text dropout and generate
        vae: Wan2.1-T2V-1.3B-Diffusers

Wan 2.1 image-to-video (a DiT whose ``in_channels`` are ``2 * out_channels + 4``): only the video latents are
noised; the first-frame mask and condition latents (``condition_latents``, :meth:`WanVAE.image_condition`) are
concatenated to ``x_t`` along the channels, and the CLIP ``image_embeddings`` go to the DiT's image branch (when
the DiT has ``image_dim``); both come from the cache or from the first frame of ``video`` (``vae``,
``image_encoder``). The loss is on the ``out_channels`` prediction::

    x_t [B, C] ─┬─ cat ─ WanDiT(·, timestep, text, image_embeddings) ─ velocity [B, C] ─ loss
    condition_latents [B, 4 + C] ─┘
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from typing_extensions import override

from forge_lightning.contracts import STEP_TOKENS, Component, ParallelPlan, data_parallel, full_state_dict
from forge_lightning.modules.diffusion.flow_matching import (
    FlowMatching,
    FlowMatchingConfig,
    FlowMatchingSample,
    add_noise,
    dit_timesteps,
    first_frame_mask,
    loss_weights,
    per_token_timesteps,
    velocity_target,
)
from forge_lightning.modules.diffusion.sampling import VideoGenerationConfig, sample_euler
from forge_lightning.modules.diffusion.wan_config import PRESETS, WanDiTConfig, preset
from forge_lightning.modules.diffusion.wan_hf import read_config
from forge_lightning.modules.diffusion.wan_hf import save_pretrained as save_wan
from forge_lightning.modules.diffusion.wan_model import WanDiT
from forge_lightning.modules.objective import GlobalBatchLoss, TokenLossSteps
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
    from forge_lightning.contracts import MegatronBuild, MegatronTwin
    from forge_lightning.distributed.context_parallel import ContextParallel

VALIDATION_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)
"""Noise levels at which validation measures the loss (with fixed noise per sample)."""

EMPTY_TEXT_KEY = "text_embeddings"
"""The tensor name of the empty prompt's embedding ``[L, D]`` in an ``empty_text_embedding`` safetensors file."""


def _as(cls: type, value: Any) -> Any:
    if value is None:
        return cls()
    return cls(**value) if isinstance(value, Mapping) else value


def sample_generator(*key: Any) -> torch.Generator:
    """A CPU generator seeded from ``key`` (JSON-serialisable parts, e.g. ``(seed, "train", step, sample)``): the
    same key gives the same draws on every rank and device."""
    digest = hashlib.sha256(json.dumps(key, separators=(",", ":")).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def starting_noise(shape: tuple[int, ...], batch: int, seed: int | Sequence[int]) -> Tensor:
    """Sampling's starting noise ``[batch, *shape]`` (fp32, CPU): from one generator seeded ``seed``, or each
    sample's from a generator of its own seed (then the same whatever the batch)."""
    if isinstance(seed, int):
        return torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed))
    if len(seed) != batch:
        raise ValueError(f"{len(seed)} seeds for {batch} prompts: give one seed per prompt")
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seed])


def dit_config(config: str | Mapping[str, Any] | WanDiTConfig, attention_backend: str) -> WanDiTConfig:
    """A :class:`WanDiTConfig` from a preset name, a diffusers directory, fields (``preset`` may name the base)."""
    if isinstance(config, WanDiTConfig):
        return dataclasses.replace(config, attention_backend=attention_backend)
    if isinstance(config, str):
        if config in PRESETS:
            return preset(config, attention_backend=attention_backend)
        if Path(config).is_dir():
            return read_config(config, attention_backend=attention_backend)
        raise ValueError(
            f"config ({config!r}) is neither a preset ({', '.join(PRESETS)}) nor a diffusers transformer directory"
        )
    fields = dict(config)
    base = fields.pop("preset", None)
    fields["attention_backend"] = attention_backend
    return preset(base, **fields) if base is not None else WanDiTConfig(**fields)


class WanDiffusionModule(UnscaledGradientClipping, TokenLossSteps, pl.LightningModule):
    """Flow-matching training of a Wan DiT (Wan 2.1 / 2.2 T2V, Wan 2.2 TI2V with a clean first frame).

    Args:
        config: the DiT: a preset name (``debug``, ``wan2.1-t2v-1.3b``, ...), a diffusers ``transformer``
            directory (config only), fields of :class:`WanDiTConfig` (``preset`` names a base), or ``None`` with
            ``pretrained``.
        pretrained: a diffusers ``WanTransformer3DModel`` directory whose weights to load.
        flow_matching: :class:`FlowMatchingConfig` (noise-level density, shift, loss weighting, text dropout).
        vae: a Wan VAE directory (its folder or a Wan diffusers checkpoint's root) for batches of raw ``video`` and
            for decoding in :meth:`generate`.
        text_encoder: a UMT5 text encoder directory (with its tokenizer) for ``caption`` batches, the empty
            prompt of text dropout and prompts in :meth:`generate`.
        text_encoder_dtype: the text encoder's parameter dtype (the Wan pipelines use bfloat16).
        text_max_length: padded prompt length of the text encoder (Wan: 512).
        empty_text_embedding: a safetensors file holding the empty prompt's embedding ``[L, D]`` as
            ``text_embeddings``, for text dropout without a text encoder (cached features).
        clean_first_frame: Wan 2.2 TI2V image-to-video training: the first latent frame stays clean (timestep 0,
            no loss).
        image_encoder: a CLIP image encoder directory (``image_encoder`` / ``image_processor`` of a Wan 2.1 I2V
            diffusers checkpoint, or its root) for the image embeddings of an I2V DiT (one with ``image_dim``)
            from online ``video`` batches and the image in :meth:`generate`.
        validation_sigmas: the fixed noise levels of the validation loss.
        seed: seed of the per-sample noise, noise levels and text dropout.
        generation: what ``predict`` generates per prompt (:class:`VideoGenerationConfig`: frames, size, steps,
            guidance).
        optimizer: optimizer settings (the CLI fills it from the top-level ``optimizer`` section).
        scheduler: learning-rate schedule (the CLI fills it from the top-level ``scheduler`` section).
        performance: kernels, attention backend, activation checkpointing, compile and the optimizer
            implementation (the CLI fills it from the top-level ``performance`` section).
    """

    # The switches the module applies itself: the DiT's packed-attention kernel and the optimizer implementation.
    performance_switches = frozenset({"attention.packed", "optimizer"})

    def __init__(
        self,
        config: str | dict[str, Any] | WanDiTConfig | None = None,
        pretrained: str | None = None,
        *,
        flow_matching: FlowMatchingConfig | dict[str, Any] | None = None,
        vae: str | None = None,
        text_encoder: str | None = None,
        text_encoder_dtype: str = "bfloat16",
        text_max_length: int = 512,
        empty_text_embedding: str | None = None,
        clean_first_frame: bool = False,
        image_encoder: str | None = None,
        validation_sigmas: Sequence[float] = VALIDATION_SIGMAS,
        seed: int = 0,
        generation: VideoGenerationConfig | dict[str, Any] | None = None,
        optimizer: OptimizerConfig | dict[str, Any] | None = None,
        scheduler: SchedulerConfig | dict[str, Any] | None = None,
        performance: PerformanceConfig | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if config is None and pretrained is None:
            raise ValueError("give the DiT's config (a preset, fields or a directory), pretrained, or both")
        self.flow_config: FlowMatchingConfig = _as(FlowMatchingConfig, flow_matching)
        self.generation_config: VideoGenerationConfig = _as(VideoGenerationConfig, generation)
        self.optimizer_config: OptimizerConfig = _as(OptimizerConfig, optimizer)
        self.scheduler_config: SchedulerConfig = _as(SchedulerConfig, scheduler)
        self.performance: PerformanceConfig = _as(PerformanceConfig, performance)
        if not validation_sigmas or not all(0 <= s <= 1 for s in validation_sigmas):
            raise ValueError(f"validation_sigmas ({list(validation_sigmas)}) must be levels in [0, 1]")
        if not isinstance(getattr(torch, text_encoder_dtype, None), torch.dtype):
            raise ValueError(f"text_encoder_dtype ({text_encoder_dtype!r}) is not a torch dtype")
        if self.flow_config.text_dropout > 0 and text_encoder is None and empty_text_embedding is None:
            raise ValueError(
                f"flow_matching.text_dropout ({self.flow_config.text_dropout}) needs the empty prompt's embedding: "
                "configure text_encoder, or empty_text_embedding (a safetensors file of the cached encoder's)"
            )
        self.pretrained = None if pretrained is None else str(pretrained)
        self.dit: WanDiT = self._build(config, self.performance.attention.packed)
        self.config: WanDiTConfig = self.dit.config
        self.flow = FlowMatching(self.flow_config)
        self.clean_first_frame = clean_first_frame
        self.image_to_video = self.config.in_channels != self.config.out_channels
        self._check_image_to_video(image_encoder)
        self.validation_sigmas = tuple(float(s) for s in validation_sigmas)
        self.seed = seed
        self.encoder_paths = {"vae": vae, "text_encoder": text_encoder, "image_encoder": image_encoder}
        self.text_encoder_dtype, self.text_max_length = text_encoder_dtype, text_max_length
        self.empty_text_path = empty_text_embedding
        # The frozen encoders and the empty prompt's embedding stay outside the module tree: no checkpoint, optimizer
        # or data-parallel wrapper sees them.
        self.__dict__["_frozen"] = {}
        self.save_hyperparameters(
            {
                "config": dataclasses.asdict(config) if isinstance(config, WanDiTConfig) else config,
                "pretrained": self.pretrained,
                "flow_matching": dataclasses.asdict(self.flow_config),
                "vae": vae,
                "text_encoder": text_encoder,
                "text_encoder_dtype": text_encoder_dtype,
                "text_max_length": text_max_length,
                "empty_text_embedding": empty_text_embedding,
                "clean_first_frame": clean_first_frame,
                "image_encoder": image_encoder,
                "validation_sigmas": list(self.validation_sigmas),
                "seed": seed,
                "generation": dataclasses.asdict(self.generation_config),
                "optimizer": dataclasses.asdict(self.optimizer_config),
                "scheduler": dataclasses.asdict(self.scheduler_config),
                "performance": self.performance.to_dict(),
            }
        )
        self.objective = GlobalBatchLoss()
        self._val_sums: Tensor | None = None

    def _build(self, config: Any, attention_backend: str) -> WanDiT:
        if self.pretrained is None:
            return WanDiT(dit_config(config, attention_backend))
        model = WanDiT.from_pretrained(self.pretrained, attention_backend=attention_backend)
        if config is not None and dit_config(config, attention_backend) != model.config:
            raise ValueError(
                f"config differs from the config.json of pretrained ({self.pretrained}): leave config out to use "
                "the checkpoint's"
            )
        return model

    def _check_image_to_video(self, image_encoder: str | None) -> None:
        config = self.config
        if self.image_to_video and config.in_channels != 2 * config.out_channels + 4:
            raise ValueError(
                f"the DiT's in_channels ({config.in_channels}) differ from out_channels ({config.out_channels}) but "
                f"are not 2 * out_channels + 4 ({2 * config.out_channels + 4}), the Wan 2.1 I2V layout (noise, "
                "first-frame mask, condition latents)"
            )
        if self.image_to_video and self.clean_first_frame:
            raise ValueError(
                "clean_first_frame is Wan 2.2 TI2V's image conditioning; this DiT is a Wan 2.1 I2V one (in_channels "
                f"{config.in_channels} = 2 * out_channels + 4), conditioned through its channels: leave it false"
            )
        if image_encoder is not None and config.image_dim is None:
            raise ValueError(
                f"image_encoder ({image_encoder}) is set but the DiT has no image branch (image_dim is None)"
            )

    # ----- frozen encoders ----------------------------------------------------------------------------------------
    def frozen(self, name: str) -> nn.Module:
        """The frozen ``vae`` (:class:`WanVAE`), ``text_encoder`` (:class:`WanTextEncoder`) or ``image_encoder``
        (:class:`WanImageEncoder`), loaded on first use and kept on the module's device."""
        if self.encoder_paths[name] is None:
            raise ValueError(
                f"this batch or call needs the {name}: configure model.init_args.{name} (its directory), or train "
                "from a feature cache that holds latents and text_embeddings"
            )
        module = self._frozen.get(name)
        if module is None:
            from forge_lightning.modules.diffusion.encoders import WanImageEncoder, WanTextEncoder, WanVAE

            path = self.encoder_paths[name]
            if name == "vae":
                module = WanVAE.from_pretrained(path, z_dim=self.config.out_channels)
            elif name == "image_encoder":
                module = WanImageEncoder.from_pretrained(path)
            else:
                dtype = getattr(torch, self.text_encoder_dtype)
                module = WanTextEncoder.from_pretrained(path, dtype=dtype, max_length=self.text_max_length)
            self._frozen[name] = module
        return module.to(self.device)

    def empty_text(self) -> Tensor:
        """The empty prompt's embedding ``[L, D]`` (for text dropout and the unconditional branch of guidance)."""
        empty = self._frozen.get("empty")
        if empty is None:
            if self.empty_text_path is not None:
                tensors = load_file(self.empty_text_path)
                if EMPTY_TEXT_KEY not in tensors:
                    raise ValueError(
                        f"{self.empty_text_path} holds no {EMPTY_TEXT_KEY!r} tensor (the empty prompt's embedding)"
                    )
                empty = tensors[EMPTY_TEXT_KEY].reshape(-1, tensors[EMPTY_TEXT_KEY].shape[-1])
            else:
                empty = self.frozen("text_encoder").encode([""])[0]
            self._frozen["empty"] = empty
        return empty.to(self.device)

    @torch.no_grad()
    def encode(self, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        """The batch's clean latents ``[B, C, F, H, W]`` and text embeddings ``[B, L, D]``: cached, or computed by the
        frozen encoders from ``video`` and ``caption``."""
        latents = batch.get("latents")
        if latents is None:
            if "video" not in batch:
                raise ValueError(f"a batch needs latents or video; it has {sorted(batch)}")
            latents = self.frozen("vae").encode(batch["video"])
        text = batch.get("text_embeddings")
        if text is None:
            if "caption" not in batch:
                raise ValueError(f"a batch needs text_embeddings or caption; it has {sorted(batch)}")
            text = self.frozen("text_encoder").encode(list(batch["caption"]))
        dtype = self.dit.patch_embedding.weight.dtype
        return latents.to(self.device, dtype), text.to(self.device, dtype)

    @torch.no_grad()
    def image_inputs(self, batch: Mapping[str, Any]) -> tuple[Tensor | None, Tensor | None]:
        """Wan 2.1 I2V's conditions of a batch: the mask + condition latents ``[B, 4 + C, F, H, W]`` and (for a DiT
        with ``image_dim``) the image embeddings ``[B, N, image_dim]``, cached (``condition_latents``,
        ``image_embeddings``) or computed from the first frame of ``video``; ``(None, None)`` for other DiTs."""
        if not self.image_to_video:
            return None, None
        dtype = self.dit.patch_embedding.weight.dtype
        condition = batch.get("condition_latents")
        if condition is None:
            if "video" not in batch:
                raise ValueError(
                    f"this I2V DiT needs condition_latents (cached with WanVAE.video_condition) or video; the batch "
                    f"has {sorted(batch)}"
                )
            condition = self.frozen("vae").video_condition(batch["video"])
        image = None
        if self.config.image_dim is not None:
            image = batch.get("image_embeddings")
            if image is None:
                if "video" not in batch:
                    raise ValueError(
                        f"this I2V DiT (image_dim {self.config.image_dim}) needs image_embeddings (cached with "
                        f"WanImageEncoder.encode_first_frame) or video; the batch has {sorted(batch)}"
                    )
                image = self._image_encoder().encode_first_frame(batch["video"])
            image = image.to(self.device, dtype)
        return condition.to(self.device, dtype), image

    def _image_encoder(self) -> nn.Module:
        if self.encoder_paths["image_encoder"] is None:
            raise ValueError(
                f"this I2V DiT (image_dim {self.config.image_dim}) needs the CLIP image embeddings of the first "
                "frame: configure model.init_args.image_encoder (the image_encoder folder of a Wan 2.1 I2V "
                "checkpoint), or train from a feature cache that holds image_embeddings"
            )
        return self.frozen("image_encoder")

    def velocity(
        self,
        x_t: Tensor,
        timestep: Tensor,
        text: Tensor,
        image_inputs: tuple[Tensor | None, Tensor | None],
        dit: Callable[..., Tensor] | None = None,
    ) -> Tensor:
        """The DiT's prediction ``[B, out_channels, F, H, W]``; for I2V with the condition channels concatenated
        to ``x_t`` and the image embeddings passed (:meth:`image_inputs`).

        Args:
            x_t: the noised latents.
            timestep: the DiT's timesteps ``[B]`` (or ``[B, S]``).
            text: the text embeddings.
            image_inputs: :meth:`image_inputs` of the batch.
            dit: the model that predicts (default: the module's DiT; MegatronStrategy passes its twin's chunk, which
                takes the same arguments). The latents go positionally, the rest by name: megatron's
                ``Float16Module`` casts positional inputs to bf16, which the timesteps must not be.
        """
        condition, image = image_inputs
        if condition is not None:
            x_t = torch.cat([x_t, condition.to(x_t.dtype)], dim=1)
        dit = self.dit if dit is None else dit
        return dit(x_t, timestep=timestep, encoder_hidden_states=text, encoder_hidden_states_image=image)

    # ----- construction and interchange -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> WanDiffusionModule:
        """Build from a diffusers ``WanTransformer3DModel`` directory and load its weights."""
        return cls(config=None, pretrained=str(path), **kwargs)

    def save_pretrained(
        self, path: str | Path, dtype: torch.dtype | None = None, overwrite: bool = False
    ) -> None:
        """Write the DiT as a diffusers ``WanTransformer3DModel`` directory. Under a strategy that shards
        parameters, every rank must call this."""
        attached = self._trainer is not None
        state = full_state_dict(self.trainer.strategy, self.dit) if attached else None
        if not attached or self.trainer.is_global_zero:
            model = self.dit
            if state is not None:
                with torch.device("meta"):
                    model = WanDiT(self.config)
                model.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, assign=True)
            save_wan(model, path, dtype=dtype, overwrite=overwrite)
        if attached:
            self.trainer.strategy.barrier("save_pretrained")

    @override
    def configure_model(self) -> None:
        if self._trainer is not None:
            configure_performance(self)

    def enable_context_parallel(self, cp: ContextParallel) -> None:
        """Split each video's patch tokens over ``cp``'s ranks from now on (the strategy's context parallelism;
        :class:`~forge_lightning.contracts.ContextParallelModule`). The DiT gathers its prediction back before
        unpatchify, so the loss is computed on the whole prediction on every rank of the group."""
        from forge_lightning.distributed.split_sequence import SplitSequence

        self.dit.set_sequence_layout(SplitSequence(cp))

    def megatron_model(self, build: MegatronBuild) -> MegatronTwin:
        """The DiT's megatron-core twin for ``MegatronStrategy`` (:class:`~forge_lightning.contracts.MegatronModule`;
        see ``modules/diffusion/megatron.py``): data and context parallelism, the module's noise and loss."""
        from forge_lightning.modules.diffusion.megatron import DiTTwin

        return DiTTwin(self, build)

    def parallel_plan(self) -> ParallelPlan:
        """One component, ``dit``, whose blocks are the Wan transformer blocks (the unit of FSDP wrapping,
        activation checkpointing and ``torch.compile``); no tensor-parallel plan yet. The frozen encoders are not
        part of the module."""
        return ParallelPlan(
            components=[Component(name="dit", module=self.dit, blocks=self.dit.repeated_blocks())]
        )

    # ----- loss ----------------------------------------------------------------------------------------------------
    def _sample_keys(self, batch: Mapping[str, Any], size: int, batch_idx: int) -> list[Any]:
        """What names each sample in its generator's seed: its ``sample_id``, else its position in the step's
        global batch (micro-batch, data rank, row), which is the same in every data-parallel layout."""
        ids = batch.get("sample_id")
        if ids is not None:
            return [str(i) for i in ids]
        rank = data_parallel(self.trainer.strategy)[1] if self._trainer is not None else 0
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        return [[batch_idx % accumulate, rank * size + row] for row in range(size)]

    def prepare(self, batch: Mapping[str, Any], batch_idx: int = 0) -> tuple[FlowMatchingSample, Tensor]:
        """The training inputs of a batch: the noised latents and targets, and the text embeddings (some replaced
        by the empty prompt's); every draw from each sample's own generator (see the module docstring)."""
        x0, text = self.encode(batch)
        step = self.trainer.global_step if self._trainer is not None else 0
        keys = self._sample_keys(batch, x0.shape[0], batch_idx)
        samples, texts = [], []
        for row, key in enumerate(keys):
            generator = sample_generator(self.seed, "train", step, key)
            text_1LD = text[row : row + 1]
            if self.flow_config.text_dropout > 0:
                text_1LD, _ = self.flow.drop_text(text_1LD, self.empty_text(), generator=generator)
            samples.append(
                self.flow.prepare(
                    x0[row : row + 1],
                    generator=generator,
                    clean_first_frame=self.clean_first_frame,
                    patch_size=self.config.patch_size,
                )
            )
            texts.append(text_1LD)
        return _concat(samples), torch.cat(texts)

    def loss_sum(self, batch: Mapping[str, Any], batch_idx: int = 0) -> tuple[Tensor, Tensor]:
        """(sum of the per-sample flow-matching losses, number of samples) of a micro-batch."""
        sample, text = self.prepare(batch, batch_idx)
        pred = self.velocity(sample.x_t, sample.timestep, text, self.image_inputs(batch))
        loss_B = self.flow.loss(pred, sample)
        return loss_B.sum(), torch.tensor(loss_B.shape[0], device=loss_B.device)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss_sum, samples = self.loss_sum(batch, batch_idx)
        if STEP_TOKENS not in batch:
            # The grouped loaders yield whole micro-batches only, so the step holds accumulate x B samples per rank.
            batch[STEP_TOKENS] = samples * self.trainer.accumulate_grad_batches
        return self.objective.training_loss(self, batch, loss_sum, samples)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.objective.log_train(self)

    # ----- evaluation ----------------------------------------------------------------------------------------------
    def fixed_sigma_losses(
        self, batch: Mapping[str, Any], batch_idx: int = 0, dit: Callable[..., Tensor] | None = None
    ) -> Tensor:
        """Per-sample losses ``[len(validation_sigmas), B]`` at the fixed noise levels, with noise fixed per sample
        (seeded by the batch index and the sample, not the step), so that they compare across steps. No text
        dropout. ``dit``: the model that predicts (see :meth:`velocity`)."""
        x0, text = self.encode(batch)
        keys = self._sample_keys(batch, x0.shape[0], batch_idx)
        noise = torch.cat(
            [
                torch.randn(x0.shape[1:], generator=sample_generator(self.seed, "eval", batch_idx, key))[None]
                for key in keys
            ]
        ).to(x0.device, x0.dtype)
        losses, image_inputs = [], self.image_inputs(batch)
        for sigma in self.validation_sigmas:
            sigma_B = torch.full((x0.shape[0],), sigma, device=x0.device)
            x_t, timestep, mask = add_noise(x0, noise, sigma_B), dit_timesteps(sigma_B), None
            if self.clean_first_frame:
                mask = first_frame_mask(x0)
                x_t = (1 - mask) * x0 + mask * x_t
                timestep = per_token_timesteps(timestep, mask, self.config.patch_size)
            weight = loss_weights(self.flow_config, sigma_B)
            sample = FlowMatchingSample(x_t, velocity_target(x0, noise), sigma_B, timestep, weight, mask)
            losses.append(self.flow.loss(self.velocity(x_t, timestep, text, image_inputs, dit), sample))
        return torch.stack(losses)

    def _eval_step(self, batch: dict[str, Any], batch_idx: int = 0) -> None:
        self.record_eval_losses(self.fixed_sigma_losses(batch, batch_idx))

    def record_eval_losses(self, losses_KB: Tensor) -> None:
        """Add a batch's :meth:`fixed_sigma_losses` to the current evaluation's sums (logged at its end)."""
        losses_KB = losses_KB.detach().double()
        count = torch.tensor(losses_KB.shape[1], dtype=torch.float64, device=losses_KB.device)
        sums = torch.cat([losses_KB.sum(1), count[None]])  # per-sigma sums, then the sample count
        self._val_sums = sums if self._val_sums is None else self._val_sums + sums
        self.objective.record_eval(torch.stack([losses_KB.mean(0).sum(), count]))

    @property
    def evaluation_started(self) -> bool:
        """Whether the current evaluation has recorded a batch (it has not ended and been logged)."""
        return self._val_sums is not None

    def _eval_log(self, prefix: str) -> Tensor | None:
        sums = self._val_sums
        self._val_sums = None
        if sums is not None:
            sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
            for sigma, total in zip(self.validation_sigmas, sums[:-1], strict=True):
                self.log(f"{prefix}/loss_sigma_{sigma:g}", (total / sums[-1]).float(), rank_zero_only=True)
        return self.objective.log_eval(self, prefix)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, batch_idx)

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, batch_idx)

    # ----- generation ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: str | Sequence[str] | Tensor,
        *,
        num_frames: int,
        height: int,
        width: int,
        steps: int = 50,
        guidance: float = 5.0,
        shift: float | None = None,
        negative: Tensor | None = None,
        seed: int | Sequence[int] = 0,
        decode: bool = True,
        image: Tensor | None = None,
        compression: tuple[int, int] | None = None,
    ) -> Tensor:
        """Videos from prompts (or their embeddings ``[B, L, D]``) with the Euler sampler and classifier-free
        guidance; for a Wan 2.1 I2V DiT, from a first frame too (its condition latents and image embeddings held
        fixed and given to both guidance branches, as ``WanImageToVideoPipeline``).

        Args:
            prompts: prompts (needs ``text_encoder``) or text embeddings.
            num_frames: video frames (``1 + 4k``); latent frames ``1 + (num_frames - 1) / 4``.
            height: video height (a multiple of the VAE's spatial factor times the patch size).
            width: video width.
            steps: Euler steps.
            guidance: CFG scale (1: no guidance).
            shift: the schedule's shift (default: ``flow_matching.shift``).
            negative: the negative prompt's embeddings ``[B or 1, L, D]`` (default: the empty prompt's).
            seed: seeds the starting noise: one seed for the batch's noise, or one per prompt (each video's noise
                from its own generator, so a prompt's video does not depend on the batch it is in).
            decode: decode with the VAE when configured; otherwise (or ``False``) return the latents.
            image: I2V: the first frame ``[B or 1, 3, height, width]`` in ``[-1, 1]`` (needs ``vae``, and
                ``image_encoder`` when the DiT has ``image_dim``).
            compression: ``(temporal, spatial)`` factors from video to latent sizes (default: the configured VAE's,
                else Wan's ``(4, 8)``; pixel-space latents: ``(1, 1)``).

        Returns:
            The video ``[B, 3, F, H, W]`` in ``[-1, 1]``, or the latents ``[B, C, f, h, w]``.
        """
        text = prompts if isinstance(prompts, Tensor) else self.frozen("text_encoder").encode(prompts)
        dtype = self.dit.patch_embedding.weight.dtype
        text = text.to(self.device, dtype)
        negative_BLD = None
        if guidance != 1.0:
            negative = self.empty_text()[None] if negative is None else negative
            negative_BLD = negative.to(self.device, dtype).expand_as(text)
        temporal, spatial = compression or self._compression()
        if (num_frames - 1) % temporal or height % spatial or width % spatial:
            raise ValueError(
                f"{num_frames} frames of {height}x{width}: need 1 + {temporal}k frames and sides divisible by {spatial}"
            )
        shape = (
            self.config.out_channels,
            1 + (num_frames - 1) // temporal,
            height // spatial,
            width // spatial,
        )
        noise = starting_noise(shape, text.shape[0], seed)
        image_inputs = self._generation_image_inputs(image, text.shape[0], num_frames, height, width)
        latents = sample_euler(
            lambda x, t, txt: self.velocity(x, t, txt, image_inputs),
            noise.to(self.device, dtype),
            text,
            num_inference_steps=steps,
            shift=self.flow_config.shift if shift is None else shift,
            guidance_scale=guidance,
            negative_text_BLD=negative_BLD,
            num_train_timesteps=self.flow_config.num_train_timesteps,
            patch_size=self.config.patch_size,
        )
        if decode and self.decodes_video:
            return self.decode_latents(latents)
        return latents

    @property
    def decodes_video(self) -> bool:
        """Whether :meth:`decode_latents` can run: a ``vae`` is configured (the DiT's latents are not pixels)."""
        return self.encoder_paths["vae"] is not None

    def decode_latents(self, latents_BCFHW: Tensor) -> Tensor:
        """The video ``[B, 3, F, H, W]`` in ``[-1, 1]`` of normalised latents, decoded by the configured VAE."""
        return self.frozen("vae").decode(latents_BCFHW)

    @override
    def predict_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        """The videos ``[B, 3, F, H, W]`` in ``[-1, 1]`` (the latents without a ``vae``) of a batch of ``prompt`` s,
        each from the noise of its ``seed``, with the ``generation`` settings."""
        g = self.generation_config
        return self.generate(
            list(batch["prompt"]),
            num_frames=g.num_frames,
            height=g.height,
            width=g.width,
            steps=g.num_inference_steps,
            guidance=g.guidance_scale,
            shift=g.shift,
            seed=[int(s) for s in batch["seed"]],
        )

    def _generation_image_inputs(
        self, image: Tensor | None, batch: int, num_frames: int, height: int, width: int
    ) -> tuple[Tensor | None, Tensor | None]:
        """:meth:`image_inputs` of :meth:`generate`'s first frame (one per video, or one for all)."""
        if not self.image_to_video:
            if image is not None:
                raise ValueError(
                    "image is for a Wan 2.1 I2V DiT (in_channels = 2 * out_channels + 4); this one is not"
                )
            return None, None
        if image is None:
            raise ValueError(
                "this I2V DiT generates from a first frame: pass image [B, 3, height, width] in [-1, 1]"
            )
        image = image[None] if image.ndim == 3 else image
        if image.ndim != 4 or image.shape[1] != 3 or tuple(image.shape[2:]) != (height, width):
            raise ValueError(
                f"image must be [B or 1, 3, {height}, {width}] in [-1, 1], got {tuple(image.shape)}"
            )
        if image.shape[0] not in (1, batch):
            raise ValueError(f"{image.shape[0]} images for {batch} prompts: give one image or one per prompt")
        dtype = self.dit.patch_embedding.weight.dtype
        condition = self.frozen("vae").image_condition(image, num_frames).to(self.device, dtype)
        embeddings = None
        if self.config.image_dim is not None:
            embeddings = self._image_encoder().encode(image).to(self.device, dtype)
            embeddings = embeddings.expand(batch, -1, -1)
        return condition.expand(batch, -1, -1, -1, -1), embeddings

    def _compression(self) -> tuple[int, int]:
        """(temporal, spatial) factors of the configured VAE, else Wan's."""
        if self.encoder_paths["vae"] is None:
            return 4, 8
        vae = self.frozen("vae")
        return vae.scale_factor_temporal, vae.scale_factor_spatial

    # ----- optimisation and bookkeeping ------------------------------------------------------------------------
    @override
    def configure_optimizers(self) -> dict[str, Any]:
        groups = component_param_groups(self.parallel_plan(), self.optimizer_config)
        implementation = resolve_for(self, self.device).optimizer
        optimizer = optimizer_for_groups(groups, self.optimizer_config, implementation=implementation)
        total = self.scheduler_config.total_steps or int(self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(optimizer, self.scheduler_config, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def batch_stats(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """Samples, DiT patch tokens and training FLOPs of a micro-batch (the frozen encoders' left out): 6 FLOPs
        per weight and token of the matmuls each token passes (video tokens through the blocks, text tokens through
        the text embedder and the cross-attention keys / values), plus self- and cross-attention."""
        latents = batch.get("latents")
        if latents is not None:
            B, _, F, H, W = latents.shape
        else:
            B, _, frames, height, width = batch["video"].shape
            temporal, spatial = self._compression()
            F, H, W = 1 + (frames - 1) // temporal, height // spatial, width // spatial
        text = batch.get("text_embeddings")
        L = text.shape[1] if text is not None else self.text_max_length
        pt, ph, pw = self.config.patch_size
        S = (F // pt) * (H // ph) * (W // pw)
        video_weights, text_weights = self._matmul_weights()
        D, layers = self.config.dim, self.config.num_layers
        # forward 2 FLOPs per multiply-add, backward twice that: QK^T and AV of self- and cross-attention
        attention = 12 * layers * D * (S * S + S * L)
        flops = B * (6 * (video_weights * S + text_weights * L) + attention)
        return {"samples": B, "tokens": B * S, "flops": float(flops)}

    def _matmul_weights(self) -> tuple[int, int]:
        """Weights the matmuls of one video token and one text token use."""
        cached = self.__dict__.get("_matmul_counts")
        if cached is None:
            video = text = 0
            for name, param in self.dit.named_parameters():
                if not name.endswith("weight") or param.ndim < 2:
                    continue
                if ".attn2.to_k." in name or ".attn2.to_v." in name or "text_embedder" in name:
                    text += param.numel()
                elif name.startswith(("blocks.", "patch_embedding", "proj_out")):
                    video += param.numel()
            cached = self.__dict__["_matmul_counts"] = (video, text)
        return cached


def _concat(samples: list[FlowMatchingSample]) -> FlowMatchingSample:
    """One batch of per-sample :class:`FlowMatchingSample` s."""
    masks = [s.loss_mask for s in samples]
    return FlowMatchingSample(
        x_t=torch.cat([s.x_t for s in samples]),
        target=torch.cat([s.target for s in samples]),
        sigma=torch.cat([s.sigma for s in samples]),
        timestep=torch.cat([s.timestep for s in samples]),
        weight=torch.cat([s.weight for s in samples]),
        loss_mask=None if masks[0] is None else torch.cat(masks),
    )

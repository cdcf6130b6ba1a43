"""Videos from a video-diffusion module during training (:class:`VideoSamplingCallback`) and from ``forge
predict`` (:class:`VideoPredictionWriter`), written as mp4 files and logged to TensorBoard / W&B
(:mod:`~forge_lightning.callbacks.video_log`).

Who generates: a forward of a model whose parameters are split over ranks (FSDP2; ``traits.shards_model``) or
held apart from the module (``SeparateWeights``) needs every rank, so there every rank samples, in lockstep (same
prompts, seeds and steps, hence the same latents), and global rank 0 alone decodes, writes and logs. Elsewhere
(one device, DDP) rank 0 alone samples while the others go on to the next step's gradient all-reduce, where they
wait for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from forge_lightning.callbacks.video_log import log_video, video_frames, write_mp4
from forge_lightning.contracts import SeparateWeights, VideoGenerativeModule, module_weights, traits_of


def check_video_module(callback: Callback, module: LightningModule) -> None:
    """Refuse a module that cannot give RGB videos: not a :class:`VideoGenerativeModule`, or one without its
    decoder (the DiT's latents are not pixels)."""
    name = type(callback).__name__
    if not isinstance(module, VideoGenerativeModule):
        raise TypeError(
            f"{name} needs a video-generating module (generate, decode_latents, decodes_video: "
            f"forge_lightning.contracts.VideoGenerativeModule), got {type(module).__name__}"
        )
    if not module.decodes_video:
        raise ValueError(
            f"{name} writes RGB videos, but {type(module).__name__} has no decoder for its latents: configure "
            "model.init_args.vae (the Wan VAE directory; training from a feature cache does not need it otherwise)"
        )


def everyone_samples(trainer: Trainer) -> bool:
    """Whether every rank must take part in a forward of the module (see the module docstring)."""
    return traits_of(trainer.strategy).shards_model or isinstance(trainer.strategy, SeparateWeights)


class VideoSamplingCallback(Callback):
    """Every ``every_n_steps`` optimizer steps, generates one video per prompt (eval mode, no grad, prompt ``k``
    from the noise of ``seed + k``), writes ``step_<step>_<k>.mp4`` and logs it to TensorBoard (an animated GIF)
    and W&B (the mp4) as ``samples/video_<k>``.

    Args:
        prompts: the fixed prompts.
        every_n_steps: sample after every ``n`` optimizer steps.
        num_frames: video frames (``1 + 4k`` for the Wan VAE).
        height: video height in pixels.
        width: video width in pixels.
        num_inference_steps: sampler steps.
        guidance_scale: classifier-free guidance scale (1: none).
        seed: prompt ``k``'s noise is seeded with ``seed + k``, the same at every sampling step.
        fps: frames per second of the files.
        output_dir: where the mp4 files go (``None``: ``videos/`` under the trainer's log directory).
    """

    def __init__(
        self,
        prompts: list[str],
        every_n_steps: int,
        num_frames: int = 17,
        height: int = 480,
        width: int = 832,
        num_inference_steps: int = 20,
        guidance_scale: float = 5.0,
        seed: int = 0,
        fps: int = 16,
        output_dir: str | None = None,
    ) -> None:
        if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
            raise ValueError(f"prompts ({prompts!r}) must be a non-empty list of non-empty strings")
        counts = {"every_n_steps": every_n_steps, "fps": fps, "num_inference_steps": num_inference_steps}
        counts.update(num_frames=num_frames, height=height, width=width)
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} ({value}) must be at least 1")
        self.prompts = list(prompts)
        self.every_n_steps = every_n_steps
        self.size = {"num_frames": num_frames, "height": height, "width": width}
        self.steps, self.guidance = num_inference_steps, guidance_scale
        self.seed, self.fps = seed, fps
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.files: dict[int, list[Path]] = {}
        """The files written, by global step (global rank 0)."""
        self.videos: list[Tensor] = []
        """The last sampling's videos ``[3, F, H, W]`` in ``[-1, 1]`` (global rank 0)."""
        self._last_step = -1

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_video_module(self, pl_module)
        if self.output_dir is None:
            self.output_dir = Path(trainer.log_dir or trainer.default_root_dir) / "videos"

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # Under gradient accumulation the hook runs after each micro-batch; sample once per optimizer step.
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self._last_step = step
            self.sample(trainer, pl_module)

    def generate(self, pl_module: LightningModule, index: int) -> Tensor:
        """The latents of prompt ``index`` (a forward per step: every rank calls it under a sharded model)."""
        return pl_module.generate(
            [self.prompts[index]],
            **self.size,
            steps=self.steps,
            guidance=self.guidance,
            seed=[self.seed + index],
            decode=False,
        )

    def sample(self, trainer: Trainer, pl_module: LightningModule) -> list[Path]:
        """Generate, write and log one video per prompt; returns the files written (none off global rank 0)."""
        if not (everyone_samples(trainer) or trainer.is_global_zero):
            return []
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.no_grad(), module_weights(trainer.strategy):
                latents = [self.generate(pl_module, k) for k in range(len(self.prompts))]
                if not trainer.is_global_zero:
                    return []
                videos = [pl_module.decode_latents(x)[0].float().cpu() for x in latents]
        finally:
            pl_module.train(was_training)
        step = trainer.global_step
        assert self.output_dir is not None
        files = []
        for k, (prompt, video) in enumerate(zip(self.prompts, videos, strict=True)):
            frames = video_frames(video)
            path = write_mp4(self.output_dir / f"step_{step:06d}_{k}.mp4", frames, self.fps)
            log_video(trainer.loggers, f"samples/video_{k}", frames=frames, mp4=path, fps=self.fps, step=step,
                      caption=prompt)  # fmt: skip
            files.append(path)
        self.files[step], self.videos = files, videos
        rank_zero_info(f"video samples after {step} steps: {', '.join(str(f) for f in files)}")
        return files


class VideoPredictionWriter(BasePredictionWriter):
    """Writes the videos of ``forge predict`` (a batch of ``predict_step`` outputs ``[B, 3, F, H, W]`` in
    ``[-1, 1]`` beside the prompts' batch) as ``<index>.mp4`` and one JSONL line per video to ``index.jsonl``:
    ``{"prompt", "seed", "file"}`` (the file relative to ``output_dir``).

    Args:
        output_dir: where the videos and the index go (created; an index left there is replaced).
        fps: frames per second of the files.
    """

    INDEX = "index.jsonl"

    def __init__(self, output_dir: str, fps: int = 16) -> None:
        super().__init__(write_interval="batch")
        if fps < 1:
            raise ValueError(f"fps ({fps}) must be at least 1")
        self.output_dir = Path(output_dir)
        self.fps = fps

    @property
    def index_path(self) -> Path:
        return self.output_dir / self.INDEX

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_video_module(self, pl_module)
        if trainer.world_size > 1 and everyone_samples(trainer):
            # Lightning splits the prompts over the ranks without repeating any, so the ranks may run different
            # numbers of batches, and a sharded model's forward needs every rank.
            raise ValueError(
                f"forge predict of videos under {type(trainer.strategy).__name__} on {trainer.world_size} ranks is "
                "not supported (each rank generates its own prompts, and a sharded model needs all ranks in every "
                "forward): predict on one device, or under DDP (trainer.strategy: ddp)"
            )

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.index_path.write_text("")
        trainer.strategy.barrier("video_prediction_index")

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
        if not isinstance(prediction, Tensor) or prediction.ndim != 5 or prediction.shape[1] != 3:
            shape = tuple(prediction.shape) if isinstance(prediction, Tensor) else type(prediction).__name__
            raise ValueError(f"predict_step must return RGB videos [B, 3, F, H, W] in [-1, 1], got {shape}")
        lines = []
        for video, prompt, seed, index in zip(
            prediction, batch["prompt"], batch["seed"], batch["index"], strict=True
        ):
            path = write_mp4(self.output_dir / f"{int(index):05d}.mp4", video_frames(video), self.fps)
            lines.append(json.dumps({"prompt": prompt, "seed": int(seed), "file": path.name}) + "\n")
        with self.index_path.open("a", encoding="utf-8") as f:
            f.writelines(lines)

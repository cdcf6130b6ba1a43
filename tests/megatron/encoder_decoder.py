"""A tiny composed model for the per-component parallelism tests: patch encoder -> projector -> decoder LM, the shape
of a VLM, built from config.

::

    pixel_values [b, C, I, I] ─> PatchEncoder (ViT blocks) ─> [b, N, D] ─> Projector ─> [b, N, H] ─┐
    input_ids [b, S] ──────────> the LLM's embed_tokens ───────────────────────────────> [b, S, H] ─┴─ merge:
        [encoded; tokens] [b, N + S, H] ─> DecoderLM layers, norm, head; labels [ignore x N; labels]

Its plan declares the components ``encoder`` (its blocks), ``projector`` and ``llm`` and the
:class:`~forge_lightning.contracts.Composition` (``encode`` / ``merge``) that MegatronStrategy recomposes: the
native forward below uses the same two functions. Under MegatronStrategy its decoder runs as the LLM family's
megatron twin (``megatron_model``), the loss and its bookkeeping are the family's and the shared ones, as a VLM's
would be.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.contracts import Component, Composition, MegatronBuild, ParallelPlan
from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.model import DecoderLM
from forge_lightning.modules.objective import GlobalBatchLoss
from forge_lightning.optim import OptimizerConfig, SchedulerConfig, build_optimizer, build_scheduler

COMPONENTS = ("encoder", "projector", "llm")


@dataclasses.dataclass(kw_only=True)
class EncoderConfig:
    """A tiny ViT: ``(image_size / patch_size)^2`` patches of ``num_channels * patch_size^2`` values each."""

    image_size: int = 8
    patch_size: int = 4
    num_channels: int = 3
    hidden_size: int = 32
    num_heads: int = 2
    num_layers: int = 2
    intermediate_size: int = 64

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size ({self.patch_size}) must divide image_size ({self.image_size})")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class EncoderBlock(nn.Module):
    """Pre-norm ViT block: bidirectional attention over the patches, then a GELU MLP."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.norm1 = nn.LayerNorm(config.hidden_size)
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm2 = nn.LayerNorm(config.hidden_size)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x_BND: Tensor) -> Tensor:
        b, n, d = x_BND.shape
        qkv = self.qkv(self.norm1(x_BND)).view(b, n, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, heads, n, d / heads]
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x_BND = x_BND + self.proj(attn)
        return x_BND + self.fc2(F.gelu(self.fc1(self.norm2(x_BND))))


class PatchEncoder(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size)
        self.position = nn.Embedding(config.num_patches, config.hidden_size)
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, pixels_BCII: Tensor) -> Tensor:
        p = self.config.patch_size
        patches = F.unfold(pixels_BCII, kernel_size=p, stride=p).transpose(1, 2)  # [b, N, C * p * p]
        x_BND = self.patch_embed(patches) + self.position.weight
        for block in self.blocks:
            x_BND = block(x_BND)
        return self.norm(x_BND)


class Projector(nn.Module):
    """Encoder width -> the LLM's hidden size (a LLaVA-style two-layer MLP)."""

    def __init__(self, in_size: int, out_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_size, out_size)
        self.fc2 = nn.Linear(out_size, out_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderDecoder(nn.Module):
    """Encoder, projector and decoder LM; ``encode`` and ``merge`` are the plan's composition."""

    def __init__(self, encoder: EncoderConfig, llm: LLMConfig, ignore_index: int = -100) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.encoder = PatchEncoder(encoder)
        self.projector = Projector(encoder.hidden_size, llm.hidden_size)
        self.llm = DecoderLM(llm)

    def encode(self, batch: dict[str, Tensor]) -> Tensor:
        """``[b, N, H]``: each image on its own (no batch statistics), as the composition requires."""
        return self.projector(self.encoder(batch["pixel_values"]))

    def merge(
        self, tokens_BSH: Tensor, encoded_BNH: Tensor, batch: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """The encoded patches before the text; no token is predicted on them."""
        labels = batch["labels"]
        ignored = labels.new_full((labels.shape[0], encoded_BNH.shape[1]), self.ignore_index)
        return torch.cat([encoded_BNH, tokens_BSH], dim=1), torch.cat([ignored, labels], dim=1)

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(logits ``[b, N + S, V]``, labels ``[b, N + S]``)."""
        tokens_BSH = self.llm.model.embed_tokens(batch["input_ids"])
        x_BTH, labels_BT = self.merge(tokens_BSH, self.encode(batch), batch)
        rope = self.llm.model.rotary_emb(torch.arange(x_BTH.shape[1], device=x_BTH.device)[None])
        for layer in self.llm.model.layers:
            x_BTH = layer(x_BTH, rope)
        return self.llm.lm_head(self.llm.model.norm(x_BTH)), labels_BT


class EncoderDecoderLM(pl.LightningModule):
    """The LightningModule of :class:`EncoderDecoder`: next-token loss over the text (the global batch's token mean).

    Args:
        llm: the decoder's config (an ``LLMConfig`` preset name or fields).
        encoder: :class:`EncoderConfig` fields.
        freeze: components whose parameters do not train.
        optimizer: optimizer settings; scheduler: LR schedule.
    """

    def __init__(
        self,
        llm: str | dict[str, Any] = "debug",
        encoder: dict[str, Any] | None = None,
        freeze: list[str] | None = None,
        optimizer: dict[str, Any] | None = None,
        scheduler: dict[str, Any] | None = None,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        llm_config = LLMConfig.from_preset(llm) if isinstance(llm, str) else LLMConfig(**llm)
        self.model = EncoderDecoder(EncoderConfig(**(encoder or {})), llm_config, ignore_index)
        self.freeze = list(freeze or [])
        self.optimizer_config = OptimizerConfig(**(optimizer or {}))
        self.scheduler_config = SchedulerConfig(**(scheduler or {"name": "constant"}))
        self.ignore_index = ignore_index
        self.objective = GlobalBatchLoss()
        unknown = sorted(set(self.freeze) - set(COMPONENTS))
        if unknown:
            raise ValueError(f"freeze names {unknown}; the components are {list(COMPONENTS)}")
        for name in self.freeze:
            getattr(self.model, name).requires_grad_(False)

    def parallel_plan(self) -> ParallelPlan:
        m = self.model
        blocks = {"encoder": list(m.encoder.blocks), "projector": [], "llm": list(m.llm.model.layers)}
        return ParallelPlan(
            components=[
                Component(name=name, module=getattr(m, name), blocks=blocks[name], frozen=name in self.freeze)
                for name in COMPONENTS
            ],
            composition=Composition(decoder="llm", encode=m.encode, merge=m.merge),
        )

    def megatron_model(self, build: MegatronBuild) -> Any:
        """The decoder as the LLM family's megatron twin; the strategy runs the encoder side as it is."""
        from forge_lightning.modules.llm.megatron import DecoderTwin

        loss = LMLoss(ignore_index=self.ignore_index)
        return DecoderTwin(self.model.llm, build, loss=loss, objective=self.objective, log=self.log)

    def _loss_sum(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits, labels = self.model(batch)
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=self.ignore_index, reduction="sum"
        )
        return loss_sum, (labels != self.ignore_index).sum()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss_sum, tokens = self._loss_sum(batch)
        return self.objective.training_loss(self, batch, loss_sum, tokens)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss_sum, tokens = self._loss_sum(batch)
        self.objective.record_eval(torch.stack([loss_sum.detach().double(), tokens.double()]))

    def on_validation_epoch_end(self) -> None:
        self.objective.log_eval(self, "val")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.objective.log_train(self)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = build_optimizer(self.model, self.optimizer_config, implementation="for_loop")
        total = self.scheduler_config.total_steps or int(self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(optimizer, self.scheduler_config, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def samples(
    count: int, config: EncoderConfig, vocab_size: int, seq: int = 8, seed: int = 1
) -> list[dict[str, Tensor]]:
    """``count`` samples of random images and text (every text label trainable)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab_size, (seq + 1,), generator=g)
        pixels = torch.randn(config.num_channels, config.image_size, config.image_size, generator=g)
        out.append({"pixel_values": pixels, "input_ids": ids[:-1], "labels": ids[1:]})
    return out

"""A test-only family: a tiny MLP-Mixer classifier on random patches, built only on the contracts.

It exists to show that a family which is not a language model trains under every strategy (DDP, FSDP2 with and
without TP, MegatronStrategy) without a change under ``forge_lightning/strategies/``
(tests/family/test_contract_family.py). It is written the way a real family is: a config dataclass with a preset table, a plain
``nn.Module``, a LightningModule declaring its parallel plan, batch statistics and performance switches, the shared
:class:`~forge_lightning.modules.objective.GlobalBatchLoss`, a datamodule on forge's :class:`StepDataModule` and,
for MegatronStrategy, its own megatron-core twin (mixer_twin.py)::

    patches [b, P, F] ─ patch_embed ─> x [b, P, D] ─ blocks x N ─ norm ─ mean over P ─ head ─> logits [b, K]
    block:  x + token_mlp(token_norm(x)^T)^T      (mixes the P patches of each channel: P -> T -> P)
            x + channel_mlp(channel_norm(x))      (mixes the D channels of each patch:  D -> C -> D)

Loss: cross-entropy summed over the labelled samples (``labels != ignore_index``); the optimizer step follows the
mean over the global batch's labelled samples (the one batch rule, with the datamodule's ``step_tokens`` counting
labelled samples).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset
from typing_extensions import override

from forge_lightning.contracts import Component, ParallelPlan
from forge_lightning.datamodules.base import StepDataModule
from forge_lightning.modules.objective import GlobalBatchLoss
from forge_lightning.optim import OptimizerConfig, SchedulerConfig, build_optimizer, build_scheduler
from forge_lightning.performance import PerformanceConfig, configure_performance, resolve

if TYPE_CHECKING:
    from mixer_twin import MixerTwin

    from forge_lightning.contracts import MegatronBuild

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(kw_only=True)
class MixerConfig:
    """A tiny MLP-Mixer (Tolstikhin et al., 2021, "MLP-Mixer: An all-MLP Architecture for Vision").

    Args:
        num_patches: patches per sample (``P``).
        patch_dim: values per patch (``F``).
        hidden_size: channels of the residual stream (``D``).
        token_hidden_size: width of the token-mixing MLP (``T``).
        channel_hidden_size: width of the channel-mixing MLP (``C``).
        num_layers: mixer blocks.
        num_classes: classes of the head (``K``).
        layer_norm_eps: LayerNorm epsilon.
        position_embedding: add a learned embedding of each patch's position (an ``nn.Embedding`` table, which
            the optimizer does not decay) to the patch embeddings.
    """

    num_patches: int = 4
    patch_dim: int = 12
    hidden_size: int = 16
    token_hidden_size: int = 8
    channel_hidden_size: int = 32
    num_layers: int = 2
    num_classes: int = 6
    layer_norm_eps: float = 1e-5
    position_embedding: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{field.name} ({value!r}) must be a positive integer")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps ({self.layer_norm_eps!r}) must be positive")

    @classmethod
    def load(cls, value: str | dict[str, Any] | MixerConfig) -> MixerConfig:
        """A config from a preset name, a dict of fields or a config."""
        if isinstance(value, MixerConfig):
            return value
        if isinstance(value, str):
            if value not in PRESETS:
                raise ValueError(f"unknown mixer preset {value!r}; the presets are {sorted(PRESETS)}")
            return cls(**PRESETS[value])
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, dict[str, Any]] = {
    "debug": {},  # the defaults: 2,758 parameters
    "small": dict(  # 72,454 parameters
        num_patches=16, patch_dim=48, hidden_size=64, token_hidden_size=32, channel_hidden_size=256
    ),
}


# ----------------------------------------------------------------------------------------------- model


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` over the last dimension; ``out_bias``: whether ``fc2`` has a bias."""

    def __init__(self, size: int, hidden: int, *, out_bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(size, hidden)
        self.fc2 = nn.Linear(hidden, size, bias=out_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MixerBlock(nn.Module):
    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        self.token_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        # No output bias: it would add one constant to all channels of a patch, which every consumer (a LayerNorm
        # over the channels) removes; its gradient is rounding noise, which Adam would turn into full-size steps.
        self.token_mlp = MLP(config.num_patches, config.token_hidden_size, out_bias=False)
        self.channel_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.channel_mlp = MLP(config.hidden_size, config.channel_hidden_size)

    def forward(self, x_BPD: Tensor) -> Tensor:
        mixed_BDP = self.token_mlp(self.token_norm(x_BPD).transpose(1, 2))
        x_BPD = x_BPD + mixed_BDP.transpose(1, 2)
        return x_BPD + self.channel_mlp(self.channel_norm(x_BPD))


class MLPMixer(nn.Module):
    """Plain single-device model: ``[b, P, F]`` patches -> ``[b, K]`` logits."""

    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.patch_dim, config.hidden_size)
        if config.position_embedding:
            self.position = nn.Embedding(config.num_patches, config.hidden_size)
        self.blocks = nn.ModuleList(MixerBlock(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.num_classes)

    def forward(self, patches_BPF: Tensor) -> Tensor:
        x_BPD = self.patch_embed(patches_BPF)
        if self.config.position_embedding:
            x_BPD = x_BPD + self.position.weight
        for block in self.blocks:
            x_BPD = block(x_BPD)
        return self.head(self.norm(x_BPD).mean(dim=1))

    def tp_plan(self) -> dict[str, str]:
        """Tensor-parallel styles relative to one block (``forge_lightning.strategies.parallelize``'s names): each
        MLP column-parallel in, row-parallel out. Nothing outside the blocks is split; no ``sequence`` entries (the
        token-mixing MLP mixes over the patch dimension, which sequence parallelism would shard)."""
        return {
            "token_mlp.fc1": "colwise",
            "token_mlp.fc2": "rowwise",
            "channel_mlp.fc1": "colwise",
            "channel_mlp.fc2": "rowwise",
        }

    def tp_dims(self) -> dict[str, int]:
        """The widths a TP degree splits (the colwise layers' outputs)."""
        return {
            "token_hidden_size": self.config.token_hidden_size,
            "channel_hidden_size": self.config.channel_hidden_size,
        }


def classification_loss(logits_BK: Tensor, labels_B: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of the labelled samples' cross-entropy, number of labelled samples); ``IGNORE_INDEX`` labels add
    neither. The one loss of the family: the native steps and the megatron twin's loss function both call it."""
    loss_sum = F.cross_entropy(logits_BK.float(), labels_B, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (labels_B != IGNORE_INDEX).sum()


def training_flops_per_sample(config: MixerConfig) -> int:
    """Forward + backward matmul FLOPs of one sample (3 x 2 x multiply-adds)."""
    p, f, d, t, c = (
        config.num_patches,
        config.patch_dim,
        config.hidden_size,
        config.token_hidden_size,
        config.channel_hidden_size,
    )
    per_block = 2 * d * p * t + 2 * p * d * c
    return 6 * (p * f * d + config.num_layers * per_block + d * config.num_classes)


# ----------------------------------------------------------------------------------------------- module


def _as(cls: type, value: Any) -> Any:
    if value is None:
        return cls()
    return cls(**value) if isinstance(value, dict) else value


@runtime_checkable
class PatchData(Protocol):
    """A datamodule of patch samples, which the module checks against its config at setup."""

    num_patches: int
    patch_dim: int
    num_classes: int


class MixerClassifier(pl.LightningModule):
    """The LightningModule of :class:`MLPMixer`: classification loss, mean over the global batch's labelled samples.

    Args:
        config: a preset name (:data:`PRESETS`) or :class:`MixerConfig` fields.
        optimizer: optimizer settings (the CLI fills it from the top-level ``optimizer`` section).
        scheduler: learning-rate schedule (from the top-level ``scheduler`` section).
        performance: speed switches (from the top-level ``performance`` section); the strategy applies them to the
            plan, the module only ``optimizer`` (its Adam(W) kernels).
    """

    # The module applies the optimizer implementation itself (configure_optimizers); under MegatronStrategy the
    # twin names what it applies (mixer_twin.MixerTwin.performance_switches).
    performance_switches: ClassVar[frozenset[str]] = frozenset({"optimizer"})

    def __init__(
        self,
        config: str | dict[str, Any] = "debug",
        *,
        optimizer: OptimizerConfig | dict[str, Any] | None = None,
        scheduler: SchedulerConfig | dict[str, Any] | None = None,
        performance: PerformanceConfig | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = MixerConfig.load(config)
        self.optimizer_config: OptimizerConfig = _as(OptimizerConfig, optimizer)
        self.scheduler_config: SchedulerConfig = _as(SchedulerConfig, scheduler)
        self.performance: PerformanceConfig = _as(PerformanceConfig, performance)
        self.save_hyperparameters(
            {
                "config": self.config.to_dict(),
                "optimizer": dataclasses.asdict(self.optimizer_config),
                "scheduler": dataclasses.asdict(self.scheduler_config),
                "performance": self.performance.to_dict(),
            }
        )
        self.model = MLPMixer(self.config)
        self.objective = GlobalBatchLoss()

    # ----- contracts -------------------------------------------------------------------------------------------
    def parallel_plan(self) -> ParallelPlan:
        """One component, ``mixer``: its mixer blocks are the repeated blocks."""
        component = Component(
            name="mixer",
            module=self.model,
            blocks=list(self.model.blocks),
            tp_plan=self.model.tp_plan(),
            tp_dims=self.model.tp_dims(),
        )
        return ParallelPlan(components=[component])

    def megatron_model(self, build: MegatronBuild) -> MixerTwin:
        """The family's megatron-core twin for ``MegatronStrategy`` (same loss, same bookkeeping)."""
        from mixer_twin import MixerTwin

        return MixerTwin(self.model, build, objective=self.objective)

    def batch_stats(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """Samples, patches (as ``tokens``) and training FLOPs of a micro-batch."""
        batch_size, num_patches, _ = batch["patches"].shape
        return {
            "samples": batch_size,
            "tokens": batch_size * num_patches,
            "flops": batch_size * training_flops_per_sample(self.config),
        }

    @override
    def configure_model(self) -> None:
        configure_performance(self)

    @override
    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if not isinstance(datamodule, PatchData):
            return
        for name in ("num_patches", "patch_dim", "num_classes"):
            if getattr(datamodule, name) != getattr(self.config, name):
                raise ValueError(
                    f"data.{name} ({getattr(datamodule, name)}) differs from the model's config.{name} "
                    f"({getattr(self.config, name)})"
                )

    # ----- steps -----------------------------------------------------------------------------------------------
    def loss_sum(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return classification_loss(self.model(batch["patches"]), batch["labels"])

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss_sum, count = self.loss_sum(batch)
        return self.objective.training_loss(self, batch, loss_sum, count)

    @override
    def step_loss_sums(self) -> Tensor | None:
        return self.objective.pending_train()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.objective.log_train(self)

    def _eval_step(self, batch: dict[str, Tensor]) -> None:
        loss_sum, count = self.loss_sum(batch)
        self.objective.record_eval(torch.stack([loss_sum.detach().double(), count.double()]))

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    @override
    def on_validation_epoch_end(self) -> None:
        self.objective.log_eval(self, "val")

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    @override
    def on_test_epoch_end(self) -> None:
        self.objective.log_eval(self, "test")

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        device = next(self.model.parameters()).device
        implementation = resolve(self.performance, device).optimizer
        optimizer = build_optimizer(self.model, self.optimizer_config, implementation=implementation)
        total = self.scheduler_config.total_steps or int(self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(optimizer, self.scheduler_config, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ----------------------------------------------------------------------------------------------- data


class RandomPatches(Dataset):
    """``count`` samples of Gaussian patches labelled by a fixed random linear teacher (so the task is learnable);
    a fraction of them unlabelled (``IGNORE_INDEX``), so micro-batches hold different numbers of labelled samples.
    Deterministic in ``seed``."""

    def __init__(
        self, count: int, *, num_patches: int, patch_dim: int, num_classes: int, unlabelled: float, seed: int
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        teacher_FK = torch.randn(patch_dim, num_classes, generator=torch.Generator().manual_seed(0))
        self.patches_NPF = torch.randn(count, num_patches, patch_dim, generator=g)
        labels_N = (self.patches_NPF.mean(dim=1) @ teacher_FK).argmax(dim=-1)
        hidden = torch.rand(count, generator=g) < unlabelled
        self.labels_N = labels_N.masked_fill(hidden, IGNORE_INDEX)

    def __len__(self) -> int:
        return len(self.labels_N)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"patches": self.patches_NPF[i], "labels": self.labels_N[i]}


class MixerData(StepDataModule):
    """Random patch classification through forge's :class:`StepLoader` (training batches carry ``step_tokens``:
    the labelled samples of the step on this data rank) and :class:`ShardedLoader` (validation).

    Args:
        batch_size: micro-batch per data-parallel rank.
        num_train: training samples; num_val: validation samples.
        num_patches, patch_dim, num_classes: sample shape (must match the model's config).
        unlabelled: fraction of samples without a label (``IGNORE_INDEX``).
        seed: seed of the samples and of the per-epoch order.
        nan_sample: a training sample whose patches are NaN (the step holding it has a NaN loss and gradients on
            the rank that reads it: the non-finite guard must leave that step out on every rank).
    """

    label_key = "labels"  # step_tokens counts the labelled samples

    def __init__(
        self,
        batch_size: int = 4,
        *,
        num_train: int = 32,
        num_val: int = 8,
        num_patches: int = 4,
        patch_dim: int = 12,
        num_classes: int = 6,
        unlabelled: float = 0.25,
        seed: int = 0,
        num_workers: int = 0,
        nan_sample: int | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=False)
        self.nan_sample = nan_sample
        if not 0.0 <= unlabelled < 1.0:
            raise ValueError(f"unlabelled ({unlabelled}) must be in [0, 1)")
        self.num_train, self.num_val = num_train, num_val
        self.num_patches, self.patch_dim, self.num_classes = num_patches, patch_dim, num_classes
        self.unlabelled = unlabelled

    @override
    def setup(self, stage: str) -> None:
        shape = dict(num_patches=self.num_patches, patch_dim=self.patch_dim, num_classes=self.num_classes)
        self.train_dataset = RandomPatches(
            self.num_train, **shape, unlabelled=self.unlabelled, seed=self.seed + 1
        )
        if self.nan_sample is not None:
            self.train_dataset.patches_NPF[self.nan_sample] = float("nan")
        self.val_dataset = RandomPatches(
            self.num_val, **shape, unlabelled=self.unlabelled, seed=self.seed + 2
        )

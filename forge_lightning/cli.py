"""The ``forge`` command: LightningCLI with forge-lightning's defaults.

``forge fit|validate|test|predict --config x.yaml [--trainer.max_steps 50] [--optimizer.lr 3e-4]``. The model and
data are chosen by ``class_path`` in YAML; ``optimizer``, ``scheduler`` and ``performance`` are top-level sections handed to the
model. Every run saves its resolved config next to its logs and checkpoints.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import warnings
from typing import Any, NoReturn

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override

import forge_lightning.accelerators.kunlun  # noqa: F401  (registers trainer.accelerator: kunlun)
from forge_lightning.callbacks.config_drift import ConfigDriftCheck, ResumeOptions
from forge_lightning.callbacks.guard import NonFiniteGuard
from forge_lightning.callbacks.progress import StepProgressBar
from forge_lightning.callbacks.summary import ForgeModelSummary
from forge_lightning.contracts import StrategyTraits, deferred_pretrained, traits_of
from forge_lightning.distributed.elastic import fresh_store_after_restart
from forge_lightning.optim import OptimizerConfig, SchedulerConfig
from forge_lightning.performance import PerformanceConfig
from forge_lightning.resume import (
    checkpoint_dirs,
    elastic_restart_count,
    find_last_checkpoint,
    newest_checkpoint,
    remove_stale_temporaries,
)
from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO


class ForgeCLI(LightningCLI):
    """LightningCLI whose model and data are any LightningModule / LightningDataModule chosen by class_path.

    Adds top-level ``optimizer``, ``scheduler`` and ``performance`` sections (linked into the model), a progress bar
    counting optimizer steps (:class:`StepProgressBar`), a model summary without uncounted FLOPs
    (:class:`ForgeModelSummary`), a guard that skips optimizer steps with a non-finite loss or gradients
    (:class:`NonFiniteGuard`), the run's config in every checkpoint with a resume refused when it changed
    (:class:`ConfigDriftCheck`, ``--resume.allow_changes``) and atomic, ``weights_only`` checkpoint I/O by default.
    """

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            args=args,
            **kwargs,
        )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(OptimizerConfig, "optimizer", fail_untyped=True, sub_configs=True)
        parser.add_class_arguments(SchedulerConfig, "scheduler", fail_untyped=True, sub_configs=True)
        parser.link_arguments("optimizer", "model.init_args.optimizer", apply_on="instantiate")
        parser.link_arguments("scheduler", "model.init_args.scheduler", apply_on="instantiate")
        parser.add_class_arguments(PerformanceConfig, "performance", fail_untyped=True, sub_configs=True)
        parser.link_arguments("performance", "model.init_args.performance", apply_on="instantiate")
        parser.add_class_arguments(ResumeOptions, "resume", fail_untyped=True)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse ``args`` when given, else ``sys.argv``, without LightningCLI's warning about having both.

        Given ``args`` are the arguments: ``main(args=[...])`` and ``ForgeCLI(args=[...])`` are called from Python,
        where ``sys.argv`` belongs to the host program (pytest, a notebook kernel) and is not read.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            super().parse_arguments(parser, args)

    @override
    def _parse_ckpt_path(self) -> None:
        """Keep the YAML as the one source of the run's config.

        LightningCLI would merge the checkpoint's hyper-parameters into the config, re-parsing nested model
        configs as options. Here a checkpoint only supplies state: weights that do not fit the configured model
        fail to load with the mismatching names.
        """

    @override
    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        """Before ``fit``, remove the temporaries of saves that were killed midway in the run's checkpoint folders
        (global rank 0); ``--ckpt_path last`` becomes the run's newest complete last checkpoint across its
        ``version_N`` folders (:mod:`forge_lightning.resume`), or an error listing where it looked. After an elastic
        restart (``torchrun --max-restarts``) ``fit`` resumes from the run's newest complete checkpoint. ``predict``
        keeps no outputs (``return_predictions`` false unless given)."""
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if subcommand == "fit" and rank_zero_only.rank == 0:
            removed = remove_stale_temporaries(checkpoint_dirs(self.trainer))
            if removed:
                names = ", ".join(str(p) for p in removed[:3]) + (" ..." if len(removed) > 3 else "")
                rank_zero_info(f"removed {len(removed)} temporary file(s) of interrupted saves: {names}")
        restarts = elastic_restart_count()
        if subcommand == "fit" and restarts > 0:
            newest = newest_checkpoint(self.trainer)
            if newest is not None:
                kwargs["ckpt_path"] = str(newest)
                rank_zero_info(f"elastic restart {restarts}: resuming from the newest checkpoint, {newest}")
            elif kwargs.get("ckpt_path") in (None, "last"):
                kwargs["ckpt_path"] = None
                rank_zero_warn(
                    f"elastic restart {restarts}: the run has no checkpoint yet; training starts over"
                )
        if subcommand == "predict" and kwargs.get("return_predictions") is None:
            # The CLI drops what trainer.predict returns (prediction writers write it); keeping every batch's
            # outputs until the end costs memory (a video each) for nothing.
            kwargs["return_predictions"] = False
        if kwargs.get("ckpt_path") == "last":
            kwargs["ckpt_path"] = str(find_last_checkpoint(self.trainer))
            rank_zero_info(f"--ckpt_path last: {kwargs['ckpt_path']}")
        return kwargs

    @override
    def instantiate_classes(self) -> None:
        """Build the model under :func:`~forge_lightning.contracts.deferred_pretrained` when the strategy reads its
        own shards of the pretrained weights (``traits.reads_pretrained_shards``, e.g. megatron): no rank then loads
        the full model."""
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy") if config is not None else None
        if strategy_traits(strategy).reads_pretrained_shards:
            with deferred_pretrained():
                super().instantiate_classes()
        else:
            super().instantiate_classes()

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> Trainer:
        callbacks = list(callbacks)
        configured = config.get("callbacks") or []
        present = [*(configured if isinstance(configured, list) else [configured]), *callbacks]
        if not _has(present, NonFiniteGuard):
            callbacks.append(NonFiniteGuard())
        if self.subcommand == "fit" and not _has(present, ConfigDriftCheck):
            callbacks.append(self._config_drift_check())
        if not config.get("barebones"):  # barebones refuses progress bars and summaries
            if config.get("enable_progress_bar", True) is not False and not _has(present, ProgressBar):
                callbacks.append(StepProgressBar(leave=True))
            if config.get("enable_model_summary", True) is not False and not _has(present, ModelSummary):
                callbacks.append(ForgeModelSummary())
                # Else Lightning logs on every run that it skips its default summary for this one.
                config["enable_model_summary"] = False
        plugins = config.get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
        owns_io = strategy_traits(
            config.get("strategy")
        ).owns_checkpoint_io  # sharded checkpoints: its own I/O
        if not owns_io and not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        config["plugins"] = plugins or None
        return super()._instantiate_trainer(config, callbacks)

    def _config_drift_check(self) -> ConfigDriftCheck:
        """The run's resolved config (as saved next to its logs) in every checkpoint, compared on resume."""
        import yaml

        config = self.config.get(str(self.subcommand), self.config)
        resolved = yaml.safe_load(self._parser(self.subcommand).dump(config, skip_none=False))
        options = self._get(self.config_init, "resume")
        return ConfigDriftCheck(resolved, allow_changes=options.allow_changes if options else ())


def _has(callbacks: list, kind: type) -> bool:
    return any(isinstance(cb, kind) for cb in callbacks)


def strategy_traits(strategy: Any) -> StrategyTraits:
    """The :class:`~forge_lightning.contracts.StrategyTraits` of the configured strategy: an instance, a registered
    short name (``fsdp2``, ``megatron``...) resolved through Lightning's strategy registry, or a ``class_path``
    namespace not yet instantiated (Lightning's own strategies and unknown names: all traits off)."""
    return traits_of(_resolve_strategy(strategy))


def _resolve_strategy(strategy: Any) -> Any:
    """The strategy instance or class of a registered short name, a ``class_path`` namespace not yet
    instantiated, or an instance (``None`` when unknown)."""
    if isinstance(strategy, str):
        from lightning.pytorch.strategies import StrategyRegistry

        name = strategy.lower()
        return StrategyRegistry[name]["strategy"] if name in StrategyRegistry else None
    if strategy is not None and not isinstance(strategy, type) and hasattr(strategy, "class_path"):
        import importlib

        module, _, name = str(strategy.class_path).rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return None  # jsonargparse reports a bad class_path itself
    return strategy


def main(args: list[str] | None = None) -> None:
    """Entry point of ``forge`` and ``python -m forge_lightning``.

    Args:
        args: the command line without the program name (``["fit", "--config", "x.yaml"]``); ``None`` reads
            ``sys.argv``.
    """
    fresh_store_after_restart()
    try:
        ForgeCLI(args=args)  # None: LightningCLI reads sys.argv
    finally:
        # Tear the process group down before the interpreter exits: a group left to process exit can abort
        # in its communication threads' destructors ("terminate called without an active exception").
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def exit_now(code: int = 0) -> NoReturn:
    """End the process as the interpreter would, less its last stage: wait for the threads that are not daemons,
    run the exit handlers (loggers and W&B flush there, Lightning destroys NCCL groups), flush the standard
    streams, then leave. Skipped: the interpreter's teardown, which frees every tensor, CUDA block and pinned host
    block one by one (seconds after a large model's run; the operating system reclaims it all at once)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run(args: list[str] | None = None) -> NoReturn:
    """The ``forge`` command and ``python -m forge_lightning``: :func:`main`, then :func:`exit_now` once it
    succeeded (an error takes the interpreter's usual way out: its traceback and exit code 1)."""
    main(args)
    exit_now(0)


if __name__ == "__main__":
    run()

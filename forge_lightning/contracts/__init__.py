"""The contracts between a LightningModule, its LightningDataModule and the strategy that trains them.

What each layer expects of the others is declared here once, as dataclasses and ``typing.Protocol`` s, and read
through ``isinstance`` checks instead of attribute probing::

    datamodule ──batches (STEP_TOKENS), TextData──▶ module ──ParallelPlan, protocols of module.py──▶ strategy
                                                    module ◀──StrategyTraits, protocols of strategy.py── strategy
                                 MegatronStrategy ◀──MegatronModule / MegatronTwin (megatron.py)──▶ family

* :mod:`~forge_lightning.contracts.plan`: the parallel plan (components, blocks, TP plan and its divisors, frozen
  parts, the composition of encoder -> decoder models).
* :mod:`~forge_lightning.contracts.module`: what a module provides (plan, batch statistics, performance switches,
  generation, export) and how its pretrained weights may be left for the strategy to read.
* :mod:`~forge_lightning.contracts.strategy`: a strategy's traits and what it provides (data-parallel layout,
  gathered state dicts, the module's weights, the trained parameters, parameter resync).
* :mod:`~forge_lightning.contracts.data`: batch keys and the text datamodule's description.
* :mod:`~forge_lightning.contracts.megatron`: the megatron-core model a family provides for ``MegatronStrategy``.
* :mod:`~forge_lightning.contracts.accelerator`: what an accelerator declares beyond Lightning's API (its
  process-group backend and DeviceMesh device type, its synchronisation and memory).

Nothing here imports a family or a strategy; ``strategies/`` imports no family (tests/test_layout.py checks both
ways).
"""

from forge_lightning.contracts.accelerator import (
    DistributedDevices,
    MeasuredDevices,
    device_mesh_type,
    process_group_backend,
)
from forge_lightning.contracts.data import STEP_TOKENS, TextData, VisionTextData
from forge_lightning.contracts.megatron import (
    CP_COMM_TYPES,
    LOSS_AND_COUNT,
    MegatronBuild,
    MegatronDims,
    MegatronModule,
    MegatronTwin,
    MoECommOverlap,
    experts_apart,
)
from forge_lightning.contracts.module import (
    ConfiguredModule,
    ContextParallelModule,
    ExportableModule,
    GenerativeModule,
    MeasuredModule,
    PlannedModule,
    SkippedStepAware,
    StepLoss,
    TunedModule,
    VideoGenerativeModule,
    deferred_pretrained,
    pretrained_deferred,
)
from forge_lightning.contracts.plan import (
    Component,
    Composition,
    ExpertStack,
    ParallelPlan,
    common_divisors,
    take_samples,
)
from forge_lightning.contracts.strategy import (
    DataParallelLayout,
    GradientGate,
    LazyParameterGather,
    ParameterResync,
    SeparateWeights,
    StateGatherer,
    StrategyTraits,
    TensorParallelLayout,
    TrainedParameters,
    complete_parameter_gather,
    data_parallel,
    full_state_dict,
    module_weights,
    nonfinite_gradients,
    skip_optimizer_step,
    tensor_parallel_size,
    trained_parameters,
    traits_of,
)

__all__ = [
    "CP_COMM_TYPES",
    "LOSS_AND_COUNT",
    "STEP_TOKENS",
    "Component",
    "Composition",
    "ExpertStack",
    "ContextParallelModule",
    "DataParallelLayout",
    "DistributedDevices",
    "ExportableModule",
    "GenerativeModule",
    "GradientGate",
    "LazyParameterGather",
    "MeasuredDevices",
    "MeasuredModule",
    "MegatronBuild",
    "MegatronDims",
    "MegatronModule",
    "MegatronTwin",
    "MoECommOverlap",
    "ParallelPlan",
    "ParameterResync",
    "PlannedModule",
    "SeparateWeights",
    "StateGatherer",
    "ConfiguredModule",
    "SkippedStepAware",
    "StepLoss",
    "StrategyTraits",
    "TensorParallelLayout",
    "TextData",
    "TrainedParameters",
    "TunedModule",
    "VideoGenerativeModule",
    "VisionTextData",
    "common_divisors",
    "complete_parameter_gather",
    "data_parallel",
    "deferred_pretrained",
    "device_mesh_type",
    "experts_apart",
    "full_state_dict",
    "module_weights",
    "nonfinite_gradients",
    "pretrained_deferred",
    "process_group_backend",
    "skip_optimizer_step",
    "take_samples",
    "tensor_parallel_size",
    "trained_parameters",
    "traits_of",
]

"""Optimizers and learning-rate schedules configured from YAML."""

from forge_lightning.optim.muon import MatrixSplit, Muon, SplitRows
from forge_lightning.optim.muon_groups import (
    MatrixParts,
    ParamChoice,
    choose_params,
    muon_groups,
    muon_summary,
)
from forge_lightning.optim.muon_options import DEFAULT_ADAMW_PARAMS, MuonOptions
from forge_lightning.optim.param_groups import (
    OptimizerConfig,
    build_optimizer,
    component_param_groups,
    optimizer_for_groups,
    param_groups,
)
from forge_lightning.optim.schedulers import SchedulerConfig, build_scheduler, lr_lambda

__all__ = [
    "DEFAULT_ADAMW_PARAMS",
    "MatrixParts",
    "MatrixSplit",
    "Muon",
    "MuonOptions",
    "OptimizerConfig",
    "ParamChoice",
    "SchedulerConfig",
    "SplitRows",
    "build_optimizer",
    "build_scheduler",
    "choose_params",
    "component_param_groups",
    "lr_lambda",
    "muon_groups",
    "muon_summary",
    "optimizer_for_groups",
    "param_groups",
]

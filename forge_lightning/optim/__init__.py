"""Optimizers and learning-rate schedules configured from YAML."""

from forge_lightning.optim.param_groups import (
    OptimizerConfig,
    build_optimizer,
    component_param_groups,
    optimizer_for_groups,
    param_groups,
)
from forge_lightning.optim.schedulers import SchedulerConfig, build_scheduler, lr_lambda

__all__ = [
    "OptimizerConfig",
    "SchedulerConfig",
    "build_optimizer",
    "build_scheduler",
    "component_param_groups",
    "lr_lambda",
    "optimizer_for_groups",
    "param_groups",
]

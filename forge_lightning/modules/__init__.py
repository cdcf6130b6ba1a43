"""Model families. Each family is a folder: config.py, model.py (plain nn.Module), hf.py, module.py."""

from forge_lightning.modules.plan import Component, ParallelPlan

__all__ = ["Component", "ParallelPlan"]

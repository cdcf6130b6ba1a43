"""Model families. Each family is a folder: config.py, model.py (plain nn.Module), hf.py, module.py."""

from forge_lightning.modules.plan import Component, Composition, ParallelPlan

__all__ = ["Component", "Composition", "ParallelPlan"]

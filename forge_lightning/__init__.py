"""forge-lightning: a training framework for LLMs, VLMs, video diffusion and embodied models on Lightning."""

__version__ = "0.1.0"

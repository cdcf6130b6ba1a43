"""Video diffusion: the Wan DiT (Wan 2.1 / 2.2 T2V, I2V, TI2V) with its diffusers interchange."""

from forge_lightning.modules.diffusion.wan_config import PRESETS, WanDiTConfig, preset
from forge_lightning.modules.diffusion.wan_hf import load_pretrained, save_pretrained
from forge_lightning.modules.diffusion.wan_model import CrossContext, WanBlock, WanDiT

__all__ = [
    "PRESETS",
    "CrossContext",
    "WanBlock",
    "WanDiT",
    "WanDiTConfig",
    "load_pretrained",
    "preset",
    "save_pretrained",
]

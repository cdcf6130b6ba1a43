"""Export of Hugging Face-format weights at the end of training."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from forge_lightning.callbacks.guard import check_finite_weights
from forge_lightning.contracts import TextData


class HFExport(Callback):
    """Writes the trained model as a Hugging Face directory (config.json + safetensors, and the tokenizer).

    The module must implement ``save_pretrained(dirpath)``; the tokenizer is taken from the datamodule when it has
    one, so the export loads directly with ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``. An export
    already in ``dirpath`` is replaced (atomically).

    Args:
        dirpath: output directory; ``None`` writes ``<log_dir>/hf``.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.exported_to: Path | None = None

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        check_finite_weights(trainer, pl_module, "Hugging Face export")
        root = trainer.log_dir or trainer.default_root_dir
        out = Path(self.dirpath or os.path.join(root, "hf"))
        pl_module.save_pretrained(out, overwrite=True)
        if trainer.is_global_zero and isinstance(trainer.datamodule, TextData):
            trainer.datamodule.tokenizer.save_pretrained(out)
        self.exported_to = out
        rank_zero_info(f"exported Hugging Face weights to {out}")

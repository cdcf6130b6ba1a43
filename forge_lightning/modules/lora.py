"""LoRA (Hu et al. 2021, arXiv:2106.09685) as a transform applied to a built model, through ``peft``.

The plain model stays the reference: :func:`apply_lora` injects low-rank adapters into the named linear layers in
place (their weights become ``<name>.base_layer.weight`` plus ``<name>.lora_A/B``) and freezes everything else.
Because native submodule names follow Hugging Face, the adapter saved by :func:`save_adapter` is a standard PEFT
adapter (``adapter_config.json`` + ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads
onto the ``transformers`` model, and :func:`merge_adapter` folds one back into plain weights.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TIED = ("embed_tokens", "lm_head")
_PEFT_PREFIX = "base_model.model."  # what peft puts before the adapted module's names


@dataclass(kw_only=True)
class LoRAConfig:
    """Low-rank adapters on the linear layers chosen by name.

    Args:
        rank: adapter rank ``r``.
        alpha: scaling numerator: the update is ``(alpha / rank) * B @ A``.
        dropout: dropout on the adapter input.
        target_modules: module-name suffixes (e.g. ``["q_proj", "v_proj"]``) or one regular expression matched
            against full module names (e.g. ``".*layers\\.[0-3]\\..*(q|v)_proj"``).
        modules_to_save: modules trained fully and saved with the adapter (e.g. ``["embed_tokens", "lm_head"]``).
        init_seed: seed of the adapter initialisation, so runs and resumes build the same adapters.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: list(DEFAULT_TARGETS))
    modules_to_save: list[str] = field(default_factory=list)
    init_seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank ({self.rank!r}) must be a positive integer")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha ({self.alpha}) must be positive")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout ({self.dropout}) must be in [0, 1)")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name at least one module")
        if not isinstance(self.target_modules, str):
            self.target_modules = list(self.target_modules)
        self.modules_to_save = list(self.modules_to_save)

    def to_peft(self, base_model_name_or_path: str | None = None) -> Any:
        """The equivalent ``peft.LoraConfig``."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            modules_to_save=self.modules_to_save or None,
            base_model_name_or_path=base_model_name_or_path,
        )


def apply_lora(model: nn.Module, config: LoRAConfig, *, base_model_name_or_path: str | None = None) -> Any:
    """Inject LoRA adapters into ``model`` in place and freeze every other parameter.

    ``model`` keeps its identity and forward (the adapted layers wrap the original ones); the returned
    ``peft.PeftModel`` wrapper is what :func:`save_adapter` needs.

    Args:
        model: the model (its ``config.tie_word_embeddings``, if any, is honoured).
        config: which layers get adapters and which train fully.
        base_model_name_or_path: recorded in ``adapter_config.json`` (the base checkpoint directory).

    Raises:
        ValueError: tied embeddings listed in ``modules_to_save`` (training one copy would untie them), or no
            module matched ``target_modules``.
    """
    import torch
    from peft import get_peft_model

    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and set(config.modules_to_save) & set(_TIED):
        raise ValueError(
            f"lora.modules_to_save ({config.modules_to_save}) names a tied embedding: the model ties embed_tokens "
            "and lm_head, and training one copy would untie them; leave them out or use an untied model"
        )
    if base_model_name_or_path is not None:
        # peft records the base checkpoint from this attribute (as on a transformers model).
        model.name_or_path = str(base_model_name_or_path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.init_seed)
        return get_peft_model(model, config.to_peft(base_model_name_or_path))


def save_adapter(
    peft_model: Any, path: str | os.PathLike[str], state_dict: Mapping[str, Tensor] | None = None
) -> Path:
    """Write the adapter in Hugging Face PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``).

    Args:
        peft_model: what :func:`apply_lora` returned.
        path: the output directory.
        state_dict: the adapted module's full state dict (names relative to it), e.g. gathered from a sharded
            model, whose own parameters are then shards; default: the module's own tensors.
    """
    path = Path(path)
    options: dict[str, Any] = {}
    if state_dict is not None:
        options["state_dict"] = {f"{_PEFT_PREFIX}{k}": v for k, v in state_dict.items()}
    # The vocabulary never differs from the base model's here, so peft's check for resized embeddings (which
    # would reload the base config through transformers) is skipped; `modules_to_save` are saved regardless.
    peft_model.save_pretrained(str(path), safe_serialization=True, save_embedding_layers=False, **options)
    return path


def merge_adapter(model: nn.Module, adapter_dir: str | os.PathLike[str]) -> nn.Module:
    """Load a PEFT adapter onto ``model`` and fold it into the weights; return the plain merged model.

    Args:
        model: the base model, with the weights the adapter was trained on.
        adapter_dir: a directory written by :func:`save_adapter` (or any PEFT LoRA adapter of this architecture).
    """
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no adapter_config.json in {adapter_dir}")
    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def merged_state_dict(
    state: Mapping[str, Tensor], config: LoRAConfig, adapter: str = "default"
) -> dict[str, Tensor]:
    """The plain state dict of a model with LoRA adapters injected (:func:`apply_lora`), the adapters folded in:
    ``W + (alpha / rank) * B @ A`` under each adapted layer's own name, the trained copy of each
    ``modules_to_save`` module in place of the original.

    Works on a full state dict alone (e.g. gathered from a sharded model), without the modules.

    Args:
        state: the adapted model's state dict (``<layer>.base_layer.*``, ``<layer>.lora_A.<adapter>.weight``, ...).
        config: the adapters' settings (their scale).
        adapter: the adapter's name in peft.
    """
    scale = config.alpha / config.rank
    lora = (f".lora_A.{adapter}.", f".lora_B.{adapter}.")
    merged: dict[str, Tensor] = {}
    for key, value in state.items():
        if any(part in key for part in lora) or ".original_module." in key:
            continue
        if ".base_layer." in key:
            layer, name = key.split(".base_layer.")
            if name == "weight":
                a = state[f"{layer}.lora_A.{adapter}.weight"].float()
                b = state[f"{layer}.lora_B.{adapter}.weight"].float()
                value = (value.float() + scale * (b @ a)).to(value.dtype)
            merged[f"{layer}.{name}"] = value
        elif f".modules_to_save.{adapter}." in key:
            merged[key.replace(f".modules_to_save.{adapter}.", ".")] = value
        else:
            merged[key] = value
    return merged

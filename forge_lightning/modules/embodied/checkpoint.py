"""Pi0.5 checkpoints in the lerobot / openpi PyTorch layout (safetensors), mapped one to one onto :class:`Pi05`.

lerobot's ``PI05Policy`` saves ``model.``-prefixed keys (``model.paligemma_with_expert.paligemma.model.
language_model.layers.0.self_attn.q_proj.weight``); openpi's PyTorch export has the same keys without the prefix.
Every tensor maps to one parameter of ours by a prefix rename (:data:`LAYOUT`). Two output heads of the layout are
never used by Pi0.5 and are skipped on load: ``paligemma.lm_head`` (PaliGemma's text head; only read as the token
embedding when a file stores the tied embedding under that name) and ``gemma_expert.lm_head``. openpi's older
``action_time_mlp_*`` names are read as ``time_mlp_*``. Files saved under recent transformers releases, whose
SigLIP vision tower has no ``vision_model`` level (``...vision_tower.encoder.layers.0...``), are read as well.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch import Tensor

from forge_lightning.modules.embodied.model import Pi05
from forge_lightning.modules.layers import load_exact
from forge_lightning.modules.llm.hf import load_hf_state_dict

_PALIGEMMA = "paligemma_with_expert.paligemma."
_VISION_TOWER = _PALIGEMMA + "model.vision_tower."
_SIGLIP = _VISION_TOWER + "vision_model."
LAYOUT: tuple[tuple[str, str], ...] = (
    (_SIGLIP, "vision.tower."),
    (_PALIGEMMA + "model.multi_modal_projector.linear.", "vision.projector."),
    (_PALIGEMMA + "model.language_model.", "llm."),
    ("paligemma_with_expert.gemma_expert.model.", "action_expert."),
    ("action_in_proj.", "action_expert.action_in_proj."),
    ("action_out_proj.", "action_expert.action_out_proj."),
    ("time_mlp_in.", "action_expert.time_mlp_in."),
    ("time_mlp_out.", "action_expert.time_mlp_out."),
)
"""(lerobot / openpi key prefix, our parameter-name prefix), a bijection on the tensors Pi0.5 uses."""

TEXT_HEAD = _PALIGEMMA + "lm_head.weight"
EXPERT_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"
_EMBEDDING = "llm.embed_tokens.weight"
_RENAMED = {"action_time_mlp_in.": "time_mlp_in.", "action_time_mlp_out.": "time_mlp_out."}


def _strip(key: str) -> str:
    key = key.removeprefix("model.")
    if key.startswith(_VISION_TOWER) and not key.startswith(_SIGLIP):
        key = _SIGLIP + key.removeprefix(_VISION_TOWER)
    for old, new in _RENAMED.items():
        if key.startswith(old):
            return new + key.removeprefix(old)
    return key


def _rule(key: str, side: int) -> tuple[str, str]:
    """The :data:`LAYOUT` pair whose prefix on ``side`` (0: lerobot, 1: ours) is the longest one ``key`` starts with."""
    matches = [pair for pair in LAYOUT if key.startswith(pair[side])]
    if not matches:
        raise KeyError(f"{key!r} is not part of the Pi0.5 checkpoint layout")
    return max(matches, key=lambda pair: len(pair[side]))


def from_lerobot_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Our parameter names for a lerobot / openpi Pi0.5 state dict.

    Raises:
        KeyError: a key that is not part of the Pi0.5 layout.
    """
    ours: dict[str, Tensor] = {}
    text_head = None
    for key, tensor in state.items():
        key = _strip(key)
        if key == TEXT_HEAD:
            text_head = tensor
            continue
        if key == EXPERT_HEAD:
            continue
        theirs, mine = _rule(key, side=0)
        ours[mine + key.removeprefix(theirs)] = tensor
    if _EMBEDDING not in ours and text_head is not None:
        ours[_EMBEDDING] = text_head  # files that stored the tied embedding under the head's name
    return ours


def to_lerobot_state_dict(
    model: Pi05, *, prefix: str = "model.", with_heads: bool = True
) -> dict[str, Tensor]:
    """``model``'s parameters under lerobot's keys (what ``PI05Policy.from_pretrained`` loads).

    Args:
        model: the model to export.
        prefix: prepended to every key (``"model."`` as lerobot's policy saves; ``""`` for openpi's layout).
        with_heads: add the two unused output heads lerobot's model has (the text head as a copy of the token
            embedding, the expert's head as zeros), so that lerobot's strict loading finds every key.
    """
    state = {}
    for name, tensor in model.state_dict().items():
        theirs, mine = _rule(name, side=1)
        state[prefix + theirs + name.removeprefix(mine)] = tensor
    if with_heads:
        embedding = model.llm.embed_tokens.weight.detach()
        state[prefix + TEXT_HEAD] = embedding.clone()
        width = model.config.action_expert.hidden_size
        state[prefix + EXPERT_HEAD] = embedding.new_zeros(embedding.shape[0], width)
    return state


def load_lerobot_checkpoint(model: Pi05, path: str | os.PathLike[str]) -> Pi05:
    """Load a lerobot / openpi Pi0.5 checkpoint into ``model`` (cast to the model's dtypes).

    Args:
        model: a :class:`Pi05` built with the checkpoint's sizes.
        path: a directory with ``model.safetensors`` (or a sharded index) or a ``.safetensors`` file.

    Raises:
        ValueError: tensors are missing, unexpected or of another shape than the model's (the message names them).
    """
    state = from_lerobot_state_dict(load_hf_state_dict(path))
    load_exact(model, state, what=f"the Pi0.5 weights of {path}", owner="model")
    return model

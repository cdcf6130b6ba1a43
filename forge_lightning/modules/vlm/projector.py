"""Projectors from the vision encoder's width to the language model's, with their configs (:data:`PROJECTORS`).

``mlp`` is LLaVA's multi-modal projector (Liu et al. 2023, "Improved Baselines with Visual Instruction Tuning",
arXiv:2310.03744): ``linear_2(act(linear_1(x)))``, with transformers' names below ``multi_modal_projector.``.
``mlp_newline`` is LLaVA-OneVision's: the same MLP and an ``image_newline`` embedding (transformers keeps it beside
the projector, as ``image_newline``). ``none`` is for encoders that already end in the LLM's width (Qwen2.5-VL's
patch merger).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers import init_linear
from forge_lightning.modules.layers.activations import ACTIVATIONS, activation


@dataclass(kw_only=True)
class IdentityProjectorConfig:
    """No projector: the encoder's features go to the LLM as they are (``projector: none``)."""

    def check_widths(self, vision_width: int, llm_width: int) -> None:
        """Raise ``ValueError`` unless the encoder's output width is the LLM's."""
        if vision_width != llm_width:
            raise ValueError(
                f"vision.out_hidden_size ({vision_width}) must equal llm.hidden_size ({llm_width}) with projector "
                "'none' (or use projector 'mlp')"
            )

    def build(self, vision_width: int, llm_width: int, *, init_std: float = 0.02) -> nn.Module:
        """The projector module (an ``nn.Identity``: it holds no parameters)."""
        return nn.Identity()


@dataclass(kw_only=True)
class MLPProjectorConfig:
    """LLaVA's two-layer MLP projector (``projector: mlp``).

    Args:
        bias: both linear layers carry a bias (``multimodal_projector_bias``).
        hidden_act: the activation between them (``projector_hidden_act``; a key of
            :data:`~forge_lightning.modules.layers.activations.ACTIVATIONS`).
    """

    bias: bool = True
    hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"projector.hidden_act ({self.hidden_act!r}) is not supported; supported: {', '.join(ACTIVATIONS)}"
            )

    def check_widths(self, vision_width: int, llm_width: int) -> None:
        """Any widths fit: the MLP maps one to the other."""

    def build(self, vision_width: int, llm_width: int, *, init_std: float = 0.02) -> nn.Module:
        """A freshly initialised :class:`MultiModalProjector`."""
        return MultiModalProjector(
            vision_width, llm_width, bias=self.bias, hidden_act=self.hidden_act, init_std=init_std
        )


@dataclass(kw_only=True)
class MLPNewlineProjectorConfig(MLPProjectorConfig):
    """LLaVA-OneVision's projector (``projector: mlp_newline``): LLaVA's MLP and the learned ``image_newline``
    embedding that ends every row of an image's tile features (see :mod:`~forge_lightning.modules.vlm.anyres`).
    The fields are :class:`MLPProjectorConfig`'s."""

    def build(self, vision_width: int, llm_width: int, *, init_std: float = 0.02) -> nn.Module:
        """A freshly initialised :class:`NewlineProjector`."""
        return NewlineProjector(
            vision_width, llm_width, bias=self.bias, hidden_act=self.hidden_act, init_std=init_std
        )


PROJECTORS: dict[str, type] = {
    "none": IdentityProjectorConfig,
    "mlp": MLPProjectorConfig,
    "mlp_newline": MLPNewlineProjectorConfig,
}
"""Projector configs by the name a ``projector`` section gives (its ``type``)."""


class MultiModalProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: vision features ``[..., vision_width]`` to LLM embeddings
    ``[..., llm_width]``.

    Args:
        vision_width: width of the encoder's features.
        llm_width: the LLM's hidden size (also the width between the two layers).
        bias: both layers carry a bias.
        hidden_act: the activation between them.
        init_std: standard deviation of the normal initialisation of the weights (biases are zeroed).
    """

    def __init__(
        self,
        vision_width: int,
        llm_width: int,
        *,
        bias: bool = True,
        hidden_act: str = "gelu",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.init_std = init_std
        self.linear_1 = nn.Linear(vision_width, llm_width, bias=bias)
        self.act = activation(hidden_act, "projector.hidden_act")
        self.linear_2 = nn.Linear(llm_width, llm_width, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_linear(self.linear_1, self.init_std)
        init_linear(self.linear_2, self.init_std)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class NewlineProjector(MultiModalProjector):
    """:class:`MultiModalProjector` with LLaVA-OneVision's ``image_newline`` ``[llm_width]``, the embedding the
    tower puts after each row of an image's tile features (its forward is the MLP's).

    Args:
        vision_width: width of the encoder's features.
        llm_width: the LLM's hidden size.
        options: :class:`MultiModalProjector`'s (``bias``, ``hidden_act``, ``init_std`` of the MLP weights);
            ``image_newline`` is drawn with ``1 / sqrt(llm_width)``, as transformers does.
    """

    def __init__(self, vision_width: int, llm_width: int, **options: Any) -> None:
        super().__init__(vision_width, llm_width, **options)
        self.image_newline = nn.Parameter(torch.empty(llm_width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "image_newline"):  # the MLP's __init__ resets before the newline exists
            nn.init.normal_(self.image_newline, std=self.image_newline.numel() ** -0.5)

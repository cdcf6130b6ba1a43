"""Projectors from the vision encoder's width to the language model's, with their configs (:data:`PROJECTORS`).

``mlp`` is LLaVA's multi-modal projector (Liu et al. 2023, "Improved Baselines with Visual Instruction Tuning",
arXiv:2310.03744): ``linear_2(act(linear_1(x)))``, with transformers' names below ``multi_modal_projector.``.
``none`` is for encoders that already end in the LLM's width (Qwen2.5-VL's patch merger).
"""

from __future__ import annotations

from dataclasses import dataclass

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


PROJECTORS: dict[str, type] = {"none": IdentityProjectorConfig, "mlp": MLPProjectorConfig}
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

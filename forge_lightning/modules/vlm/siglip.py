"""The SigLIP vision tower (Zhai et al. 2023, arXiv:2303.15343) as LLaVA uses it: a plain ViT over fixed-size
images, without a class token. Its configuration and weight mapping live here too. Pi0.5's image path
(``forge_lightning.modules.embodied.siglip``) is built on this tower as well.

::

    pixel_values [N, C, S, S]
      ─ embeddings: Conv2d patch_size x patch_size, stride patch_size ─ [N, T, hidden] + learned positions
      ─ [EncoderLayer] x num_layers:  x + attn(layer_norm1(x)); x + mlp(layer_norm2(x))      (GELU-tanh MLP)
      ─ post_layernorm                                                      (SiglipVisionModel.last_hidden_state)

    T = (image_size // patch_size) ** 2 patch tokens, in raster order.

LLaVA does not take the last hidden state: it takes transformers' ``hidden_states[feature_layer]`` (0 is the
embeddings, ``i`` the output of layer ``i``, negative counts from the end; before ``post_layernorm``), concatenates
several along the width when ``feature_layer`` is a list, and with ``feature_select_strategy`` ``default`` drops the
first token (CLIP's class token; SigLIP has none, so a patch goes, exactly as in transformers). Only the layers up to
the deepest selected one run, so, as in transformers, the later layers and ``post_layernorm`` get no gradient.

Parameter names are transformers' ``SiglipVisionModel`` names (``embeddings.{patch_embedding,position_embedding}``,
``encoder.layers.N.{layer_norm1,self_attn.{q,k,v,out}_proj,layer_norm2,mlp.fc1,mlp.fc2}``, ``post_layernorm``);
checkpoints of ``SiglipModel`` and transformers 4 keep them below ``vision_model.``. The attention-pooling ``head``
(SigLIP's contrastive embedding) is not built: LLaVA never uses it and its weights are skipped on load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers import attention
from forge_lightning.modules.layers.activations import ACTIVATIONS, activation
from forge_lightning.modules.layers.init import reset_owned_parameters
from forge_lightning.modules.layers.state_dict import load_exact

HF_MODEL_TYPE = "siglip_vision_model"
HF_PREFIX = "vision_model."
"""Prefix of the tower's tensors in ``SiglipModel`` checkpoints (and ``SiglipVisionModel`` ones of transformers 4)."""
HEAD_PREFIX = "head."
"""The attention-pooling head's tensors, which the tower does not build."""

FEATURE_SELECT_STRATEGIES = ("default", "full")
"""LLaVA's ``vision_feature_select_strategy``: ``default`` drops the first token of each image, ``full`` keeps all."""

# transformers' SiglipVisionConfig defaults: old config.json files leave out the keys that have them.
_HF_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
_HF_RENAMES = {
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_channels": "in_channels",
}
_POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "image_size", "patch_size")

PRESETS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/google/siglip-so400m-patch14-384/blob/main/config.json (vision_config)
    "siglip-so400m-patch14-384": {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_layers": 27,
        "num_heads": 16,
        "image_size": 384,
        "patch_size": 14,
    },
    # https://huggingface.co/google/siglip-base-patch16-224/blob/main/config.json (vision_config)
    "siglip-base-patch16-224": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_layers": 12,
        "num_heads": 12,
        "image_size": 224,
        "patch_size": 16,
    },
    "debug": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 3,
        "num_heads": 2,
        "image_size": 16,
        "patch_size": 4,
    },
}
"""SigLIP tower sizes by name (``SiglipVisionConfig.from_preset``)."""


@dataclass(kw_only=True)
class SiglipVisionConfig:
    """Architecture of the SigLIP vision tower (a SigLIP ``vision_config``) and the hidden states LLaVA takes from it.

    Args:
        hidden_size: width of the transformer.
        intermediate_size: width of the MLP's hidden layer.
        num_layers: encoder layers (``num_hidden_layers``).
        num_heads: attention heads (``num_attention_heads``); they divide ``hidden_size``.
        image_size: side of the square input images in pixels.
        patch_size: side of a square patch; ``(image_size // patch_size) ** 2`` tokens per image.
        in_channels: image channels (``num_channels``).
        hidden_act: the MLP's activation (a key of :data:`~forge_lightning.modules.layers.activations.ACTIVATIONS`).
        layer_norm_eps: epsilon of every LayerNorm.
        feature_layer: the hidden state(s) the language model gets (LLaVA's ``vision_feature_layer``): an index into
            ``[embeddings, layer 1, ..., layer num_layers]``, negative from the end, or a list of them (concatenated
            along the width).
        feature_select_strategy: ``full`` keeps every token, ``default`` drops each image's first one (LLaVA's
            ``vision_feature_select_strategy``; LLaVA-OneVision uses ``full`` with SigLIP).

    Subclasses for towers of the same layers (CLIP) set the class attributes: the ``config.json`` they read and
    write, the presets, and whether a class token leads the patches.
    """

    NAME: ClassVar[str] = "SigLIP"
    HF_MODEL_TYPE: ClassVar[str] = HF_MODEL_TYPE
    HF_DEFAULTS: ClassVar[Mapping[str, Any]] = _HF_DEFAULTS
    HF_EXTRA: ClassVar[Mapping[str, Any]] = {"vision_use_head": False}
    """Keys written into the ``vision_config`` beside the fields."""
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = PRESETS
    CLASS_TOKEN: ClassVar[bool] = False

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    feature_layer: int | list[int] = -1
    feature_select_strategy: str = "full"

    def __post_init__(self) -> None:
        for name in (*_POSITIVE_INTS, "in_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"vision.{name} ({value!r}) must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision.num_heads ({self.num_heads}) must divide vision.hidden_size ({self.hidden_size})"
            )
        if self.patch_size > self.image_size:
            raise ValueError(
                f"vision.patch_size ({self.patch_size}) must not exceed vision.image_size ({self.image_size})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"vision.hidden_act ({self.hidden_act!r}) is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        if self.layer_norm_eps <= 0:
            raise ValueError(f"vision.layer_norm_eps ({self.layer_norm_eps}) must be positive")
        if isinstance(self.feature_layer, Sequence):
            self.feature_layer = list(self.feature_layer)
        check_layers(self.feature_layers, self.num_layers, "vision.feature_layer")
        if self.feature_select_strategy not in FEATURE_SELECT_STRATEGIES:
            raise ValueError(
                f"vision.feature_select_strategy ({self.feature_select_strategy!r}) must be one of "
                f"{', '.join(FEATURE_SELECT_STRATEGIES)}"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        """Patch tokens per image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def feature_layers(self) -> list[int]:
        """:attr:`feature_layer` as a list."""
        return self.feature_layer if isinstance(self.feature_layer, list) else [self.feature_layer]

    @property
    def num_tokens(self) -> int:
        """Tokens per image in the encoder: the patches and the class token, if the tower has one."""
        return self.num_patches + self.CLASS_TOKEN

    @property
    def tokens_per_image(self) -> int:
        """Feature tokens per image after :attr:`feature_select_strategy` (image tokens in the text per image)."""
        return self.num_tokens - (self.feature_select_strategy == "default")

    @property
    def out_hidden_size(self) -> int:
        """Width of the features: ``hidden_size`` per selected layer."""
        return self.hidden_size * len(self.feature_layers)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> SiglipVisionConfig:
        """Build ``PRESETS[name]`` with ``overrides`` applied."""
        if name not in cls.PRESETS:
            raise KeyError(f"unknown {cls.NAME} preset {name!r}; presets: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], **overrides: Any) -> SiglipVisionConfig:
        """Read a SigLIP ``vision_config`` dict (or a whole ``SiglipModel`` ``config.json``, which holds one).

        Missing keys take transformers' defaults; ``vision_use_head`` is ignored (the head is not built).
        ``overrides`` set fields that are not in a SigLIP config (``feature_layer``, ``feature_select_strategy``)
        or replace read ones.

        Raises:
            ValueError: another ``model_type``, a non-square image or patch, a non-zero ``attention_dropout``, or a
                value that fails the checks of :class:`SiglipVisionConfig`.
        """
        hf = hf.get("vision_config", hf)
        if hf.get("model_type", cls.HF_MODEL_TYPE) != cls.HF_MODEL_TYPE:
            raise ValueError(
                f"vision_config model_type ({hf['model_type']!r}) must be {cls.HF_MODEL_TYPE!r} ({cls.NAME})"
            )
        if hf.get("attention_dropout", 0.0):
            raise ValueError(
                f"vision_config attention_dropout ({hf['attention_dropout']}) is not supported; only 0.0"
            )
        values = {_HF_RENAMES.get(k, k): _square(k, hf.get(k, v)) for k, v in cls.HF_DEFAULTS.items()}
        return cls(**{**values, **overrides})

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` dict transformers builds this tower from (SigLIP's without the pooling head)."""
        values = dataclasses.asdict(self)
        hf = {key: values[_HF_RENAMES.get(key, key)] for key in self.HF_DEFAULTS}
        return {**hf, "model_type": self.HF_MODEL_TYPE, "attention_dropout": 0.0, **self.HF_EXTRA}


def _square(key: str, value: Any) -> Any:
    """``image_size`` / ``patch_size`` as one int (transformers also accepts a ``[height, width]`` pair)."""
    if key in ("image_size", "patch_size") and isinstance(value, Sequence):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"vision_config {key} ({list(value)}) must be square: one int or two equal ones")
        return value[0]
    return value


def check_layers(layers: Sequence[int], num_layers: int, field: str) -> list[int]:
    """``layers`` as indices into ``[embeddings, layer 1, ..., layer num_layers]`` (negative ones resolved).

    Raises:
        ValueError: ``layers`` is empty or holds a non-integer or out-of-range index (``field`` names it).
    """
    bad = [
        i
        for i in layers
        if not isinstance(i, int) or isinstance(i, bool) or not -num_layers - 1 <= i <= num_layers
    ]
    if not layers or bad:
        raise ValueError(
            f"{field} ({list(layers)}) must be one or more hidden-state indices in [{-num_layers - 1}, {num_layers}] "
            f"(0 is the embeddings, {num_layers} or -1 the last of vision.num_layers={num_layers} layers)"
        )
    return [i % (num_layers + 1) for i in layers]


class SiglipEmbeddings(nn.Module):
    """Patch embedding (a strided, biased ``Conv2d``) plus one learned position embedding per patch.

    Args:
        config: the tower's configuration.
    """

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.in_channels, config.hidden_size, config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)

    def reset_parameters(self) -> None:
        # LeCun-normal patches and N(0, 1/width) positions, as transformers initialises SigLIP.
        fan_in = self.patch_embedding.weight[0].numel()
        nn.init.trunc_normal_(self.patch_embedding.weight, std=fan_in**-0.5)
        nn.init.zeros_(self.patch_embedding.bias)
        nn.init.normal_(self.position_embedding.weight, std=self.position_embedding.embedding_dim**-0.5)

    def forward(self, pixel_values_NCHW: Tensor) -> Tensor:
        """``[N, C, S, S]`` images to ``[N, T, hidden]`` patch embeddings in raster order."""
        weight = self.patch_embedding.weight
        x_NDhw = self.patch_embedding(pixel_values_NCHW.to(weight.dtype))
        return x_NDhw.flatten(2).transpose(1, 2) + self.position_embedding.weight  # [N, T, hidden]


class SiglipAttention(nn.Module):
    """Bidirectional multi-head self-attention over the tokens of each image, with biased projections.

    Args:
        hidden_size: width.
        num_heads: attention heads.
    """

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def forward(self, x_NTD: Tensor) -> Tensor:
        N, T, _ = x_NTD.shape
        q, k, v = (
            proj(x_NTD).view(N, T, self.num_heads, self.head_dim).transpose(1, 2)  # [N, heads, T, head_dim]
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        # Equal-size images form a dense batch without masks: plain SDPA, whatever the LLM's attention backend.
        out_NHTD = attention(q, k, v, causal=False)
        return self.out_proj(out_NHTD.transpose(1, 2).reshape(N, T, -1))


class SiglipMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with biases.

    Args:
        config: the tower's configuration.
    """

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act, "vision.hidden_act")
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def reset_parameters(self) -> None:
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.normal_(fc.bias, std=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """Pre-LayerNorm ViT layer: ``x + self_attn(layer_norm1(x))`` then ``x + mlp(layer_norm2(x))``.

    Args:
        config: the tower's configuration.
    """

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config.hidden_size, config.num_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x_NTD: Tensor) -> Tensor:
        x_NTD = x_NTD + self.self_attn(self.layer_norm1(x_NTD))
        return x_NTD + self.mlp(self.layer_norm2(x_NTD))


class SiglipVisionTransformer(nn.Module):
    """The SigLIP vision tower: fixed-size images in, the hidden states LLaVA feeds its projector out.

    Build on the meta device for large sizes, then ``to_empty(device=...)`` and :meth:`init_weights`.

    Args:
        config: the tower's configuration.
        init: initialise the weights as transformers initialises SigLIP (:meth:`init_weights`); ``False`` keeps
            torch's default initialisation, for an owner that applies a scheme of its own (Pi0.5's image path).
    """

    embeddings_type: ClassVar[type[nn.Module]] = SiglipEmbeddings
    """The patch embedding (a subclass with another embedding, CLIP's, sets its own)."""

    def __init__(self, config: SiglipVisionConfig, *, init: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = self.embeddings_type(config)
        # A ModuleDict for transformers' names: encoder.layers.N.
        self.encoder = nn.ModuleDict(
            {"layers": nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_layers))}
        )
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if init:
            self.init_weights()

    def embed(self, pixel_values: Tensor) -> Tensor:
        """``[N, C, S, S]`` images to the ``[N, T, hidden]`` input of the first layer (transformers'
        ``hidden_states[0]``)."""
        return self.embeddings(pixel_values)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter as transformers does (LayerNorms to one and zero), e.g. after
        ``to_empty``."""
        reset_owned_parameters(self.modules())

    def hidden_states(self, pixel_values: Tensor, layers: Sequence[int]) -> list[Tensor]:
        """transformers' ``hidden_states[i]`` for each ``i`` in ``layers``: ``[N, T, hidden]`` each, before
        ``post_layernorm``; only the layers up to the deepest requested one run.

        Args:
            pixel_values: ``[num_images, in_channels, image_size, image_size]``.
            layers: indices into ``[embeddings, layer 1, ..., layer num_layers]``, negative from the end.

        Raises:
            ValueError: ``pixel_values`` has another shape, or an index is out of range.
        """
        c = self.config
        indices = check_layers(layers, c.num_layers, "layers")
        expected = [c.in_channels, c.image_size, c.image_size]
        if pixel_values.ndim != 4 or list(pixel_values.shape[1:]) != expected:
            raise ValueError(
                f"pixel_values must be [num_images, {', '.join(map(str, expected))}] (vision.in_channels, "
                f"vision.image_size twice), got {list(pixel_values.shape)}"
            )
        x_NTD = self.embed(pixel_values)
        states = {0: x_NTD}
        for i, layer in enumerate(self.encoder.layers[: max(indices)], start=1):
            x_NTD = layer(x_NTD)
            states[i] = x_NTD
        return [states[i] for i in indices]

    def last_hidden_state(self, pixel_values: Tensor) -> Tensor:
        """``post_layernorm`` of the last layer's output ``[N, T, hidden]`` (``SiglipVisionModel``'s
        ``last_hidden_state``)."""
        return self.post_layernorm(self.hidden_states(pixel_values, [-1])[0])

    def forward(self, pixel_values: Tensor) -> Tensor:
        """The features of :attr:`SiglipVisionConfig.feature_layer` after :attr:`~SiglipVisionConfig.feature_select_strategy`:
        ``[num_images, tokens_per_image, out_hidden_size]``."""
        c = self.config
        states = self.hidden_states(pixel_values, c.feature_layers)
        if c.feature_select_strategy == "default":
            states = [x_NTD[:, 1:] for x_NTD in states]
        return torch.cat(states, dim=-1)


def from_hf_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The tower's entries of a transformers ``SiglipVisionModel`` or ``SiglipModel`` state dict, named as in
    :class:`SiglipVisionTransformer`: below :data:`HF_PREFIX` when any key has it (the text tower and logit scale
    of a ``SiglipModel`` are left out), the pooling head skipped."""
    if any(k.startswith(HF_PREFIX) for k in state):
        state = {k[len(HF_PREFIX) :]: v for k, v in state.items() if k.startswith(HF_PREFIX)}
    return {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIX)}


def load_hf_siglip_weights(
    encoder: SiglipVisionTransformer, state: Mapping[str, Tensor], *, source: str = "state dict"
) -> SiglipVisionTransformer:
    """Copy the tower's weights of a transformers SigLIP (or, for a CLIP ``encoder``, CLIP) state dict (see
    :func:`from_hf_state_dict`) into ``encoder``; return it.

    Raises:
        ValueError: they do not match the tower's parameters (missing, unexpected or differently shaped entries;
            the message names them and ``source``).
    """
    what = f"the {encoder.config.NAME} weights of {source}"
    load_exact(encoder, from_hf_state_dict(state), what=what, owner="tower")
    return encoder

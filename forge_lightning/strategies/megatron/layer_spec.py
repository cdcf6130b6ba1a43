"""Layer spec of the dense decoder for megatron-core: its own parallel linears, our norm and SDPA attention.

megatron-core's local spec (no TransformerEngine) cannot do what the dense path needs: its torch norms refuse
sequence parallelism and its ``DotProductAttention`` materialises the ``[b, heads, s, s]`` scores. This spec
keeps megatron's column / row parallel linears, ``SelfAttention``, ``MLP`` and ``TransformerLayer`` and swaps in

* :class:`MegatronRMSNorm`: forge's RMSNorm (fp32 statistics, as Hugging Face) whose weight is tagged
  ``sequence_parallel`` so megatron all-reduces its gradient over the TP group when the sequence is sharded;
* :class:`SDPACoreAttention`: causal ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient
  kernels on CUDA, a math kernel on CPU).

With TransformerEngine importable, :func:`gpt_decoder_spec` uses megatron's TE layer spec instead.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch import Tensor

from forge_lightning.modules.layers.norms import RMSNorm


def transformer_engine_available() -> bool:
    """Whether TransformerEngine's PyTorch extension is importable."""
    return importlib.util.find_spec("transformer_engine") is not None


class MegatronRMSNorm(RMSNorm):
    """forge's RMSNorm with megatron's constructor; the weight is tagged for sequence-parallel gradient sync.

    Args:
        config: the transformer config (reads ``sequence_parallel``).
        hidden_size: normalised width.
        eps: epsilon added to the mean square.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps)
        # With sequence parallelism each TP rank sees a slice of the tokens, so this weight's gradient is partial:
        # megatron's finalize_model_grads all-reduces parameters carrying this attribute over the TP group.
        self.weight.sequence_parallel = config.sequence_parallel


class SDPACoreAttention(MegatronModule):
    """Causal core attention on ``scaled_dot_product_attention``, in megatron's ``[s, b, heads, dim]`` layout.

    Args:
        config: the transformer config.
        layer_number: 1-based layer index (unused; megatron passes it).
        attn_mask_type: must be causal.
        attention_type: ``self`` (megatron passes it).
        attention_dropout: dropout probability (default: ``config.attention_dropout``).
        softmax_scale: score scale (default: ``1 / sqrt(kv_channels)``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        if config.context_parallel_size > 1:
            raise NotImplementedError("context parallelism is not yet supported by SDPACoreAttention")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """Attention output ``[s, b, heads * dim]`` of ``query`` ``[s, b, heads, dim]`` and ``key`` / ``value``
        ``[s, b, groups, dim]`` (causal; ``attention_mask`` is ignored)."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention bias are not yet supported")
        s, b, heads, dim = query.shape
        q_BHSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        repeat = heads // k_BGSD.shape[1]
        if repeat > 1:  # GQA: each key/value group serves `repeat` consecutive query heads
            k_BGSD = k_BGSD.repeat_interleave(repeat, dim=1)
            v_BGSD = v_BGSD.repeat_interleave(repeat, dim=1)
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD,
            k_BGSD,
            v_BGSD,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )
        return out_BHSD.permute(2, 0, 1, 3).reshape(s, b, heads * dim)  # [s, b, heads * dim]


def local_layer_spec(qk_norm: bool) -> ModuleSpec:
    """The decoder layer from megatron's parallel linears with :class:`MegatronRMSNorm` and SDPA attention.

    Args:
        qk_norm: per-head RMSNorm on queries and keys (Qwen3).
    """
    qk = MegatronRMSNorm if qk_norm else IdentityOp
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=SDPACoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=qk,
            k_layernorm=qk,
        ),
    )
    mlp = ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=MegatronRMSNorm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=MegatronRMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def gpt_decoder_spec(
    config: TransformerConfig, *, vp_stage: int | None = None, use_transformer_engine: bool | None = None
) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage: one layer spec per layer it builds, and the final norm.

    TransformerEngine's spec when TE is importable (or forced), else :func:`local_layer_spec` with
    :class:`MegatronRMSNorm` as the final norm (megatron's default torch norm refuses sequence parallelism).

    Args:
        config: the transformer config (layer count, pipeline layout, ``qk_layernorm``).
        vp_stage: virtual pipeline stage of the model chunk being built.
        use_transformer_engine: force the choice (``None``: TE when importable).
    """
    use_te = transformer_engine_available() if use_transformer_engine is None else use_transformer_engine
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        layer = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=TENorm)
    layer = local_layer_spec(config.qk_layernorm)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=MegatronRMSNorm)

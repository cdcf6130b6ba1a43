"""The two Gemma stacks of Pi0.5: the backbone (PaliGemma's language model) and the action expert.

Pi0.5 is a mixture of transformers: layer ``i`` of the expert attends to its own tokens *and* to the keys and
values of layer ``i`` of the backbone, while backbone tokens never attend to expert tokens. So the joint
attention splits exactly into

    backbone:  prefix ─ [GemmaLayer] x L ──────────────> (k_i, v_i) of every layer   (bidirectional prefix)
    expert:    actions ─ [GemmaLayer(adaRMS)] x L, layer i attending to [k_i ; k_own], [v_i ; v_own]

which is also the prefix KV cache of inference. Each block is called through its own ``forward``, so FSDP,
activation checkpointing and ``torch.compile`` wrap the backbone's and the expert's layers independently.

Gemma specifics: RMSNorm scales by ``1 + weight`` (weights start at zero), the MLP is gated GELU (tanh), token
embeddings are multiplied by ``sqrt(width)``. The expert's norms are adaptive (adaRMS): a linear map of the
flow-time condition gives a scale, a shift and a gate for the residual branch (adaLN-Zero style, Peebles & Xie,
2023), zero-initialised so every expert block starts as the identity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.modules.embodied.config import GemmaConfig
from forge_lightning.modules.layers import Attention, GatedMLP, RMSNorm, apply_rotary, attention

KeyValue = tuple[Tensor, Tensor]
"""Keys and values of one layer, ``[B, num_kv_heads, S, head_dim]`` each (keys after RoPE)."""


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with Gemma's ``1 + weight`` scale, applied in fp32 before the cast back (zero-initialised)."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class AdaptiveRMSNorm(nn.Module):
    """adaRMS: RMSNorm whose scale and shift, and a residual gate, are a linear function of a condition.

    ``dense(cond)`` is split into ``(scale, shift, gate)``; the output is ``norm(x) * (1 + scale) + shift``
    and the caller adds its residual branch multiplied by ``gate``.

    Args:
        dim: normalised width.
        cond_dim: width of the condition.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.dense.weight)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x_BSD: Tensor, cond_BC: Tensor) -> tuple[Tensor, Tensor]:
        """``(normed [B, S, D], gate [B, 1, D])`` of ``x`` under the condition ``cond`` ``[B, cond_dim]``."""
        x_fp32 = x_BSD.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale, shift, gate = self.dense(cond_BC)[:, None].chunk(3, dim=-1)  # [B, 1, D] each
        normed = normed * (1.0 + scale.float()) + shift.float()
        return normed.to(x_BSD.dtype), gate.to(x_BSD.dtype)


class GeluGatedMLP(GatedMLP):
    """Gemma's feed-forward block: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class PrefixAttention(Attention):
    """Bidirectional GQA attention that may also attend to another stack's keys and values (a prefix).

    Same projections as :class:`~forge_lightning.modules.layers.Attention` (no biases, RoPE); the forward is not
    causal, takes an explicit key mask, and returns this layer's own keys and values for the other stack.
    """

    def keys_values(self, x_BSD: Tensor, rope: tuple[Tensor, Tensor]) -> KeyValue:
        """This layer's keys (after RoPE) and values of ``x``, ``[B, num_kv_heads, S, head_dim]`` each."""
        B, S, _ = x_BSD.shape
        k_BSKD = apply_rotary(self.k_proj(x_BSD).view(B, S, -1, self.head_dim), *rope)
        v_BSKD = self.v_proj(x_BSD).view(B, S, -1, self.head_dim)
        return k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2)

    def forward(  # type: ignore[override]
        self,
        x_BSD: Tensor,
        rope: tuple[Tensor, Tensor],
        *,
        mask: Tensor,
        prefix: KeyValue | None = None,
    ) -> tuple[Tensor, KeyValue]:
        """Attend ``x`` ``[B, S, hidden]`` to ``prefix`` and to itself; return the output and its own (k, v).

        Args:
            x_BSD: normalised hidden states.
            rope: ``(cos, sin)`` of the positions of ``x``.
            mask: boolean ``[B, 1, 1 or S, S_prefix + S]``, True where a key may be attended to.
            prefix: keys and values of the prefix, placed before this layer's own.
        """
        B, S, _ = x_BSD.shape
        q_BSHD = apply_rotary(self.q_proj(x_BSD).view(B, S, -1, self.head_dim), *rope)
        k, v = self.keys_values(x_BSD, rope)
        keys, values = (
            (k, v) if prefix is None else (torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2))
        )
        out_BHSD = attention(q_BSHD.transpose(1, 2), keys, values, causal=False, mask=mask)
        return self.o_proj(out_BHSD.transpose(1, 2).reshape(B, S, -1)), (k, v)


def _normalise(norm: nn.Module, x: Tensor, cond: Tensor | None) -> tuple[Tensor, Tensor | None]:
    if isinstance(norm, AdaptiveRMSNorm):
        if cond is None:
            raise ValueError("the action expert's adaptive norms need the flow-time condition (cond)")
        return norm(x, cond)
    return norm(x), None


def _residual(x: Tensor, branch: Tensor, gate: Tensor | None) -> Tensor:
    return x + branch if gate is None else x + branch * gate


class GemmaLayer(nn.Module):
    """Gemma decoder block for the mixture of transformers: attention then gated GELU MLP, pre-norm residuals.

    Args:
        config: the stack's configuration.
        cond_dim: width of the adaRMS condition (the action expert); ``None`` for plain Gemma norms.
        init_std: standard deviation of the normal initialisation of the projections.
    """

    def __init__(self, config: GemmaConfig, *, cond_dim: int | None = None, init_std: float = 0.02) -> None:
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = PrefixAttention(
            width, config.num_heads, config.num_kv_heads, config.head_dim, init_std=init_std
        )
        self.mlp = GeluGatedMLP(width, config.intermediate_size, init_std=init_std)
        if cond_dim is None:
            self.input_layernorm: nn.Module = GemmaRMSNorm(width, eps)
            self.post_attention_layernorm: nn.Module = GemmaRMSNorm(width, eps)
        else:
            self.input_layernorm = AdaptiveRMSNorm(width, cond_dim, eps)
            self.post_attention_layernorm = AdaptiveRMSNorm(width, cond_dim, eps)

    def forward(
        self,
        x_BSD: Tensor,
        rope: tuple[Tensor, Tensor],
        *,
        mask: Tensor | None = None,
        prefix: KeyValue | None = None,
        cond: Tensor | None = None,
        kv_only: bool = False,
    ) -> tuple[Tensor, KeyValue]:
        """The block's output ``[B, S, hidden]`` and its keys / values.

        Args:
            x_BSD: hidden states.
            rope: ``(cos, sin)`` of their positions.
            mask: key mask, see :meth:`PrefixAttention.forward` (not needed with ``kv_only``).
            prefix: the other stack's keys and values at this layer.
            cond: adaRMS condition ``[B, cond_dim]`` (action expert only).
            kv_only: compute only the keys and values and return ``x`` unchanged (the backbone's last layer,
                whose output nothing reads).
        """
        h, gate = _normalise(self.input_layernorm, x_BSD, cond)
        if kv_only:
            return x_BSD, self.self_attn.keys_values(h, rope)
        attn, kv = self.self_attn(h, rope, mask=mask, prefix=prefix)
        x_BSD = _residual(x_BSD, attn, gate)
        h, gate = _normalise(self.post_attention_layernorm, x_BSD, cond)
        return _residual(x_BSD, self.mlp(h), gate), kv


class GemmaBackbone(nn.Module):
    """PaliGemma's language model: token embedding, decoder layers and final norm.

    In Pi0.5 it only supplies keys and values to the expert: its last layer's output half and its final norm
    never influence the actions (see :meth:`unused_parameters`); they are kept for the checkpoint layout.

    Args:
        config: the backbone's configuration.
        vocab_size: token embeddings.
        init_std: standard deviation of the normal initialisation of linear and embedding weights.
    """

    def __init__(self, config: GemmaConfig, vocab_size: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.config = config
        self.init_std = init_std
        self.embed_tokens = nn.Embedding(vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaLayer(config, init_std=init_std) for _ in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embed_tokens.weight, std=self.init_std)

    def embed(self, tokens_BL: Tensor) -> Tensor:
        """Token embeddings times ``sqrt(width)`` (the factor rounded to the weight dtype, as in Gemma)."""
        weight = self.embed_tokens.weight
        scale = torch.tensor(math.sqrt(self.config.hidden_size), dtype=weight.dtype, device=weight.device)
        return self.embed_tokens(tokens_BL) * scale

    def forward(self, x_BPD: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor) -> list[KeyValue]:
        """Keys and values of every layer for the prefix embeddings ``x`` ``[B, P, hidden]``."""
        kvs = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x_BPD, kv = layer(x_BPD, rope, mask=mask, kv_only=i == last)
            kvs.append(kv)
        return kvs

    def unused_parameters(self) -> list[nn.Parameter]:
        """Parameters that never reach the actions: the last layer's query / output / MLP half, the final norm."""
        last = self.layers[-1]
        unused = [
            last.self_attn.q_proj,
            last.self_attn.o_proj,
            last.post_attention_layernorm,
            last.mlp,
            self.norm,
        ]
        return [p for module in unused for p in module.parameters()]


class ActionExpert(nn.Module):
    """The action expert: noisy action chunk + flow time in, velocity out, attending to the backbone's keys.

    ::

        x_t ─ action_in_proj ─ [GemmaLayer(adaRMS, prefix k/v)] x L ─ norm(adaRMS) ─ action_out_proj ─ v_t
        t ─ sin/cos ─ time_mlp_in ─ silu ─ time_mlp_out ─ silu ─ cond ─┘ (every norm)

    Args:
        config: the expert's configuration.
        action_dim: width of the (padded) actions.
        min_period: shortest period of the sinusoidal time embedding.
        max_period: longest period of the sinusoidal time embedding.
        init_std: standard deviation of the normal initialisation of the projections.
    """

    def __init__(
        self,
        config: GemmaConfig,
        action_dim: int,
        *,
        min_period: float = 4e-3,
        max_period: float = 4.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        width = config.hidden_size
        self.min_period, self.max_period, self.init_std = min_period, max_period, init_std
        self.layers = nn.ModuleList(
            GemmaLayer(config, cond_dim=width, init_std=init_std) for _ in range(config.num_layers)
        )
        self.norm = AdaptiveRMSNorm(width, width, config.rms_norm_eps)
        self.action_in_proj = nn.Linear(action_dim, width)
        self.action_out_proj = nn.Linear(width, action_dim)
        self.time_mlp_in = nn.Linear(width, width)
        self.time_mlp_out = nn.Linear(width, width)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (self.action_in_proj, self.action_out_proj, self.time_mlp_in, self.time_mlp_out):
            nn.init.normal_(proj.weight, std=self.init_std)
            nn.init.zeros_(proj.bias)

    def time_condition(self, time_B: Tensor) -> Tensor:
        """The adaRMS condition ``[B, width]`` of flow times ``[B]``: an MLP of their sin/cos embedding."""
        width = self.time_mlp_in.in_features
        # Periods from min_period to max_period, geometrically spaced; computed in fp64 (fp32 on MPS, which has
        # no fp64) and cast to the time's dtype, as openpi does.
        wide = torch.float32 if time_B.device.type == "mps" else torch.float64
        fraction = torch.linspace(0.0, 1.0, width // 2, dtype=wide, device=time_B.device)
        period = self.min_period * (self.max_period / self.min_period) ** fraction
        angle_BF = time_B.to(wide)[:, None] * (2 * math.pi / period)[None, :]
        embedding = torch.cat([angle_BF.sin(), angle_BF.cos()], dim=-1).to(time_B.dtype)
        dtype = self.time_mlp_in.weight.dtype
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(embedding.to(dtype)))))

    def forward(
        self,
        x_t_BCA: Tensor,
        time_B: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor,
        prefix: list[KeyValue],
    ) -> Tensor:
        """Velocity ``[B, C, action_dim]`` (fp32) of the noisy chunk ``x_t`` at flow time ``time``.

        Args:
            x_t_BCA: noisy actions.
            time_B: flow times (1 = pure noise, 0 = data).
            rope: ``(cos, sin)`` of the action tokens' positions (after the valid prefix tokens).
            mask: ``[B, 1, 1, P + C]`` keys the action tokens may attend to (valid prefix tokens and all actions).
            prefix: the backbone's keys and values, one pair per layer.
        """
        cond = self.time_condition(time_B)
        x_BCD = self.action_in_proj(x_t_BCA.to(self.action_in_proj.weight.dtype))
        for layer, kv in zip(self.layers, prefix, strict=True):
            x_BCD, _ = layer(x_BCD, rope, mask=mask, prefix=kv, cond=cond)
        x_BCD, _ = self.norm(x_BCD, cond)
        return self.action_out_proj(x_BCD.to(self.action_out_proj.weight.dtype)).float()

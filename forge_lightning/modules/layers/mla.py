"""Multi-head latent attention (MLA) of DeepSeek-V2 / V3 (arXiv:2405.04434, arXiv:2412.19437).

Keys and values are rebuilt per head from one compressed latent ``c`` per token, so a KV cache stores only ``c``
and a rotary key shared by all heads (B batch, S tokens, H heads, C latent, R rotary size, N / V per-head
no-rope query/key and value sizes)::

    x ─ q_a_proj ─ q_a_layernorm ─ q_b_proj ─ [B,S,H,N+R] ─ split ─ q_nope ─────────┐
        (or q_proj when q_lora_rank is None)               └─ q_rot ─ RoPE ─────────┤ q = [q_nope | q_rot]
    x ─ kv_a_proj_with_mqa ─ split ─ c [B,S,C] ─ kv_a_layernorm ─ (cache) ─ kv_b_proj ─ [B,L,H,N+V]
                               └─ k_rot [B,S,1,R] ─ RoPE ─ (cache) ─ shared by every head ┐  ├─ k_nope, v
                                                         k = [k_nope | k_rot], v ─ attention() ─ o_proj

The forward (cache, masks, kernel, ``o_proj``) is :class:`~forge_lightning.modules.layers.attention.SelfAttention`'s
and the rotary helpers are :mod:`~forge_lightning.modules.layers.rope`'s; the softmax scale is ``1 / sqrt(N + R)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers.attention import KVCache, SelfAttention
from forge_lightning.modules.layers.mlp import init_linear
from forge_lightning.modules.layers.norms import RMSNorm
from forge_lightning.modules.layers.rope import apply_rotary

# DeepSeek's latent norms use RMSNorm's default epsilon, not the model's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentKVCache(KVCache):
    """MLA's cache: the normalised key/value latent (``k``, ``[B, 1, L, C]``) and the rotated shared key
    (``v``, ``[B, 1, L, R]``) of every position, instead of per-head keys and values.

    Args:
        batch_size: sequences decoded together.
        max_len: most positions the cache can hold.
        kv_lora_rank: latent width ``C``.
        rope_dim: rotary key size ``R``.
        dtype: storage dtype.
        device: storage device.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        # Not KVCache.__init__: its keys and values share one size; appending and slicing are inherited.
        self.k = torch.zeros(batch_size, 1, max_len, kv_lora_rank, dtype=dtype, device=device)
        self.v = torch.zeros(batch_size, 1, max_len, rope_dim, dtype=dtype, device=device)
        self.length = 0


class MultiLatentAttention(SelfAttention):
    """Multi-head latent attention with decoupled RoPE; submodule names follow Hugging Face's DeepSeek-V3.

    Args:
        hidden_size: model width.
        num_heads: attention heads.
        kv_lora_rank: width of the key/value latent.
        qk_nope_head_dim: per-head query/key size without rotary embedding.
        qk_rope_head_dim: per-head query/key size with rotary embedding.
        v_head_dim: per-head value size.
        q_lora_rank: width of the query latent; ``None`` projects queries directly (``q_proj``).
        rope_interleave: rotary dimensions are stored as interleaved pairs (DeepSeek's layout); they are
            de-interleaved into halves before :func:`~forge_lightning.modules.layers.rope.apply_rotary`.
        bias: bias on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (``attention_bias``).
        init_std: standard deviation of the normal initialisation of the projection weights.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rope_interleave: bool = True,
        bias: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
        self.nope_dim, self.rope_dim = qk_nope_head_dim, qk_rope_head_dim
        self.rope_interleave, self.init_std = rope_interleave, init_std
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.children():
            if isinstance(module, nn.Linear):
                init_linear(module, self.init_std)

    def matrix_parts(self) -> dict[str, tuple[int, ...]]:
        """``kv_a_proj_with_mqa`` fuses the key/value latent rows and the shared rotary key rows."""
        return {"kv_a_proj_with_mqa.weight": (self.kv_lora_rank, self.rope_dim)}

    def _queries(self, x_BSD: Tensor) -> Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x_BSD)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))

    def _rotate(self, x_BSHR: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        if self.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ... | x1, x3, ...)
            x_BSHR = torch.cat((x_BSHR[..., 0::2], x_BSHR[..., 1::2]), dim=-1)
        return apply_rotary(x_BSHR, *rope)

    def queries_keys_values(
        self, x_BSD: Tensor, rope: tuple[Tensor, Tensor], kv_cache: KVCache | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, and per-head keys / values rebuilt from the latents of every attended position.

        ``rope`` has size ``qk_rope_head_dim / 2``; ``kv_cache`` is a :class:`LatentKVCache`, which receives the
        new latents and rotated shared keys.
        """
        B, S, _ = x_BSD.shape
        # Head counts come from the projections' outputs, so a tensor-parallel shard sees its local heads.
        q_BSHQ = self._queries(x_BSD).view(B, S, -1, self.nope_dim + self.rope_dim)
        q_nope_BSHN, q_rot_BSHR = q_BSHQ.split([self.nope_dim, self.rope_dim], dim=-1)
        latent_BSC, k_rot_BSR = self.kv_a_proj_with_mqa(x_BSD).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        latent_B1SC = self.kv_a_layernorm(latent_BSC)[:, None]
        k_rot_B1SR = self._rotate(k_rot_BSR[:, :, None], rope).transpose(1, 2)
        if kv_cache is not None:
            latent_B1SC, k_rot_B1SR = kv_cache.update(latent_B1SC, k_rot_B1SR)
        L = latent_B1SC.shape[2]  # every position attended to: the cached ones and the new ones
        kv_BLHF = self.kv_b_proj(latent_B1SC[:, 0]).view(B, L, -1, self.nope_dim + self.v_head_dim)
        k_nope_BLHN, v_BLHV = kv_BLHF.split([self.nope_dim, self.v_head_dim], dim=-1)
        heads = k_nope_BLHN.shape[2]
        q_BHSQ = torch.cat((q_nope_BSHN, self._rotate(q_rot_BSHR, rope)), dim=-1).transpose(1, 2)
        k_rot_BHLR = k_rot_B1SR.expand(B, heads, L, self.rope_dim)
        k_BHLQ = torch.cat((k_nope_BLHN.transpose(1, 2), k_rot_BHLR), dim=-1)
        return q_BHSQ, k_BHLQ, v_BLHV.transpose(1, 2)

    def tp_plan(self) -> dict[str, str]:
        """Tensor-parallel styles of submodules (relative names): none, MLA stays replicated.

        Sharding heads (``q_b_proj`` / ``kv_b_proj`` column-wise, ``o_proj`` row-wise) is not enough: the rotary
        key is shared by every head outside ``kv_b_proj``, so each rank's gradient of ``kv_a_proj_with_mqa``
        would cover only its own heads, and the available styles have no replicated-with-gradient-all-reduce
        one. Replicated, every tensor-parallel rank computes the same full attention.
        """
        return {}

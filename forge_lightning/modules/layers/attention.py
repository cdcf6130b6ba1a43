"""Attention: the scaled-dot-product kernel call, the GQA self-attention block and its KV cache.

Data flow of :class:`Attention` (B batch, S new tokens, H query heads, K key/value heads, D head size)::

    x [B,S,hidden] ─┬─ q_proj ─ view [B,S,H,D] ─ q_norm ─ RoPE ─┐
                    ├─ k_proj ─ view [B,S,K,D] ─ k_norm ─ RoPE ─┼─ (KV cache) ─ attention() ─ o_proj
                    └─ v_proj ─ view [B,S,K,D] ─────────────────┘

:func:`attention` is the one place a kernel is chosen. Packed sequences (several documents per row, see
``forge_lightning.datamodules.packing``) attend within each document through a :class:`DocumentMask`, built once
per forward by the backend chosen in config. The mask is causal within each document by default; encoders
(e.g. vision towers that pack several images or attention windows into one row) build it with ``causal=False``:

=========  ======================================================================  ==========================
backend    packed attention                                                         where
=========  ======================================================================  ==========================
``sdpa``   SDPA with an explicit block-diagonal (causal) boolean mask ``[B,1,S,S]`` everywhere (CPU training)
``flex``   FlexAttention with a document ``BlockMask`` (compiled on CUDA), which    CUDA (fwd + bwd); CPU
           skips the blocks outside the documents                                   forward only (eager)
``varlen`` ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention varlen) on     CUDA, fp16 / bf16
           the flattened batch with ``cu_seqlens``
``fa4``    FlashAttention-4 varlen (``forge_lightning.kernels.flash4``) on the      Hopper / Blackwell,
           flattened batch with ``cu_seqlens``                                      fp16 / bf16, D 64 or 128
``auto``   on CUDA ``fa4`` when the process's attention kernel is FA4 (see below), else ``flex`` for rows of
           a fixed shape (an LLM's packed rows), ``varlen`` for masks built with ``varying_shapes``
           (encoders, whose token count changes with every image grid: compiled FlexAttention would
           recompile for each, then run eagerly); inputs FA4 does not take (head dims other than 64 and 128)
           fall back to ``varlen``, fp32 inputs to SDPA with the dense mask; ``sdpa`` elsewhere
=========  ======================================================================  ==========================

Rows without document boundaries use the process's attention kernel (:func:`set_attention_kernel`, from
``performance.attention.kernel``): SDPA, or FlashAttention-4 for calls without a mask or KV cache in bf16 / fp16
(the others use SDPA). The dense mask is O(S^2) memory: use it for CPU and tests, a kernel backend for long
sequences on GPU.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.accelerators.capabilities import capabilities, refuses_unsupported
from forge_lightning.kernels import flash4
from forge_lightning.kernels.fp8_attention import FP8AttentionScales, fp8_attention
from forge_lightning.modules.layers.mlp import init_linear
from forge_lightning.modules.layers.norms import RMSNorm
from forge_lightning.modules.layers.rope import apply_rotary

ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "varlen", "fa4")
"""Attention backends for packed sequences (see the module docstring)."""
ATTENTION_KERNELS = ("sdpa", "fa4")
"""Kernels for attention without packed documents (see :func:`set_attention_kernel`)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Kernel:
    name: str = "sdpa"
    chosen: bool = False  # picked by `auto`: inputs FA4 does not take fall back to SDPA instead of failing


_kernel = _Kernel()
_fallbacks_logged: set[str] = set()


def set_attention_kernel(name: str, *, chosen: bool = False) -> None:
    """Use ``name`` (``sdpa`` or ``fa4``) for this process's attention, and for packed rows whose backend is ``auto``.

    Process-wide, like the SDPA backends (``torch.backends.cuda.enable_*_sdp``), so every family's layers and
    their compiled graphs see it; ``performance.attention.kernel`` sets it when a strategy applies the
    performance settings.

    Args:
        name: ``sdpa`` or ``fa4`` (FlashAttention-4: the device must have been checked, see
            :func:`forge_lightning.kernels.flash4.device_unsupported`).
        chosen: picked by ``auto``: calls FA4 does not take (fp32, head dims other than 64 and 128) fall back to SDPA, logged
            once per reason; otherwise they raise.
    """
    global _kernel
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel ({name!r}) must be one of {', '.join(ATTENTION_KERNELS)}")
    _kernel = _Kernel(name, chosen)


def attention_kernel() -> str:
    """This process's attention kernel (``sdpa`` or ``fa4``), see :func:`set_attention_kernel`."""
    return _kernel.name


def _autocast(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k, v`` in the autocast dtype when autocast is on for their device, as SDPA casts its inputs (under
    ``bf16-mixed`` RoPE and q/k norms leave queries and keys in fp32)."""
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _fa4_refused(q: Tensor, k: Tensor, v: Tensor, chosen: bool, what: str) -> bool:
    """Whether FA4 cannot take these ``[..., heads, D]`` inputs: raise (explicit choice) or log once (``auto``)."""
    # Devices with FlashAttention were checked when the kernel was set; others (a CPU evaluation) are checked here.
    reason = None if capabilities(q.device).flash_attention else flash4.device_unsupported(q.device)
    reason = reason or flash4.inputs_unsupported(q, k, v)
    if reason is None:
        return False
    if not chosen:
        raise ValueError(f"{what} 'fa4': {reason}; choose 'auto' (falls back for such inputs) or 'sdpa'")
    # Not logged while dynamo traces (a log call would break the graph); eager calls and the first step log it.
    if reason not in _fallbacks_logged and not torch.compiler.is_compiling():
        _fallbacks_logged.add(reason)
        _log.info("attention: %s; these calls use the fallback kernel", reason)
    return True


try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:
    _varlen_attn, _VARLEN_PARAMS = None, frozenset()


def check_attention_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`ATTENTION_BACKENDS` (a module checks the name when built; the device is
    checked at forward, by :func:`resolve_attention_backend`).

    Raises:
        ValueError: an unknown name.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend ({backend!r}) must be one of {', '.join(ATTENTION_BACKENDS)}")
    return backend


def resolve_attention_backend(backend: str, device: torch.device, *, varying_shapes: bool = False) -> str:
    """The concrete backend for ``backend`` on ``device``.

    ``auto`` follows the device's platform (:mod:`forge_lightning.accelerators.capabilities`): ``fa4`` when the
    process's attention kernel is FA4 (:func:`set_attention_kernel`); else ``varlen`` when the rows' shapes change
    from call to call (``varying_shapes``), the platform has FlashAttention and this torch has it; else ``flex``
    (compiled for static shapes) where Triton runs; else ``sdpa`` with a block-diagonal mask (the CPU, Kunlun).
    """
    check_attention_backend(backend)
    caps = capabilities(device)
    if backend == "auto":
        if _kernel.name == "fa4" and caps.flash_attention:
            return "fa4"
        if varying_shapes and caps.flash_attention and _varlen_attn is not None:
            return "varlen"
        return "flex" if caps.triton else "sdpa"
    if backend == "flex" and not caps.triton and refuses_unsupported(device):
        raise ValueError(
            f"attention_backend 'flex' compiles FlexAttention to Triton, which {caps.platform} devices do not "
            "have; choose 'auto' or 'sdpa'"
        )
    if backend == "varlen" and not caps.flash_attention:
        raise ValueError(
            f"attention_backend 'varlen' needs CUDA (FlashAttention), got device {device.type!r} "
            f"(platform {caps.platform}); choose 'auto' or 'sdpa'"
        )
    if backend == "fa4":
        reason = flash4.device_unsupported(device)
        if reason is not None:
            raise ValueError(f"attention_backend 'fa4': {reason}; choose 'auto' or 'sdpa'")
    return backend


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at each document start, from ``document_ids`` ``[..., S]`` (non-decreasing)."""
    seq = document_ids.shape[-1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def document_lengths(document_ids: Tensor) -> Tensor:
    """Token counts of the documents of packed rows ``[B, S]``, row by row (a row boundary ends a document)."""
    B, S = document_ids.shape
    rows_B1 = torch.arange(B, device=document_ids.device)[:, None] * (S + 1)
    return torch.unique_consecutive((document_ids + rows_B1).flatten(), return_counts=True)[1]


@dataclass
class DocumentMask:
    """Attention restricted to each document of packed rows (causal within it, or not), in the form one backend
    consumes.

    Build with :meth:`build` once per forward and pass it to every layer.

    Args:
        document_ids: ``[B, S]`` non-decreasing document index of every token of each row.
        backend: ``sdpa``, ``flex``, ``varlen`` or ``fa4``.
        dense: ``[B, 1, S, S]`` boolean mask (``sdpa``).
        block_mask: FlexAttention ``BlockMask`` (``flex``).
        cu_seqlens: ``[num_documents + 1]`` int32 document offsets in the flattened batch (``varlen``, ``fa4``).
        max_seqlen: longest document (``varlen``, ``fa4``).
        causal: each token attends to the earlier tokens of its document only; ``False``: to all of them.
        chosen: the backend was picked by ``auto``: inputs it does not take (``fa4``: fp32, head dims other than 64 and 128;
            ``varlen``: fp32) then fall back to SDPA with a dense mask; an explicit choice refuses them.
    """

    document_ids: Tensor
    backend: str
    dense: Tensor | None = None
    block_mask: Any = None
    cu_seqlens: Tensor | None = None
    max_seqlen: int = 0
    causal: bool = True
    chosen: bool = False

    @classmethod
    def build(
        cls, document_ids: Tensor, backend: str = "auto", *, causal: bool = True, varying_shapes: bool = False
    ) -> DocumentMask:
        """Prepare the mask of ``document_ids`` ``[B, S]`` for ``backend`` (see :data:`ATTENTION_BACKENDS`),
        causal within each document unless ``causal`` is false. ``varying_shapes``: the caller's rows change
        shape from call to call (an encoder's patches), which ``auto`` then serves with ``varlen``."""
        chosen = backend == "auto"
        backend = resolve_attention_backend(backend, document_ids.device, varying_shapes=varying_shapes)
        B, S = document_ids.shape
        if backend == "sdpa":
            return cls(document_ids, backend, dense=_dense_mask(document_ids, causal), causal=causal)
        if backend == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            def same_document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return document_ids[b, q_idx] == document_ids[b, kv_idx]

            def same_document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return same_document(b, h, q_idx, kv_idx) & (q_idx >= kv_idx)

            mask_mod = same_document_causal if causal else same_document
            block_mask = create_block_mask(mask_mod, B, None, S, S, device=document_ids.device)
            return cls(document_ids, backend, block_mask=block_mask, causal=causal)
        counts = document_lengths(document_ids)  # documents of the flattened batch
        cu_seqlens = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
        longest = int(counts.max())
        return cls(
            document_ids, backend, cu_seqlens=cu_seqlens, max_seqlen=longest, causal=causal, chosen=chosen
        )


def _dense_mask(document_ids: Tensor, causal: bool) -> Tensor:
    """``[B, 1, S, S]`` boolean: the same document (and not a later position, when ``causal``)."""
    S = document_ids.shape[1]
    allowed_BSS = document_ids[:, :, None] == document_ids[:, None, :]
    if causal:
        allowed_BSS &= torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()
    return allowed_BSS[:, None]


def _document_attention(q: Tensor, k: Tensor, v: Tensor, documents: DocumentMask) -> Tensor:
    """Attention within documents (causal if the mask is), ``[B, H, S, D]`` in and out, on the mask's backend."""
    B, H, S, D = q.shape
    gqa = q.shape[1] != k.shape[1]

    def flat(x: Tensor) -> Tensor:  # [B, heads, S, D] -> [B*S, heads, D]
        return x.transpose(1, 2).reshape(B * S, x.shape[1], x.shape[3])

    if documents.backend == "flex":
        return _flex_kernel(capabilities(q.device).triton)(
            q, k, v, block_mask=documents.block_mask, enable_gqa=gqa
        )
    backend, dense = documents.backend, documents.dense
    if backend == "fa4":
        q_NHD, k_NKD, v_NKD = _autocast(flat(q), flat(k), flat(v))
        if not _fa4_refused(q_NHD, k_NKD, v_NKD, documents.chosen, "attention_backend"):
            out_NHD = flash4.flash4_attention(
                q_NHD,
                k_NKD,
                v_NKD,
                causal=documents.causal,
                cu_seqlens=documents.cu_seqlens,
                max_seqlen=documents.max_seqlen,
            )
            return out_NHD.view(B, S, H, D).transpose(1, 2)
        # What `auto` serves these masks with without FA4: FlashAttention varlen on CUDA (any head dim; fp32
        # inputs go on to the dense mask below), the dense mask elsewhere.
        if capabilities(q.device).flash_attention and _varlen_attn is not None:
            backend = "varlen"
        else:
            backend, dense = "sdpa", _dense_mask(documents.document_ids, documents.causal)
    if backend == "varlen" and q.dtype not in (torch.float16, torch.bfloat16):
        if not documents.chosen:
            raise ValueError(
                f"attention_backend 'varlen' (FlashAttention) takes fp16 / bf16 inputs, got {q.dtype}: compute "
                "under bf16 autocast, or choose 'auto' (SDPA for fp32 inputs) or 'sdpa'"
            )
        dense = _dense_mask(documents.document_ids, documents.causal)
    elif backend == "varlen":
        if _varlen_attn is None:
            raise RuntimeError(f"attention_backend 'varlen' needs torch >= 2.10, got {torch.__version__}")

        # The keywords changed across torch releases: causality is `is_causal` in 2.10 and `window_size` from
        # 2.11; `enable_gqa` exists from 2.12 (FlashAttention takes fewer key/value heads natively before).
        if "window_size" in _VARLEN_PARAMS:
            causal = {"window_size": (-1, 0) if documents.causal else (-1, -1)}
        else:
            causal = {"is_causal": documents.causal}
        if gqa and "enable_gqa" in _VARLEN_PARAMS:
            causal["enable_gqa"] = True
        cu, longest = documents.cu_seqlens, documents.max_seqlen
        out_NHD = _varlen_attn(flat(q), flat(k), flat(v), cu, cu, longest, longest, **causal)
        return out_NHD.view(B, S, H, D).transpose(1, 2)
    if gqa:
        num_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(num_rep, dim=1), v.repeat_interleave(num_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)


@functools.cache
def _flex_kernel(compiled: bool) -> Any:
    # Compiled FlexAttention generates a fused kernel that skips masked blocks; eager FlexAttention materialises
    # the scores (and has no CPU backward), so it is only used for forward checks on CPU.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    mask: Tensor | None = None,
    documents: DocumentMask | None = None,
    fp8: FP8AttentionScales | None = None,
) -> Tensor:
    """Scaled dot-product attention over ``[B, H, S, D]`` tensors, with grouped-query key/value heads.

    When ``causal``, queries are the *last* ``S_q`` positions of the ``S_kv`` keys (bottom-right alignment), so
    a chunk appended to a KV cache attends to every cached position and causally within itself.

    Args:
        q: queries ``[B, H, S_q, D]``.
        k: keys ``[B, K, S_kv, D]``; ``K`` must divide ``H`` (each key/value head serves ``H / K`` query heads).
        v: values ``[B, K, S_kv, D]``.
        causal: apply the causal constraint.
        mask: optional boolean (True = attend) or additive float mask broadcastable to ``[B, 1, S_q, S_kv]``;
            it restricts attention further and is combined with the causal mask.
        documents: packed-document mask; excludes ``mask`` and a KV cache, and ``causal`` must match the mask's.
        fp8: the layer's FP8 attention state: causal self-attention without a mask, documents or cached
            positions runs in FP8 (:func:`~forge_lightning.kernels.fp8_attention.fp8_attention`); the other
            cases stay in the inputs' precision.

    Without ``fp8`` or ``documents``, calls without ``mask`` (causal ones also without cached positions) run on
    the process's attention kernel (:func:`set_attention_kernel`); the others on SDPA.

    Returns:
        ``[B, H, S_q, D]``.
    """
    if fp8 is not None and causal and mask is None and documents is None and q.shape[2] == k.shape[2]:
        return fp8_attention(q, k, v, fp8)
    if documents is not None:
        if causal != documents.causal:
            raise ValueError(
                f"causal ({causal}) differs from the packed-document mask's ({documents.causal}): pass "
                f"causal={documents.causal} or build the mask with DocumentMask.build(..., causal={causal})"
            )
        if mask is not None or q.shape[2] != k.shape[2]:
            raise ValueError("packed documents need self-attention without another mask or a KV cache")
        return _document_attention(q, k, v, documents)
    num_rep = q.shape[1] // k.shape[1]
    q_len, kv_len = q.shape[2], k.shape[2]
    if _kernel.name == "fa4" and mask is None and (q_len == kv_len or not causal):
        q_BSHD, k_BSKD, v_BSKD = _autocast(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if not _fa4_refused(q_BSHD, k_BSKD, v_BSKD, _kernel.chosen, "performance.attention.kernel"):
            return flash4.flash4_attention(q_BSHD, k_BSKD, v_BSKD, causal=causal).transpose(1, 2)
    if causal and mask is None and q_len == kv_len:
        # Grouped heads natively: cuDNN and FlashAttention read each key/value head once (no expanded copies
        # saved for backward).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=num_rep > 1)
    if num_rep > 1:
        # Expanded explicitly: the kernels that take masks do not all honour `enable_gqa`.
        k, v = k.repeat_interleave(num_rep, dim=1), v.repeat_interleave(num_rep, dim=1)
    if causal and q_len > 1:
        mask = _with_causal(mask, q_len, kv_len, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _with_causal(mask: Tensor | None, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Bottom-right causal boolean mask ``[q_len, kv_len]`` merged with an optional boolean or additive mask."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    causal_QK = q_pos[:, None] >= torch.arange(kv_len, device=device)[None, :]
    if mask is None:
        return causal_QK
    if mask.dtype == torch.bool:
        return mask & causal_QK
    return torch.where(causal_QK, mask, torch.full((), float("-inf"), dtype=mask.dtype, device=device))


class KVCache:
    """Preallocated keys and values of one attention layer, for incremental decoding.

    Args:
        batch_size: number of sequences decoded together (all share the same length).
        num_kv_heads: key/value heads of the layer.
        max_len: most positions the cache can hold (prompt plus new tokens).
        head_dim: size of one head.
        dtype: storage dtype (the model's compute dtype).
        device: storage device.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``[B, K, S, D]`` keys and values; return every cached position ``[B, K, length, D]``."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache overflow: {end} positions needed, the cache holds max_len ({self.max_len})"
            )
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def reset(self) -> None:
        """Forget the cached positions (the storage is reused)."""
        self.length = 0


class SelfAttention(nn.Module):
    """Causal self-attention over a KV cache: what :class:`Attention` and MLA's ``MultiLatentAttention`` share.

    A subclass builds ``o_proj`` and implements :meth:`queries_keys_values` (its own projections, RoPE and cache
    layout); the forward, the kernel call and the output projection are these.
    """

    o_proj: nn.Linear
    fp8_scales: FP8AttentionScales | None = None
    """Set by ``performance.fp8.attention``: this layer's attention runs in FP8 (see :func:`attention`)."""

    def queries_keys_values(
        self, x_BSD: Tensor, rope: tuple[Tensor, Tensor], kv_cache: KVCache | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[B, H, S, D]`` of ``x`` and keys / values ``[B, K, L, D]`` of every attended position.

        ``kv_cache`` (``None``: no cache) receives this layer's new entries; ``L`` counts the cached positions
        and the new ones.
        """
        raise NotImplementedError

    def forward(
        self,
        x_BSD: Tensor,
        rope: tuple[Tensor, Tensor],
        *,
        kv_cache: KVCache | None = None,
        mask: Tensor | None = None,
        documents: DocumentMask | None = None,
    ) -> Tensor:
        """Attend ``x`` ``[B, S, hidden]`` to itself (and to ``kv_cache``'s positions); return ``[B, S, hidden]``.

        Args:
            x_BSD: normalised hidden states.
            rope: ``(cos, sin)`` for the new positions, from :class:`~forge_lightning.modules.layers.RotaryEmbedding`.
            kv_cache: this layer's cache; the new entries are appended to it.
            mask: optional extra mask, see :func:`attention`.
            documents: packed-document mask, see :func:`attention`.
        """
        B, S, _ = x_BSD.shape
        q, k, v = self.queries_keys_values(x_BSD, rope, kv_cache)
        out_BHSD = attention(q, k, v, causal=True, mask=mask, documents=documents, fp8=self.fp8_scales)
        return self.o_proj(out_BHSD.transpose(1, 2).reshape(B, S, -1))


class Attention(SelfAttention):
    """Multi-head self-attention with grouped key/value heads (GQA / MQA), RoPE and optional per-head q/k norm.

    Submodule names follow Hugging Face (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``).

    Args:
        hidden_size: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (divides ``num_heads``).
        head_dim: size of one head (may differ from ``hidden_size / num_heads``).
        qkv_bias: bias on the q/k/v projections (Qwen2).
        o_bias: bias on the output projection.
        qk_norm: RMSNorm over each query and key head before RoPE (Qwen3).
        norm_eps: epsilon of the q/k norms.
        init_std: standard deviation of the normal initialisation of the projection weights.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.init_std = init_std
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            init_linear(proj, self.init_std)

    def rotate(self, x_BSHD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Apply the rotary embedding ``(cos, sin)`` ``[B, S, D/2]`` to queries or keys ``[B, S, heads, D]``."""
        return apply_rotary(x_BSHD, cos, sin)

    def queries_keys_values(
        self, x_BSD: Tensor, rope: tuple[Tensor, Tensor], kv_cache: KVCache | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        B, S, _ = x_BSD.shape
        # Head counts come from the projections' outputs, so a tensor-parallel shard sees its local heads.
        q_BSHD = self.q_norm(self.q_proj(x_BSD).view(B, S, -1, self.head_dim))
        k_BSKD = self.k_norm(self.k_proj(x_BSD).view(B, S, -1, self.head_dim))
        v_BSKD = self.v_proj(x_BSD).view(B, S, -1, self.head_dim)
        q_BSHD, k_BSKD = self.rotate(q_BSHD, *rope), self.rotate(k_BSKD, *rope)
        q, k, v = q_BSHD.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2)  # [B, heads, S, D]
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        return q, k, v

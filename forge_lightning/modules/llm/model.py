"""The decoder LM (dense or mixture-of-experts) as a plain ``nn.Module``.

Submodule names follow Hugging Face (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ...,
``model.norm``, ``lm_head``), so a checkpoint's state dict loads one to one::

    input_ids ─ embed_tokens ─ [DecoderLayer] x num_layers ─ norm ─ (hidden_states) ─ lm_head ─ logits
                                 x + attn(norm(x)); x + mlp(norm(x))

With ``config.num_nextn_predict_layers`` = D, DeepSeek-V3's multi-token prediction modules follow (``mtp``, saved as
``model.layers.{num_layers + k}``; see :class:`MTPLayer` and :meth:`DecoderLM.mtp_hidden_states`).

Each layer's ``self_attn`` is grouped-query :class:`Attention` or :class:`MultiLatentAttention` (``config.mla``) and
its ``mlp`` a dense :class:`GatedMLP` or a :class:`MoEBlock` (``config.moe``), chosen by :func:`build_attention`
and :func:`build_mlp`.

Packed rows (several documents per sequence) pass ``document_ids``: attention stays within each document and,
unless ``position_ids`` are given, positions restart at every document.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from forge_lightning.modules.layers import (
    MROPE_KEYS,
    Attention,
    DocumentMask,
    GatedMLP,
    GatedSharedExpertMoE,
    GroupLimitedRouter,
    KVCache,
    LatentKVCache,
    MoEBlock,
    MultiLatentAttention,
    MultimodalRotaryEmbedding,
    RMSNorm,
    RotaryEmbedding,
    RouterLosses,
    SharedExpertsMoE,
    TopKRouter,
    router_losses,
)
from forge_lightning.modules.layers.attention import check_attention_backend, document_positions
from forge_lightning.modules.layers.init import reset_owned_parameters
from forge_lightning.modules.llm.config import LLMConfig, MoEConfig

# The decoder LM's tensor-parallel plan, here alone (DecoderLM.tp_plan): styles of the parts every layer kind shares
# (names relative to one decoder layer), of the modules around the layers (`<root>.` names), and each MoE block's
# and MLA layer's own (`tp_plan()`): routed experts, routers and MLA stay replicated; expert parallelism is the
# Megatron strategy's job.
_ROOT_TP_PLAN = {
    "<root>.model.embed_tokens": "rowwise_embedding",
    "<root>.model.norm": "sequence",
    "<root>.lm_head": "colwise_output",
}
_NORMS_TP_PLAN = {"input_layernorm": "sequence", "post_attention_layernorm": "sequence"}
_GQA_TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
}
_DENSE_MLP_TP_PLAN = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def build_attention(config: LLMConfig) -> nn.Module:
    """The ``self_attn`` of a decoder layer: :class:`MultiLatentAttention` with ``config.mla``, else GQA."""
    if config.mla is not None:
        m = config.mla
        return MultiLatentAttention(
            config.hidden_size,
            config.num_heads,
            kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim,
            q_lora_rank=m.q_lora_rank,
            rope_interleave=m.rope_interleave,
            bias=config.attention_bias,
            init_std=config.initializer_range,
        )
    return Attention(
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        qkv_bias=config.attention_bias,
        o_bias=config.o_proj_bias,
        qk_norm=config.qk_norm,
        norm_eps=config.rms_norm_eps,
        init_std=config.initializer_range,
    )


def build_rotary(config: LLMConfig) -> RotaryEmbedding:
    """The model's rotary embedding: :class:`MultimodalRotaryEmbedding` when the config has ``mrope_section``."""
    if config.mrope_section is None:
        return RotaryEmbedding(config.rope_head_dim, config.rope_theta, config.rope_scaling)
    frequencies = {k: v for k, v in config.rope_scaling.items() if k not in MROPE_KEYS}
    return MultimodalRotaryEmbedding(
        config.rope_head_dim,
        config.mrope_section,
        config.rope_theta,
        frequencies if frequencies["rope_type"] != "default" else None,
        interleaved=config.mrope_interleaved,
    )


def build_mlp(config: LLMConfig, layer_index: int) -> nn.Module:
    """The ``mlp`` of decoder layer ``layer_index``: a :class:`MoEBlock` where ``config.moe`` puts experts."""
    if config.is_moe_layer(layer_index):
        return build_moe(config.hidden_size, config.moe, init_std=config.initializer_range)
    return GatedMLP(
        config.hidden_size, config.intermediate_size, bias=config.mlp_bias, init_std=config.initializer_range
    )


def build_moe(hidden_size: int, moe: MoEConfig, *, init_std: float) -> MoEBlock:
    """A MoE block with the router and shared-expert layout ``moe`` describes."""
    if moe.score_func == "sigmoid":
        router: nn.Module = GroupLimitedRouter(
            hidden_size,
            moe.num_experts,
            moe.num_experts_per_tok,
            num_groups=moe.num_groups,
            topk_group=moe.num_groups_per_tok,
            norm_topk_prob=moe.norm_topk_prob,
            scaling=moe.routed_scaling_factor,
            init_std=init_std,
        )
    else:
        router = TopKRouter(
            hidden_size,
            moe.num_experts,
            moe.num_experts_per_tok,
            norm_topk_prob=moe.norm_topk_prob,
            scaling=moe.routed_scaling_factor,
            init_std=init_std,
        )
    args = (hidden_size, router, moe.num_experts, moe.intermediate_size)
    if not moe.shared_intermediate_size:
        return MoEBlock(*args, init_std=init_std)
    shared_cls = GatedSharedExpertMoE if moe.shared_expert_gate else SharedExpertsMoE
    return shared_cls(*args, moe.shared_intermediate_size, init_std=init_std)


def block_tp_plan(layers: Sequence[DecoderLayer]) -> dict[str, str]:
    """Tensor-parallel styles valid for every one of ``layers`` (the plan is applied to each block alike).

    Layer kinds shard different modules (a DeepSeek model's first dense layers have ``mlp.gate_proj``, its MoE
    layers ``mlp.shared_experts.gate_proj``), so only the entries all layers share are kept; the others stay
    replicated rather than naming modules that some blocks lack.
    """
    plans = [layer.tp_plan() for layer in layers]
    return {k: v for k, v in plans[0].items() if all(plan.get(k) == v for plan in plans[1:])} if plans else {}


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then an MLP (dense or MoE), each around a residual connection.

    Args:
        config: the model's configuration.
        layer_index: position of the layer in the stack (decides dense or MoE).
    """

    def __init__(self, config: LLMConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.self_attn = build_attention(config)
        self.mlp = build_mlp(config, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def tp_plan(self) -> dict[str, str]:
        """Tensor-parallel styles of this layer's modules (names relative to the layer)."""
        plan = dict(_NORMS_TP_PLAN)
        if isinstance(self.self_attn, MultiLatentAttention):
            plan.update({f"self_attn.{k}": v for k, v in self.self_attn.tp_plan().items()})
        else:
            plan.update(_GQA_TP_PLAN)
        if isinstance(self.mlp, MoEBlock):
            plan.update({f"mlp.{k}": v for k, v in self.mlp.tp_plan().items()})
        else:
            plan.update(_DENSE_MLP_TP_PLAN)
        return plan

    def forward(
        self,
        x_BSD: Tensor,
        rope: tuple[Tensor, Tensor],
        *,
        kv_cache: KVCache | None = None,
        mask: Tensor | None = None,
        documents: DocumentMask | None = None,
    ) -> Tensor:
        x_BSD = x_BSD + self.self_attn(
            self.input_layernorm(x_BSD), rope, kv_cache=kv_cache, mask=mask, documents=documents
        )
        return x_BSD + self.mlp(self.post_attention_layernorm(x_BSD))


class MTPHead(nn.Module):
    """The norm before an MTP module's output head (``shared_head.norm``); the head is the model's ``lm_head``."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """One multi-token prediction module of DeepSeek-V3 (arXiv:2412.19437, sec. 2.2), depth ``k``: the projection
    ``M_k`` (``eh_proj``) of the normed token embeddings and previous-depth hidden states, a transformer block
    ``TRM_k`` (this layer's own attention and MLP) and the norm of the shared output head::

        Emb(t_{i+k}) ─ enorm ─┐
                              cat ─ eh_proj ─ TRM_k ─ shared_head.norm ─ h^k_i (─ lm_head: logits of t_{i+k+1})
        h^{k-1}_i    ─ hnorm ─┘

    The concatenation puts the embedding first, as DeepSeek-V3's checkpoint's ``eh_proj`` (and megatron-core) take
    it. The embedding and the output head are the main model's (shared).

    Args:
        config: the model's configuration.
        layer_index: its index in the checkpoint, ``num_layers + k - 1`` (decides dense or MoE).
    """

    def __init__(self, config: LLMConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.init_std = config.initializer_range
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = MTPHead(config)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.eh_proj.weight, mean=0.0, std=self.init_std)

    def forward(  # type: ignore[override]
        self,
        hidden_BSD: Tensor,
        embeds_BSD: Tensor,
        rope: tuple[Tensor, Tensor],
        *,
        documents: DocumentMask | None = None,
    ) -> Tensor:
        """``h^k`` ``[B, S, D]`` (normed for the head) of the previous depth's ``hidden_BSD`` and the embeddings of
        the tokens ``k`` positions ahead, ``embeds_BSD``."""
        x_BSD = self.eh_proj(torch.cat([self.enorm(embeds_BSD), self.hnorm(hidden_BSD)], dim=-1))
        return self.shared_head.norm(super().forward(x_BSD, rope, documents=documents))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (Hugging Face's ``model`` submodule).

    Args:
        config: the model's configuration.
        attention_backend: kernel for packed rows (see ``forge_lightning.modules.layers.attention``).
    """

    def __init__(self, config: LLMConfig, *, attention_backend: str = "auto") -> None:
        super().__init__()
        self.attention_backend = check_attention_backend(attention_backend)
        self.init_std = config.initializer_range
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = build_rotary(config)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=self.init_std)

    def forward(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None = None,
        *,
        kv_cache: list[KVCache] | None = None,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        layer_residuals: Sequence[Tensor] | None = None,
    ) -> Tensor:
        """Final-normed hidden states ``[B, S, hidden]``; see :meth:`DecoderLM.hidden_states` for the arguments."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, S] and inputs_embeds [B, S, hidden]")
        x_BSD = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if (
            position_ids is not None
            and position_ids.ndim == 3
            and not isinstance(self.rotary_emb, MultimodalRotaryEmbedding)
        ):
            raise ValueError(
                f"position_ids of shape {list(position_ids.shape)} are multimodal RoPE positions [3, B, S], but "
                "the config has no rope_scaling mrope_section: pass [B, S] positions, or a config with one "
                "(Qwen2.5-VL / Qwen3-VL text models)"
            )
        documents = None
        if document_ids is not None:
            if kv_cache is not None or attention_mask is not None:
                raise ValueError(
                    "document_ids (packed rows) cannot be combined with a KV cache or attention_mask"
                )
            documents = DocumentMask.build(document_ids, self.attention_backend)
            if position_ids is None:
                position_ids = document_positions(document_ids)
        if position_ids is None:
            start = kv_cache[0].length if kv_cache is not None else 0
            position_ids = torch.arange(start, start + x_BSD.shape[1], device=x_BSD.device)[None]  # [1, S]
        residuals = () if layer_residuals is None else layer_residuals
        if len(residuals) > len(self.layers):
            raise ValueError(
                f"layer_residuals holds {len(residuals)} tensors but the model has {len(self.layers)} layers"
            )
        rope = self.rotary_emb(position_ids)
        for i, layer in enumerate(self.layers):
            cache = None if kv_cache is None else kv_cache[i]
            x_BSD = layer(x_BSD, rope, kv_cache=cache, mask=attention_mask, documents=documents)
            if i < len(residuals):
                x_BSD = x_BSD + residuals[i].to(x_BSD.dtype)
        return self.norm(x_BSD)


class DecoderLM(nn.Module):
    """Decoder-only causal LM (Llama / Qwen2 / Qwen3 / Mistral, Qwen2-MoE / Qwen3-MoE / DeepSeek-V3) with Hugging
    Face parameter names.

    After a forward, :meth:`router_losses` gives the MoE layers' load-balancing loss, router z-loss and per-expert
    token counts.

    Build on the meta device for large sizes, then ``to_empty(device=...)`` and :meth:`init_weights`.

    Args:
        config: the model's configuration.
        attention_backend: kernel for packed rows: ``auto``, ``sdpa``, ``flex`` or ``varlen`` (see
            ``forge_lightning.modules.layers.attention``).
    """

    def __init__(self, config: LLMConfig, *, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, attention_backend=attention_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList(
            MTPLayer(config, config.num_layers + k) for k in range(config.num_nextn_predict_layers)
        )
        self.init_weights()

    def tp_plan(self) -> dict[str, str]:
        """Tensor-parallel styles: the entries every decoder layer shares (:func:`block_tp_plan`) and the
        ``<root>.`` entries of the embedding, final norm and output head."""
        return {**block_tp_plan(list(self.model.layers)), **_ROOT_TP_PLAN}

    def tp_dims(self) -> dict[str, int]:
        """The sizes a tensor-parallel degree must divide: the vocabulary (embedding and head are split by rows),
        the query and key/value heads of grouped-query attention, the MLP widths of dense layers and shared
        experts (routed experts and multi-latent attention stay whole natively; MegatronStrategy checks its own
        expert and MLA layout)."""
        c = self.config
        dims = {"vocab_size": c.vocab_size, "num_heads": c.num_heads}
        if c.mla is None:
            dims["num_kv_heads"] = c.num_kv_heads
        if any(not c.is_moe_layer(i) for i in range(c.num_layers)):
            dims["intermediate_size"] = c.intermediate_size
        if c.moe is not None and c.moe.shared_intermediate_size:
            dims["moe.shared_intermediate_size"] = c.moe.shared_intermediate_size
        return dims

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding matrix when the config ties them (no-op otherwise)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_parameters(self) -> None:
        if not self.config.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=self.config.initializer_range)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and rebuild the RoPE buffers, e.g. after ``to_empty``.

        Linear and Embedding weights are drawn from ``N(0, initializer_range)`` and biases zeroed by the block
        that owns them; norms are set to one. Weight tying is restored first (``to_empty`` breaks it).
        """
        self.tie_weights()
        reset_owned_parameters(self.modules())

    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE blocks, in layer order (empty for a dense model)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]

    def router_losses(self, token_mask: Tensor | None = None) -> RouterLosses | None:
        """Router losses and expert loads of the last forward (``None`` for a dense model), over the tokens
        ``token_mask`` ``[B, S]`` keeps (default all); see :func:`~forge_lightning.modules.layers.moe.router_losses`."""
        blocks = self.moe_blocks()
        return router_losses(blocks, token_mask) if blocks else None

    def hidden_states(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None = None,
        *,
        kv_cache: list[KVCache] | None = None,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        layer_residuals: Sequence[Tensor] | None = None,
    ) -> Tensor:
        """Final-normed hidden states ``[B, S, hidden]`` (what a fused / chunked cross-entropy consumes).

        Arguments as for :meth:`forward`, plus ``layer_residuals``: ``[B, S, hidden]`` tensors added to the output
        of the first ``len(layer_residuals)`` decoder layers, one each (Qwen3-VL's DeepStack: vision features of
        earlier encoder layers join the hidden states at the visual tokens, zero elsewhere).
        """
        return self.model(
            input_ids,
            position_ids,
            kv_cache=kv_cache,
            attention_mask=attention_mask,
            document_ids=document_ids,
            inputs_embeds=inputs_embeds,
            layer_residuals=layer_residuals,
        )

    def forward(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None = None,
        *,
        kv_cache: list[KVCache] | None = None,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[B, S, vocab]`` for token ids ``[B, S]`` (or input embeddings ``[B, S, hidden]``).

        Args:
            input_ids: token ids ``[B, S]``, or ``None`` with ``inputs_embeds``.
            position_ids: positions ``[B, S]`` (or ``[1, S]``); default ``0..S-1`` after the cached positions.
                With multimodal RoPE (``config.mrope_section``) also ``[3, B, S]`` temporal / height / width
                positions (see ``forge_lightning.modules.vlm.positions``).
            kv_cache: one :class:`KVCache` per layer (see :meth:`init_kv_cache`); the new keys/values are
                appended and attention covers every cached position (causal within the new tokens).
            attention_mask: optional boolean (True = attend) or additive mask broadcastable to
                ``[B, 1, S, S_kv]``, combined with the causal mask.
            document_ids: ``[B, S]`` document index of each token of packed rows (non-decreasing per row):
                attention stays within each document; positions restart per document unless ``position_ids``
                are given.
            inputs_embeds: ``[B, S, hidden]`` input embeddings instead of ``input_ids`` (e.g. text embeddings with
                image features in place of placeholder tokens); pass ``None`` as ``input_ids`` then.
        """
        hidden_BSD = self.hidden_states(
            input_ids,
            position_ids,
            kv_cache=kv_cache,
            attention_mask=attention_mask,
            document_ids=document_ids,
            inputs_embeds=inputs_embeds,
        )
        return self.lm_head(hidden_BSD)

    def mtp_hidden_states(
        self,
        hidden_BSD: Tensor,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> list[Tensor]:
        """Each MTP depth's normed hidden states, ``h^k`` ``[B, S - k, hidden]`` for ``k = 1..D``: position ``i``
        of depth ``k`` combines ``h^{k-1}_i`` with the embedding of ``t_{i+k}``, and ``lm_head`` of it predicts
        ``t_{i+k+1}``. Depth ``k`` runs on the first ``S - k`` positions (the causal attention of those never sees
        the later ones, so this equals megatron-core's rolled full-length sequences on them).

        Args:
            hidden_BSD: the main model's final-normed hidden states (:meth:`hidden_states`), ``h^0``.
            input_ids: the token ids ``[B, S]`` the hidden states are of.
            position_ids: their positions (``[B, S]`` or ``[1, S]``); default as :meth:`forward`.
            document_ids: packed rows' document ids ``[B, S]``: each depth attends within documents (the loss
                leaves out positions whose token ``k`` ahead is in another document, see ``llm/mtp.py``).
        """
        S = input_ids.shape[1]
        if hidden_BSD.shape[:2] != input_ids.shape:
            raise ValueError(
                f"hidden states of shape {list(hidden_BSD.shape)} for input_ids of shape {list(input_ids.shape)}: "
                "multi-token prediction needs each sequence's hidden states whole (not a sequence-parallel or "
                "context-parallel share); train it without sequence_parallel / context parallelism"
            )
        if len(self.mtp) >= S:
            raise ValueError(
                f"sequences of {S} tokens are too short for {len(self.mtp)} multi-token prediction depths "
                "(num_nextn_predict_layers): depth k predicts the token k + 1 ahead; use longer sequences"
            )
        if position_ids is None:
            position_ids = (
                document_positions(document_ids)
                if document_ids is not None
                else torch.arange(S, device=input_ids.device)[None]
            )
        out, h_BSD = [], hidden_BSD
        for k, layer in enumerate(self.mtp, start=1):
            keep = S - k  # positions i whose token t_{i+k} exists
            embeds_BSD = self.model.embed_tokens(input_ids[:, k:])
            documents = None
            if document_ids is not None:
                documents = DocumentMask.build(document_ids[:, :keep], self.model.attention_backend)
            rope = self.model.rotary_emb(position_ids[:, :keep])
            h_BSD = layer(h_BSD[:, :keep], embeds_BSD, rope, documents=documents)
            out.append(h_BSD)
        return out

    def init_kv_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[KVCache]:
        """Empty per-layer KV caches for ``batch_size`` sequences of up to ``max_len`` positions.

        Args:
            batch_size: sequences decoded together.
            max_len: prompt plus generated tokens.
            dtype: cache dtype; defaults to the model's parameter dtype.
            device: cache device; defaults to the model's device.
        """
        weight = self.model.embed_tokens.weight
        c, dtype, device = self.config, dtype or weight.dtype, device or weight.device
        if c.mla is not None:
            m = c.mla
            return [
                LatentKVCache(
                    batch_size, max_len, m.kv_lora_rank, m.qk_rope_head_dim, dtype=dtype, device=device
                )
                for _ in range(c.num_layers)
            ]
        return [
            KVCache(batch_size, c.num_kv_heads, max_len, c.head_dim, dtype=dtype, device=device)
            for _ in range(c.num_layers)
        ]

"""The Wan video DiT (Wan 2.1 / 2.2), equal to diffusers' ``WanTransformer3DModel``.

Submodule and parameter names are diffusers', so its state dict loads as it is. Data flow (B videos, S = f*h*w
patch tokens, L text tokens, D width)::

    video [B,C,F,H,W] ─ patch_embedding (Conv3d) ─ tokens [B,S,D] ──────────────────────┐
    timestep [B] or [B,S] ─ sinusoid ─ time_embedder ─ temb ─┬─ time_proj ─ [B,1|S,6,D] ─┤
    text [B,L,text_dim] ─ text_embedder ─ [B,L,D] ───────────│───────────────────────────┤
    image [B,N,image_dim] ─ image_embedder ─ [B,N,D] (I2V) ──│───────────────────────────┤
                                                             │        blocks × num_layers
                                                             └─ norm_out, shift/scale ─ proj_out ─ unpatchify

Each block: adaLN-modulated self-attention (q / k RMSNorm across heads, 3-D RoPE), cross-attention to the text
(plus, for I2V, to the image tokens through the added k / v projections), adaLN-modulated GELU feed-forward.

:meth:`WanDiT.forward_packed` runs several videos of different sizes as one token sequence: self-attention within
each video (a non-causal :class:`~forge_lightning.modules.layers.DocumentMask`), cross-attention of each video's
tokens to its own text and image tokens, RoPE and modulation per video.

Both forwards read the token sequence's layout (:mod:`forge_lightning.modules.layers.sequence`): whole by default;
with context parallelism (:meth:`WanDiT.set_sequence_layout`) each rank keeps its slice of the patch tokens (with
its RoPE rows and per-token modulation) from the patch embedding to the output projection, self-attention runs
over the ranks, cross-attention stays local (each slice's queries attend to the whole text), and the output is
gathered before unpatchify.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forge_lightning.modules.diffusion.wan_config import WanDiTConfig
from forge_lightning.modules.layers.attention import attention
from forge_lightning.modules.layers.init import reset_owned_parameters
from forge_lightning.modules.layers.norms import RMSNorm
from forge_lightning.modules.layers.rope import apply_rotary
from forge_lightning.modules.layers.sequence import WholeSequence


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 and returned in the input's dtype (Wan keeps its norms in fp32)."""

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class GELUProjection(nn.Module):
    """``gelu(proj(x))`` (diffusers' ``GELU`` activation module; ``approximate`` as in ``F.gelu``)."""

    def __init__(self, dim_in: int, dim_out: int, approximate: str = "none") -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x), approximate=self.approximate)


class FeedForward(nn.Module):
    """Linear -> GELU -> Linear, laid out as diffusers' ``FeedForward`` (``net.0.proj``, ``net.2``)."""

    def __init__(self, dim: int, inner_dim: int, dim_out: int, approximate: str) -> None:
        super().__init__()
        self.net = nn.ModuleList(
            [GELUProjection(dim, inner_dim, approximate), nn.Identity(), nn.Linear(inner_dim, dim_out)]
        )

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class WanRotaryEmbedding(nn.Module):
    """3-D RoPE tables: the ``head_dim / 2`` rotated pairs are split between the frame, row and column index in
    Wan's proportions (:attr:`WanDiTConfig.rope_axes`), each axis with the frequencies of a plain RoPE of its own
    size. Angles are computed in float64, as diffusers does, then returned in fp32.

    Args:
        axes: head channels per axis (each even).
        theta: RoPE base wavelength.
    """

    def __init__(self, axes: tuple[int, int, int], theta: float = 10000.0) -> None:
        super().__init__()
        self.axes, self.theta = axes, theta

    def forward(self, positions_S3: Tensor) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` ``[S, head_dim / 2]`` for integer ``(frame, row, column)`` positions ``[S, 3]``."""
        angles = []
        for axis, size in enumerate(self.axes):
            exponents = torch.arange(0, size, 2, dtype=torch.float64, device=positions_S3.device) / size
            angles.append(positions_S3[:, axis, None].double() / self.theta**exponents)
        angles_SF = torch.cat(angles, dim=-1)
        return angles_SF.cos().float(), angles_SF.sin().float()


def grid_positions(frames: int, height: int, width: int, device: torch.device) -> Tensor:
    """``(frame, row, column)`` of each patch token of a ``frames x height x width`` grid, row-major: ``[S, 3]``."""
    axes = [torch.arange(n, device=device) for n in (frames, height, width)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)


def rotate_interleaved(x_BSHD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Wan's RoPE rotates adjacent channel pairs ``(2i, 2i+1)``. Queries and keys are returned with their channels
    reordered (even ones first), which turns those pairs into the halves :func:`apply_rotary` rotates; the same
    reorder of q and k leaves every ``q . k`` (so the attention) unchanged.

    Args:
        x_BSHD: queries or keys ``[B, S, H, D]``.
        cos: ``[S, D/2]`` (or ``[B, S, D/2]``), from :class:`WanRotaryEmbedding`.
        sin: like ``cos``.
    """
    x_BSHD = x_BSHD.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return apply_rotary(x_BSHD, cos.expand(x_BSHD.shape[0], -1, -1), sin.expand(x_BSHD.shape[0], -1, -1))


@dataclass
class CrossContext:
    """What a block's cross-attention reads: the embedded text (and image tokens, I2V), and for packed videos the
    masks that keep each video's tokens to its own text / image (``[B, 1, S, L]`` booleans; ``None``: all)."""

    text_BLD: Tensor
    image_BND: Tensor | None = None
    text_mask: Tensor | None = None
    image_mask: Tensor | None = None


class WanSelfAttention(nn.Module):
    """Self-attention with q / k RMSNorm over all heads and 3-D RoPE (diffusers' ``attn1``); the attention itself
    runs through the model's sequence ``layout`` (whole, or split over context-parallel ranks)."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.layout = WholeSequence()
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Identity()])
        self.norm_q, self.norm_k = RMSNorm(dim, eps), RMSNorm(dim, eps)

    def forward(self, x_BSD: Tensor, rope: tuple[Tensor, Tensor], documents: Any) -> Tensor:
        B, S, D = x_BSD.shape
        q_BSHD = self.norm_q(self.to_q(x_BSD)).unflatten(-1, (self.num_heads, -1))
        k_BSHD = self.norm_k(self.to_k(x_BSD)).unflatten(-1, (self.num_heads, -1))
        v_BSHD = self.to_v(x_BSD).unflatten(-1, (self.num_heads, -1))
        q_BSHD, k_BSHD = rotate_interleaved(q_BSHD, *rope), rotate_interleaved(k_BSHD, *rope)
        q, k, v = q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2)  # [B, H, S, Dh]
        out_BHSD = self.layout.attention(q, k, v, documents)
        return self.to_out[0](out_BHSD.transpose(1, 2).reshape(B, S, D))


class WanCrossAttention(nn.Module):
    """Cross-attention to the text, plus (I2V) a second attention to the image tokens through ``add_k_proj`` /
    ``add_v_proj``, the two outputs summed (diffusers' ``attn2``).

    Args:
        dim: model width.
        num_heads: attention heads.
        eps: epsilon of the q / k norms.
        added_kv_proj_dim: input width of the image key / value projections; ``None``: no image branch.
    """

    def __init__(self, dim: int, num_heads: int, eps: float, added_kv_proj_dim: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Identity()])
        self.norm_q, self.norm_k = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.add_k_proj = self.add_v_proj = None
        if added_kv_proj_dim is not None:
            self.add_k_proj = nn.Linear(added_kv_proj_dim, dim)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, dim)
            self.norm_added_k = RMSNorm(dim, eps)

    def _heads(self, x_BLD: Tensor) -> Tensor:
        return x_BLD.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # [B, H, L, Dh]

    def forward(self, x_BSD: Tensor, context: CrossContext) -> Tensor:
        B, S, D = x_BSD.shape
        q = self._heads(self.norm_q(self.to_q(x_BSD)))
        k = self._heads(self.norm_k(self.to_k(context.text_BLD)))
        out_BHSD = attention(
            q, k, self._heads(self.to_v(context.text_BLD)), causal=False, mask=context.text_mask
        )
        if self.add_k_proj is not None:
            if context.image_BND is None:
                raise ValueError(
                    "this I2V model needs encoder_hidden_states_image (the image encoder's tokens)"
                )
            k_img = self._heads(self.norm_added_k(self.add_k_proj(context.image_BND)))
            v_img = self._heads(self.add_v_proj(context.image_BND))
            out_BHSD = out_BHSD + attention(q, k_img, v_img, causal=False, mask=context.image_mask)
        return self.to_out[0](out_BHSD.transpose(1, 2).reshape(B, S, D))


class WanBlock(nn.Module):
    """One Wan transformer block; the unit of activation checkpointing, ``torch.compile`` and FSDP wrapping.

    ``modulation_BT6D`` is the time projection ``[B, T, 6, D]`` (``T`` = 1 for one timestep per video, or the
    token count for per-token timesteps); with ``scale_shift_table`` it gives the shift, scale and gate of the
    self-attention and the feed-forward.
    """

    def __init__(self, config: WanDiTConfig) -> None:
        super().__init__()
        dim, eps = config.dim, config.eps
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanSelfAttention(dim, config.num_heads, eps)
        self.attn2 = WanCrossAttention(dim, config.num_heads, eps, config.added_kv_proj_dim)
        self.norm2 = (
            FP32LayerNorm(dim, eps, elementwise_affine=True) if config.cross_attn_norm else nn.Identity()
        )
        self.ffn = FeedForward(dim, config.ffn_dim, dim, approximate="tanh")
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.empty(1, 6, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Wan's initialisation: Xavier-uniform linear weights, zero biases, modulation table ``N(0, 1/dim)``."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                _xavier(module)
        nn.init.normal_(self.scale_shift_table, std=self.scale_shift_table.shape[-1] ** -0.5)

    def forward(
        self,
        x_BSD: Tensor,
        context: CrossContext,
        modulation_BT6D: Tensor,
        rope: tuple[Tensor, Tensor],
        documents: Any = None,
    ) -> Tensor:
        mod = (self.scale_shift_table[None] + modulation_BT6D.float()).unbind(2)  # 6 x [B, T, D]
        shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = mod
        h = (self.norm1(x_BSD.float()) * (1 + scale_msa) + shift_msa).type_as(x_BSD)
        x_BSD = (x_BSD.float() + self.attn1(h, rope, documents) * gate_msa).type_as(x_BSD)
        x_BSD = x_BSD + self.attn2(self.norm2(x_BSD.float()).type_as(x_BSD), context)
        h = (self.norm3(x_BSD.float()) * (1 + scale_ffn) + shift_ffn).type_as(x_BSD)
        return (x_BSD.float() + self.ffn(h).float() * gate_ffn).type_as(x_BSD)


def timestep_sinusoid(timesteps: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """``[cos(t w_i), sin(t w_i)]`` with ``w_i = max_period^(-i / (dim/2))`` for timesteps ``[N]``: ``[N, dim]``
    (diffusers' ``Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0)``)."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    )
    angles = timesteps.float()[:, None] * freqs[None]
    emb = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return F.pad(emb, (0, dim % 2))


class TimestepMLP(nn.Module):
    """``linear_2(silu(linear_1(x)))`` (diffusers' ``TimestepEmbedding``)."""

    def __init__(self, dim_in: int, dim: int) -> None:
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(dim_in, dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TextProjection(nn.Module):
    """``linear_2(gelu_tanh(linear_1(x)))`` (diffusers' ``PixArtAlphaTextProjection``)."""

    def __init__(self, dim_in: int, dim: int) -> None:
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(dim_in, dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


class WanImageEmbedding(nn.Module):
    """The image encoder's tokens into the model width: LayerNorm, GELU MLP, LayerNorm (plus, for FLF2V, a learned
    position embedding over the two images' tokens)."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int | None) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(image_dim)
        self.ff = FeedForward(image_dim, image_dim, dim, approximate="none")
        self.norm2 = FP32LayerNorm(dim)
        self.pos_embed = None
        if pos_embed_seq_len is not None:
            self.pos_embed = nn.Parameter(torch.zeros(1, pos_embed_seq_len, image_dim))

    def forward(self, image_BNE: Tensor) -> Tensor:
        if self.pos_embed is not None:
            # The tokens of both images (first and last frame) side by side: [B/2 pairs, 2N, E].
            image_BNE = image_BNE.reshape(-1, self.pos_embed.shape[1], image_BNE.shape[-1]) + self.pos_embed
        return self.norm2(self.ff(self.norm1(image_BNE)))


class WanConditionEmbedder(nn.Module):
    """Timestep, text and image embeddings (diffusers' ``WanTimeTextImageEmbedding``)."""

    def __init__(self, config: WanDiTConfig) -> None:
        super().__init__()
        self.freq_dim = config.freq_dim
        self.time_embedder = TimestepMLP(config.freq_dim, config.dim)
        self.time_proj = nn.Linear(config.dim, 6 * config.dim)
        self.text_embedder = TextProjection(config.text_dim, config.dim)
        self.image_embedder = None
        if config.image_dim is not None:
            self.image_embedder = WanImageEmbedding(config.image_dim, config.dim, config.pos_embed_seq_len)

    def time(self, timesteps_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``temb`` ``[B, T, D]`` (in ``dtype``) and the block modulation ``[B, T, 6, D]`` of timesteps ``[B, T]``."""
        B, T = timesteps_BT.shape
        sinusoid = timestep_sinusoid(timesteps_BT.flatten(), self.freq_dim)
        temb = self.time_embedder(sinusoid.to(self.time_embedder.linear_1.weight.dtype)).to(dtype)
        modulation = self.time_proj(F.silu(temb))
        return temb.view(B, T, -1), modulation.view(B, T, 6, -1)


class WanDiT(nn.Module):
    """The Wan video DiT; see the module docstring.

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: WanDiTConfig) -> None:
        super().__init__()
        self.config = config
        dim, patch = config.dim, config.patch_size
        self.rope = WanRotaryEmbedding(config.rope_axes)
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=patch, stride=patch)
        self.condition_embedder = WanConditionEmbedder(config)
        self.blocks = nn.ModuleList([WanBlock(config) for _ in range(config.num_layers)])
        self.norm_out = FP32LayerNorm(dim, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(patch))
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, dim))
        self.layout = WholeSequence()
        self.reset_parameters()

    def set_sequence_layout(self, layout: WholeSequence) -> None:
        """Run the token sequence in ``layout`` from now on (e.g. split over context-parallel ranks)."""
        self.layout = layout
        for block in self.blocks:
            block.attn1.layout = layout

    def reset_parameters(self) -> None:
        """Wan's initialisation of the layers outside the blocks (each block initialises its own): Xavier-uniform
        patch embedding, time projection and image embedder, ``N(0, 0.02)`` text and time embedders, a zero output
        projection (the untrained model predicts 0), output modulation table ``N(0, 1/dim)``; zero biases."""
        _xavier(self.patch_embedding)
        for module in self.condition_embedder.modules():
            if isinstance(module, nn.Linear):
                _xavier(module)
        for embedder in (self.condition_embedder.text_embedder, self.condition_embedder.time_embedder):
            for linear in (embedder.linear_1, embedder.linear_2):
                nn.init.normal_(linear.weight, std=0.02)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)
        nn.init.normal_(self.scale_shift_table, std=self.scale_shift_table.shape[-1] ** -0.5)
        image = self.condition_embedder.image_embedder
        if image is not None and image.pos_embed is not None:
            nn.init.zeros_(image.pos_embed)

    def init_weights(self) -> None:
        """Initialise every parameter (after ``to_empty`` of a model built on the meta device): each module's own
        ``reset_parameters``, the torch layers by the block that owns them."""
        reset_owned_parameters(self.modules())

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, **overrides: Any
    ) -> WanDiT:
        """Load a diffusers ``WanTransformer3DModel`` directory (see :func:`~.wan_hf.load_pretrained`)."""
        from forge_lightning.modules.diffusion.wan_hf import load_pretrained

        return load_pretrained(path, dtype=dtype, **overrides)

    def save_pretrained(self, out_dir: str | os.PathLike[str], **options: Any) -> Path:
        """Write a directory diffusers' ``WanTransformer3DModel.from_pretrained`` loads (see
        :func:`~.wan_hf.save_pretrained` for ``options``)."""
        from forge_lightning.modules.diffusion.wan_hf import save_pretrained

        return save_pretrained(self, out_dir, **options)

    def repeated_blocks(self) -> list[WanBlock]:
        """The transformer blocks in forward order (a parallel plan's ``blocks``)."""
        return list(self.blocks)

    def forward(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        encoder_hidden_states_image: Tensor | None = None,
    ) -> Tensor:
        """Predict for a batch of videos of one size (diffusers' signature).

        Args:
            hidden_states: latents ``[B, C, F, H, W]`` (``F, H, W`` multiples of the patch size).
            timestep: ``[B]``, or ``[B, S]`` per patch token (Wan 2.2 TI2V; ``S = F H W / prod(patch_size)``).
            encoder_hidden_states: text embeddings ``[B, L, text_dim]``.
            encoder_hidden_states_image: image encoder tokens ``[B, N, image_dim]`` (I2V models only).

        Returns:
            ``[B, out_channels, F, H, W]``.
        """
        B = hidden_states.shape[0]
        grid = self._grid(hidden_states.shape[2:])
        x_BSD = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        timesteps_BT = timestep.reshape(B, -1) if timestep.ndim == 2 else timestep.reshape(B, 1)
        if timesteps_BT.shape[1] not in (1, x_BSD.shape[1]):
            raise ValueError(
                f"timestep {list(timestep.shape)} must be [B] or [B, {x_BSD.shape[1]}] (one per patch token)"
            )
        text_BLD = self.condition_embedder.text_embedder(encoder_hidden_states)
        context = CrossContext(text_BLD, self._embed_image(encoder_hidden_states_image))
        rope = self.rope(grid_positions(*grid, device=x_BSD.device))
        temb_BTD, modulation_BT6D = self.condition_embedder.time(timesteps_BT, text_BLD.dtype)
        documents = self.layout.mask(x_BSD, None, self.config.attention_backend)
        out_BSP = self._run_blocks(x_BSD, context, temb_BTD, modulation_BT6D, rope, documents)
        return self._unpatchify(out_BSP, grid)

    def forward_packed(
        self,
        videos: Sequence[Tensor],
        timesteps: Sequence[Tensor],
        texts: Sequence[Tensor],
        images: Sequence[Tensor] | None = None,
    ) -> list[Tensor]:
        """Predict for videos of different sizes run as one packed token sequence.

        Each video attends to itself only (a non-causal document mask), its tokens cross-attend to its own text
        (and image tokens), and RoPE and the timestep modulation are its own. The result equals :meth:`forward` on
        each video alone.

        Args:
            videos: latents ``[C, F_i, H_i, W_i]``.
            timesteps: per video a scalar (or ``[1]``), or ``[S_i]`` per patch token (TI2V).
            texts: text embeddings ``[L_i, text_dim]``.
            images: image encoder tokens ``[N_i, image_dim]`` (I2V models only).

        Returns:
            ``[out_channels, F_i, H_i, W_i]`` per video.
        """
        if not len(videos) == len(timesteps) == len(texts) or (
            images is not None and len(images) != len(videos)
        ):
            raise ValueError(
                f"one timestep, text (and image) per video: got {len(videos)} videos, {len(timesteps)} timesteps, "
                f"{len(texts)} texts" + ("" if images is None else f", {len(images)} images")
            )
        grids = [self._grid(v.shape[1:]) for v in videos]
        tokens = [self.patch_embedding(v[None]).flatten(2).transpose(1, 2) for v in videos]  # [1, S_i, D]
        x_BSD = torch.cat(tokens, dim=1)
        device = x_BSD.device
        lengths = [t.shape[1] for t in tokens]
        video_of_token = _segment_ids(lengths, device)
        timesteps_BT = torch.cat(
            [
                t.reshape(-1).expand(n) if t.numel() == 1 else t.reshape(n)
                for t, n in zip(timesteps, lengths, strict=True)
            ]
        )[None]
        text_BLD = self.condition_embedder.text_embedder(torch.cat(list(texts))[None])
        image_BND, image_mask = None, None
        if images is not None:
            # Embedded video by video: FLF2V's position embedding spans one video's image tokens.
            image_BND = torch.cat([self._embed_image(i[None]) for i in images], dim=1)
            image_mask = _cross_mask(video_of_token, [len(i) for i in images])
        context = CrossContext(
            text_BLD, image_BND, _cross_mask(video_of_token, [len(t) for t in texts]), image_mask
        )
        rope = self.rope(torch.cat([grid_positions(*g, device=device) for g in grids]))
        documents = self.layout.mask(x_BSD, video_of_token[None], self.config.attention_backend)
        temb_BTD, modulation_BT6D = self.condition_embedder.time(timesteps_BT, text_BLD.dtype)
        out_BSP = self._run_blocks(x_BSD, context, temb_BTD, modulation_BT6D, rope, documents)
        return [self._unpatchify(o, g)[0] for o, g in zip(out_BSP.split(lengths, dim=1), grids, strict=True)]

    def _run_blocks(
        self,
        x_BSD: Tensor,
        context: CrossContext,
        temb_BTD: Tensor,
        modulation_BT6D: Tensor,
        rope: tuple[Tensor, Tensor],
        documents: Any,
    ) -> Tensor:
        """The blocks and the head on this rank's part of the tokens (with their RoPE rows, per-token modulation
        and cross-attention mask rows), gathered back to the whole sequence: ``[B, S, out * prod(p)]``."""
        layout, S = self.layout, x_BSD.shape[1]
        x_BsD = layout.split(x_BSD, 1)
        rope = (layout.split(rope[0], 0), layout.split(rope[1], 0))
        if modulation_BT6D.shape[1] > 1:  # per-token timesteps: T = S
            temb_BTD, modulation_BT6D = layout.split(temb_BTD, 1), layout.split(modulation_BT6D, 1)
        if context.text_mask is not None:  # padded rows see every context token (no empty softmax)
            context = replace(
                context,
                text_mask=layout.split(context.text_mask, 2, fill=True),
                image_mask=None
                if context.image_mask is None
                else layout.split(context.image_mask, 2, fill=True),
            )
        for block in self.blocks:
            x_BsD = block(x_BsD, context, modulation_BT6D, rope, documents)
        return layout.gather(self._head(x_BsD, temb_BTD), 1, S)

    def _grid(self, size: Sequence[int]) -> tuple[int, int, int]:
        """Patch counts ``(frames, rows, columns)`` of a latent of ``size`` ``(F, H, W)``."""
        if any(n % p for n, p in zip(size, self.config.patch_size, strict=True)):
            raise ValueError(
                f"latent size (F, H, W) = {tuple(size)} must be a multiple of patch_size {self.config.patch_size}"
            )
        grid = tuple(n // p for n, p in zip(size, self.config.patch_size, strict=True))
        if max(grid) > self.config.rope_max_seq_len:
            raise ValueError(f"patch grid {grid} exceeds rope_max_seq_len ({self.config.rope_max_seq_len})")
        return grid

    def _embed_image(self, image: Tensor | None) -> Tensor | None:
        if image is None:
            return None
        if self.condition_embedder.image_embedder is None:
            raise ValueError(
                "encoder_hidden_states_image given, but this model has no image branch (image_dim)"
            )
        return self.condition_embedder.image_embedder(image)

    def _head(self, x_BSD: Tensor, temb_BTD: Tensor) -> Tensor:
        """The output norm with its shift / scale, and the projection to patch values ``[B, S, out * prod(p)]``."""
        shift, scale = (self.scale_shift_table[None] + temb_BTD[:, :, None]).unbind(2)  # [B, T, D] each
        x_BSD = (self.norm_out(x_BSD.float()) * (1 + scale) + shift).type_as(x_BSD)
        return self.proj_out(x_BSD)

    def _unpatchify(self, out_BSP: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """``[B, f*h*w, prod(p) * C]`` patch values into the latent ``[B, C, f*p_t, h*p_h, w*p_w]``."""
        (f, h, w), (pt, ph, pw) = grid, self.config.patch_size
        x = out_BSP.reshape(out_BSP.shape[0], f, h, w, pt, ph, pw, -1)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C, f, pt, h, ph, w, pw]
        return x.reshape(x.shape[0], x.shape[1], f * pt, h * ph, w * pw)


def _xavier(layer: nn.Linear | nn.Conv3d) -> None:
    """Xavier-uniform weight (a convolution's over its flattened ``[out, in * kernel]`` view), zero bias."""
    nn.init.xavier_uniform_(layer.weight.view(layer.weight.shape[0], -1))
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


def _segment_ids(lengths: Sequence[int], device: torch.device) -> Tensor:
    """``[sum(lengths)]``: the index of the segment each position belongs to."""
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )


def _cross_mask(video_of_token_S: Tensor, context_lengths: Sequence[int]) -> Tensor:
    """``[1, 1, S, L]`` boolean: token ``s`` may attend to context token ``l`` of the same video."""
    video_of_context_L = _segment_ids(context_lengths, video_of_token_S.device)
    return (video_of_token_S[:, None] == video_of_context_L[None, :])[None, None]

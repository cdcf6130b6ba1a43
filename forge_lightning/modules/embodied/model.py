"""Pi0.5 as a plain ``nn.Module``: PaliGemma (SigLIP + Gemma) encodes the observation, a Gemma action expert
turns noise into an action chunk by flow matching (Black et al., 2024; Physical Intelligence, 2025).

::

    images ─ vision ─┐                                 noisy actions x_t, time t
    prompt ─ embed ──┴─ prefix ─ llm ─ (k, v) per layer ─┐         │
                     (bidirectional, padding masked)     └─ action_expert ─ velocity v_t

    training:  x_t = t * noise + (1 - t) * actions, loss = (v_t - (noise - actions))^2, t ~ Beta(1.5, 1)
    inference: x_1 = noise; x_{t+dt} = x_t + dt * v_t for num_steps Euler steps to t = 0 (dt = -1/num_steps),
               the prefix encoded once and its keys / values reused at every step (the KV cache)

The prompt carries the task and the discretised state (see :mod:`forge_lightning.modules.embodied.prompt`).
Positions count valid prefix tokens only (padding repeats the last position); the action tokens continue
after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from forge_lightning.modules.embodied.config import Pi05Config
from forge_lightning.modules.embodied.gemma import ActionExpert, GemmaBackbone, KeyValue
from forge_lightning.modules.embodied.siglip import PaliGemmaVision
from forge_lightning.modules.layers import RotaryEmbedding
from forge_lightning.modules.layers.init import reset_owned_parameters


@dataclass
class Pi05Inputs:
    """One batch of observations as the model consumes them.

    Args:
        images: ``[B, N, 3, size, size]`` preprocessed camera images in ``[-1, 1]`` (N cameras).
        image_mask: ``[B, N]`` True for real images (False: a missing camera, its tokens are padding).
        tokens: ``[B, L]`` prompt token ids.
        token_mask: ``[B, L]`` True for real tokens (False: padding).
    """

    images: Tensor
    image_mask: Tensor
    tokens: Tensor
    token_mask: Tensor


@dataclass
class PrefixCache:
    """The encoded observation: per-layer keys and values of the prefix, reused at every denoising step.

    Args:
        kvs: one ``(keys, values)`` pair per backbone layer, ``[B, num_kv_heads, P, head_dim]`` each.
        pad_mask: ``[B, P]`` True for valid prefix tokens.
    """

    kvs: list[KeyValue]
    pad_mask: Tensor


class Pi05(nn.Module):
    """Pi0.5 vision-language-action model with a flow-matching action expert.

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: Pi05Config) -> None:
        super().__init__()
        self.config = config
        std = config.initializer_range
        self.vision = PaliGemmaVision(config.vision, config.llm.hidden_size, init_std=std)
        self.llm = GemmaBackbone(config.llm, config.vocab_size, init_std=std)
        self.action_expert = ActionExpert(
            config.action_expert,
            config.max_action_dim,
            min_period=config.min_period,
            max_period=config.max_period,
            init_std=std,
        )
        self.rotary = RotaryEmbedding(config.llm.head_dim, config.rope_theta)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter, e.g. after building on the meta device and ``to_empty``."""
        self.vision.init_weights()  # openpi's scheme, not the one the SigLIP tower's parts own
        for component in (self.llm, self.action_expert, self.rotary):
            reset_owned_parameters(component.modules())

    # ----- prefix: observation -> keys and values -----------------------------------------------------------
    def embed_prefix(self, inputs: Pi05Inputs) -> tuple[Tensor, Tensor]:
        """Image tokens then prompt tokens ``[B, P, llm width]`` and their validity mask ``[B, P]``."""
        B, N = inputs.images.shape[:2]
        image_tokens = self.vision(inputs.images.flatten(0, 1))  # [B*N, T, D]
        T = image_tokens.shape[1]
        image_tokens_BND = image_tokens.view(B, N * T, -1)
        image_pad_BN = inputs.image_mask[:, :, None].expand(B, N, T).reshape(B, N * T)
        text = self.llm.embed(inputs.tokens)
        embeddings = torch.cat([image_tokens_BND.to(text.dtype), text], dim=1)
        return embeddings, torch.cat([image_pad_BN, inputs.token_mask.bool()], dim=1)

    def encode_prefix(self, inputs: Pi05Inputs) -> PrefixCache:
        """Run the backbone over the observation; keep each layer's keys and values."""
        embeddings, pad = self.embed_prefix(inputs)
        positions = pad.long().cumsum(-1) - 1
        mask = pad[:, None, None, :]  # every token attends to every valid prefix token
        return PrefixCache(self.llm(embeddings, self.rotary(positions), mask), pad)

    # ----- suffix: noisy actions -> velocity ----------------------------------------------------------------
    def velocity(self, cache: PrefixCache, x_t: Tensor, time: Tensor) -> Tensor:
        """Velocity ``[B, C, max_action_dim]`` of noisy actions ``x_t`` at flow times ``time`` ``[B]``."""
        B, C = x_t.shape[:2]
        start = cache.pad_mask.sum(-1, keepdim=True)  # [B, 1] valid prefix tokens
        positions = start + torch.arange(C, device=x_t.device)[None]
        keys_valid = torch.cat([cache.pad_mask, cache.pad_mask.new_ones(B, C)], dim=1)
        return self.action_expert(x_t, time, self.rotary(positions), keys_valid[:, None, None, :], cache.kvs)

    def forward_loss(self, inputs: Pi05Inputs, actions: Tensor, noise: Tensor, time: Tensor) -> Tensor:
        """Per-element flow-matching loss ``[B, C, max_action_dim]`` (no reduction).

        Args:
            inputs: the observations.
            actions: ``[B, C, max_action_dim]`` normalised, zero-padded target actions.
            noise: ``[B, C, max_action_dim]`` standard normal noise.
            time: ``[B]`` flow times in ``(0, 1]``.
        """
        t_B11 = time[:, None, None]
        x_t = t_B11 * noise + (1 - t_B11) * actions
        target = noise - actions
        v_t = self.velocity(self.encode_prefix(inputs), x_t, time)
        return (v_t - target.float()).square()

    @torch.no_grad()
    def predict_action_chunk(
        self,
        inputs: Pi05Inputs,
        *,
        num_steps: int | None = None,
        noise: Tensor | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Denoise an action chunk ``[B, C, max_action_dim]`` with ``num_steps`` Euler steps from ``t = 1``.

        Args:
            inputs: the observations.
            num_steps: Euler steps (default: ``config.num_inference_steps``).
            noise: the starting noise ``[B, C, max_action_dim]`` (default: drawn from ``N(0, 1)``).
            use_cache: encode the prefix once and reuse its keys / values; ``False`` re-encodes it at every
                step (same result, for checking the cache).
        """
        num_steps = num_steps or self.config.num_inference_steps
        B = inputs.tokens.shape[0]
        if noise is None:
            noise = self.sample_noise(B, device=inputs.tokens.device)
        cache = self.encode_prefix(inputs) if use_cache else None
        dt = -1.0 / num_steps
        x_t = noise.float()
        for step in range(num_steps):
            time = torch.full((B,), 1.0 + step * dt, dtype=torch.float32, device=x_t.device)
            v_t = self.velocity(cache if use_cache else self.encode_prefix(inputs), x_t, time)
            x_t = x_t + dt * v_t
        return x_t

    # ----- flow-matching randomness --------------------------------------------------------------------------
    def sample_noise(self, batch_size: int, *, device: torch.device | str | None = None) -> Tensor:
        """Standard normal ``[B, chunk_size, max_action_dim]`` fp32 noise."""
        c = self.config
        return torch.randn(batch_size, c.chunk_size, c.max_action_dim, device=device, dtype=torch.float32)

    def sample_time(self, batch_size: int, *, device: torch.device | str | None = None) -> Tensor:
        """Training flow times ``Beta(alpha, beta) * time_scale + time_offset`` ``[B]`` (fp32)."""
        c = self.config
        # Drawn on a CUDA device directly: a copy from pageable host memory would make the host wait for the
        # device at every step. Elsewhere on the CPU (MPS has no Beta sampler). Explicit fp32: under a bf16
        # default dtype (`bf16-true`) the sampler has no kernel.
        where = torch.device(device) if device is not None else torch.device("cpu")
        on = where if where.type == "cuda" else torch.device("cpu")
        alpha = torch.tensor(c.time_beta_alpha, dtype=torch.float32, device=on)
        beta = torch.distributions.Beta(alpha, torch.tensor(c.time_beta_beta, dtype=torch.float32, device=on))
        return (beta.sample((batch_size,)) * c.time_scale + c.time_offset).to(where)

    def unused_parameters(self) -> list[nn.Parameter]:
        """Parameters no output depends on (see :meth:`GemmaBackbone.unused_parameters`)."""
        return self.llm.unused_parameters()

"""Autoregressive decoding with the KV cache: one prefill forward, then one forward per new token."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from forge_lightning.modules.layers.attention import KVCache
from forge_lightning.modules.llm.model import DecoderLM

Prefill = Callable[[list[KVCache]], Tensor]
"""Runs the prompt into the empty caches and returns its final hidden states ``[B, S, hidden]``."""


@torch.no_grad()
def generate(
    model: DecoderLM,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    prefill: Prefill | None = None,
    position_deltas: Tensor | None = None,
) -> Tensor:
    """Continue ``input_ids`` by up to ``max_new_tokens`` tokens (greedy when ``temperature == 0``).

    The model runs in eval mode (its previous mode is restored). Every row of the batch shares the prompt
    length (no padding). A row that emits an end-of-sequence token is filled with ``eos`` afterwards; decoding
    stops early once every row has finished.

    Args:
        model: the decoder LM.
        input_ids: prompt token ids ``[B, S]``.
        max_new_tokens: most tokens to append.
        temperature: softmax temperature; ``0`` picks the argmax.
        top_k: sample only among the ``k`` most likely tokens.
        top_p: sample only from the smallest set of tokens whose probability reaches ``top_p`` (nucleus).
        eos_token_id: token id(s) that end a sequence.
        generator: random generator for sampling (on the model's device), for reproducible draws.
        prefill: runs the prompt instead of ``model.hidden_states(input_ids)`` (a vision-language model puts image
            features into the prompt's embeddings); ``input_ids`` is still the prompt returned.
        position_deltas: ``[B, 1]`` added to each new token's position (the cached length): the rope deltas of a
            prompt whose multimodal positions advance slower than its tokens.

    Returns:
        ``[B, S + n]`` token ids, the prompt followed by ``n <= max_new_tokens`` new tokens.
    """
    _check_sampling_args(max_new_tokens, temperature, top_k, top_p)
    if max_new_tokens == 0:
        return input_ids
    was_training = model.training
    model.eval()
    try:
        return _decode(
            model,
            input_ids,
            max_new_tokens,
            (temperature, top_k, top_p, generator),
            eos_token_id,
            prefill,
            position_deltas,
        )
    finally:
        model.train(was_training)


def _decode(
    model: DecoderLM,
    input_ids: Tensor,
    max_new_tokens: int,
    sampling: tuple[float, int | None, float | None, torch.Generator | None],
    eos_token_id: int | Sequence[int] | None,
    prefill: Prefill | None,
    position_deltas: Tensor | None,
) -> Tensor:
    batch_size, prompt_len = input_ids.shape
    kv_cache = model.init_kv_cache(batch_size, prompt_len + max_new_tokens, device=input_ids.device)
    eos = None if eos_token_id is None else torch.tensor(eos_token_id, device=input_ids.device).flatten()
    finished = torch.zeros(batch_size, dtype=torch.bool, device=input_ids.device)
    tokens, step_ids = [input_ids], input_ids
    for step in range(max_new_tokens):
        # Only the last position's logits are needed: project that hidden state alone.
        if step == 0 and prefill is not None:
            hidden_BD = prefill(kv_cache)[:, -1]
        else:
            positions = None
            if position_deltas is not None:
                positions = kv_cache[0].length + torch.arange(step_ids.shape[1], device=step_ids.device)
                positions = positions[None] + position_deltas.to(step_ids.device)  # [B, S]
            hidden_BD = model.hidden_states(step_ids, positions, kv_cache=kv_cache)[:, -1]
        next_B = sample_next_token(model.lm_head(hidden_BD).float(), *sampling)
        if eos is not None:
            next_B = torch.where(finished, eos[0], next_B)
            finished |= torch.isin(next_B, eos)
        step_ids = next_B[:, None]  # [B, 1]
        tokens.append(step_ids)
        if eos is not None and bool(finished.all()):
            break
    return torch.cat(tokens, dim=1)


def sample_next_token(
    logits_BV: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick one token per row from ``[B, V]`` logits: argmax at temperature 0, else a filtered sample.

    Args:
        logits_BV: next-token logits.
        temperature: softmax temperature; ``0`` is greedy.
        top_k: keep only the ``k`` largest logits before sampling.
        top_p: keep the smallest set of tokens whose cumulative probability reaches ``top_p``.
        generator: random generator for :func:`torch.multinomial`.

    Returns:
        ``[B]`` token ids.
    """
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_BV = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_BV, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first one is always kept).
        drop_BV = probs_BV.cumsum(dim=-1) - probs_BV >= top_p
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    probs_BV = logits_BV.softmax(dim=-1)
    return torch.multinomial(probs_BV, num_samples=1, generator=generator).squeeze(-1)


def _check_sampling_args(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be non-negative")
    if temperature < 0:
        raise ValueError(f"temperature ({temperature}) must be non-negative")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError(f"top_k ({top_k}) and top_p ({top_p}) only apply when sampling (temperature > 0)")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k ({top_k}) must be positive")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p ({top_p}) must be in (0, 1]")

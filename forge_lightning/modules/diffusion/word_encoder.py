"""A tiny random UMT5 text encoder with a word-level tokenizer, written in the Wan checkpoint layout: for the quick
start and tests, where prompts come from a small vocabulary and need distinct embeddings, not a language model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<pad>", "<unk>", "</s>")


def write_word_text_encoder(
    root: str | Path,
    words: Sequence[str],
    *,
    width: int = 16,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> Path:
    """Write ``root/tokenizer`` (one token per word, whitespace-split, after ``<pad> <unk> </s>``) and
    ``root/text_encoder`` (a random ``UMT5EncoderModel``), loadable by :meth:`WanTextEncoder.from_pretrained`.

    Args:
        root: the checkpoint root.
        words: the vocabulary (duplicates and special tokens are dropped).
        width: the encoder's ``d_model`` (the DiT's ``text_dim``).
        num_layers: encoder layers.
        num_heads: attention heads (``width`` must be a multiple).
        seed: seeds the random weights (the global RNG is left as it was).

    Returns:
        ``root``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    if width % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide width ({width})")
    vocabulary = list(dict.fromkeys([*SPECIAL_TOKENS, *words]))
    root = Path(root)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    ).save_pretrained(root / "tokenizer")
    config = UMT5Config(
        vocab_size=len(vocabulary),
        d_model=width,
        d_kv=width // num_heads,
        d_ff=2 * width,
        num_layers=num_layers,
        num_heads=num_heads,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        UMT5EncoderModel(config).save_pretrained(root / "text_encoder")
    return root

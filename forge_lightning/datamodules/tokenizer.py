"""Tokenizers for data preparation: load any local Hugging Face tokenizer, or train a byte-level BPE one.

Both paths give a :class:`TextTokenizer`, the small interface the data tools need (``encode``,
``encode_batch``, ``decode``, ``vocab_size``, ``eos_token_id``). Encoding never adds special tokens:
pre-training data appends the end-of-document token itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ENDOFTEXT = "<|endoftext|>"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# Tried, in order, when a bare tokenizer.json carries no configuration naming its end-of-text token.
_EOS_CANDIDATES = (ENDOFTEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class TokenizerError(ValueError):
    """Tokenizer files that exist but cannot be loaded."""


class TextTokenizer:
    """A tokenizer as the data tools see it: text in, token ids out, no special tokens added.

    Wraps either a ``transformers`` tokenizer or a bare ``tokenizers.Tokenizer``; build one with
    :func:`load_tokenizer`. Picklable (both wrapped kinds are), so it can be sent to worker processes.

    Args:
        backend: A ``transformers`` tokenizer (``PreTrainedTokenizerBase``) or a ``tokenizers.Tokenizer``.
        eos_token_id: End-of-text id; read from a ``transformers`` tokenizer when not given.
        name: Where the tokenizer came from, for messages.
    """

    def __init__(self, backend: Any, *, eos_token_id: int | None = None, name: str = "") -> None:
        self.backend = backend
        self.name = name
        self._is_transformers = hasattr(backend, "convert_tokens_to_ids")
        if eos_token_id is None and self._is_transformers:
            eos_token_id = backend.eos_token_id
        self.eos_token_id: int | None = eos_token_id
        self._rust = backend if not self._is_transformers else getattr(backend, "backend_tokenizer", None)
        if self._rust is not None and self._is_transformers:
            # transformers sets this flag on its backend before every call; mirror it once.
            self._rust.encode_special_tokens = bool(getattr(backend, "split_special_tokens", False))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        if self._is_transformers:
            return len(self.backend)
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text`` (no special tokens added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Return the token ids of each text (no special tokens added)."""
        # A transformers fast tokenizer encodes through this very backend call; calling it directly skips
        # the per-call BatchEncoding bookkeeping, which dominates on short documents.
        if self._rust is not None:
            return [encoding.ids for encoding in self._rust.encode_batch(texts, add_special_tokens=False)]
        return self.backend(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of ``ids``."""
        return self.backend.decode(list(ids))

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer files to ``directory`` (e.g. next to an exported model)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self._is_transformers:
            self.backend.save_pretrained(directory)
        else:
            self.backend.save(str(directory / "tokenizer.json"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, eos={self.eos_token_id})"


def load_tokenizer(path: str | os.PathLike) -> TextTokenizer:
    """Load a Hugging Face tokenizer from a local directory (nothing is downloaded).

    Tries ``transformers.AutoTokenizer`` first (so ``tokenizer_config.json`` settings apply), then falls
    back to the directory's bare ``tokenizer.json`` through the ``tokenizers`` library.

    Args:
        path: A directory holding ``tokenizer.json`` and/or ``tokenizer_config.json`` (+ vocabulary files).

    Returns:
        The loaded :class:`TextTokenizer`.

    Raises:
        FileNotFoundError: If the directory does not exist or holds no tokenizer files.
        TokenizerError: If the files exist but neither library can load them.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} not found")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{directory} holds no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)}); "
            "train one with `forge-data train-tokenizer` or point to a Hugging Face model directory"
        )
    try:
        from transformers import AutoTokenizer

        backend = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        eos_token_id = backend.eos_token_id
        if eos_token_id is None:
            eos_token_id = _find_eos_id(directory, backend.get_vocab().get)
        return TextTokenizer(backend, eos_token_id=eos_token_id, name=str(directory))
    except Exception as transformers_error:
        tokenizer_json = directory / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise TokenizerError(f"cannot load the tokenizer in {directory}: {transformers_error}") from None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_json))
    eos_token_id = _find_eos_id(directory, backend.token_to_id)
    return TextTokenizer(backend, eos_token_id=eos_token_id, name=str(directory))


def _find_eos_id(directory: Path, token_to_id: Callable[[str], int | None]) -> int | None:
    """Find the end-of-text id of a tokenizer whose configuration does not name one."""
    candidates = list(_EOS_CANDIDATES)
    config_path = directory / "tokenizer_config.json"
    try:
        eos = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        eos = None  # no usable configuration: fall back to the usual names
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str):
        candidates.insert(0, eos)
    for token in candidates:
        token_id = token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def train_bpe_tokenizer(
    files_or_texts: Iterable[str | os.PathLike],
    vocab_size: int,
    output_dir: str | os.PathLike,
    *,
    min_frequency: int = 2,
) -> TextTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style) and save it as a Hugging Face tokenizer directory.

    The vocabulary starts from the 256 byte symbols, so any text encodes without unknown tokens, and
    holds one special token, ``<|endoftext|>``, used as end-of-document, BOS, padding and unknown token.
    The directory (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``) loads with
    ``transformers.AutoTokenizer.from_pretrained(output_dir)`` and with :func:`load_tokenizer`.

    Args:
        files_or_texts: Training data. ``os.PathLike`` items (e.g. ``pathlib.Path``) are files read as
            UTF-8 text; ``str`` items are the training texts themselves.
        vocab_size: Target vocabulary size, special token and byte alphabet included (at least 257).
        output_dir: Directory to write; created if missing, files in it overwritten.
        min_frequency: A pair must occur at least this often to be merged.

    Returns:
        The trained tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size ({vocab_size}) must be at least {len(alphabet) + 1} for byte-level BPE")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_iter_training_texts(files_or_texts), trainer=trainer)
    _save_tokenizer_dir(tokenizer, Path(output_dir))
    return TextTokenizer(tokenizer, eos_token_id=tokenizer.token_to_id(ENDOFTEXT), name=str(output_dir))


def add_special_tokens(tokenizer_dir: str | os.PathLike, tokens: Iterable[str]) -> None:
    """Add ``tokens`` to the ``tokenizer.json`` in ``tokenizer_dir`` as special tokens (never split, never
    normalised), e.g. a vision-language model's image placeholders; tokens it already has keep their ids."""
    from tokenizers import AddedToken, Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir}")
    backend = Tokenizer.from_file(str(path))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    backend.save(str(path))


def _iter_training_texts(files_or_texts: Iterable[str | os.PathLike]) -> Iterator[str]:
    for item in files_or_texts:
        if isinstance(item, str):
            yield item
        else:
            yield Path(item).read_text(encoding="utf-8")


def _save_tokenizer_dir(tokenizer: Any, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    special_tokens = {name: ENDOFTEXT for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens,
        "add_bos_token": False,
        "add_eos_token": False,
        # Decoding must give the text back exactly (code included), without space clean-up heuristics.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special_tokens)):
        (directory / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")

"""Shared fixtures of the fine-tuning tests: a small chat tokenizer and chat files in each format."""

import json
from pathlib import Path

import pytest
from tiny import TINY_LLM

from forge_lightning.datamodules.chat import add_chat_template
from forge_lightning.datamodules.tokenizer import load_tokenizer, train_bpe_tokenizer

TINY = TINY_LLM  # the shared tiny Llama config (tests/tiny.py)

_WORDS = (
    "the user asks a question and the assistant answers it with a short reply about weather, numbers, "
    "kilometers, meters, grams, tools and functions; hello there, how are you, fine thanks, goodbye. "
)


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer with the ChatML and Llama 3 special tokens; its own template is ChatML."""
    directory = tmp_path_factory.mktemp("chat_tokenizer")
    train_bpe_tokenizer([_WORDS * 4] * 8, 400, directory)
    add_chat_template(directory, "llama3", eos_is_stop=False)
    add_chat_template(directory, "chatml")
    return directory


@pytest.fixture(scope="session")
def chat_tokenizer(chat_tokenizer_dir):
    return load_tokenizer(chat_tokenizer_dir).backend


@pytest.fixture
def tiny_config() -> dict:
    """A tiny Llama config (HF form) whose vocabulary covers the chat tokenizer."""
    return dict(TINY)


@pytest.fixture
def write_jsonl(tmp_path):
    """``write_jsonl(name, records)``: a JSONL file of records (strings are written as raw lines)."""

    def write(name: str, records: list) -> Path:
        path = tmp_path / name
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
        return path

    return write

"""Byte-level BPE training and loading: round trips, Hugging Face compatibility, clear errors."""

import json
import pickle

import pytest
from transformers import AutoTokenizer

from forge_lightning.datamodules.tokenizer import ENDOFTEXT, load_tokenizer, train_bpe_tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "for i in range(10):\n\tprint(i ** 2)  # squares\n",
    "Ünïcödé text — with emoji 🙂 and 中文 characters.\n",
] * 4
UNSEEN = ["import numpy as np\n\n\nx = np.zeros((3, 4))  # résumé ✓\r\n", "  leading spaces\nand\ttabs  ", ""]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok") / "bpe"
    tokenizer = train_bpe_tokenizer(TEXTS, 320, directory)
    return directory, tokenizer


def test_training_writes_a_hugging_face_directory(trained):
    directory, tokenizer = trained
    assert sorted(p.name for p in directory.iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((directory / "special_tokens_map.json").read_text())["eos_token"] == ENDOFTEXT
    assert tokenizer.vocab_size == 320
    assert tokenizer.eos_token_id == 0


@pytest.mark.parametrize("text", TEXTS[:5] + UNSEEN)
def test_round_trip_and_agreement_with_auto_tokenizer(trained, text):
    directory, trained_tokenizer = trained
    loaded = load_tokenizer(directory)
    hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = loaded.encode(text)
    assert ids == trained_tokenizer.encode(text) == hf.encode(text, add_special_tokens=False)
    assert loaded.decode(ids) == text
    assert hf.decode(ids) == text
    assert all(0 <= i < loaded.vocab_size for i in ids)


def test_loaded_tokenizer_properties(trained):
    directory, _ = trained
    loaded = load_tokenizer(directory)
    hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert loaded.vocab_size == len(hf) == 320
    assert loaded.eos_token_id == hf.eos_token_id == hf.convert_tokens_to_ids(ENDOFTEXT)
    assert loaded.encode("a" + ENDOFTEXT) == [*loaded.encode("a"), loaded.eos_token_id]
    assert loaded.encode_batch(TEXTS[:3]) == [loaded.encode(t) for t in TEXTS[:3]]
    restored = pickle.loads(pickle.dumps(loaded))
    assert restored.encode(TEXTS[1]) == loaded.encode(TEXTS[1])


def test_training_merges_frequent_pairs(trained):
    _, tokenizer = trained
    assert len(tokenizer.encode(TEXTS[2])) < len(TEXTS[2].encode("utf-8")) / 2


def test_bare_tokenizer_json_loads_with_end_of_text_found(trained, tmp_path):
    directory, trained_tokenizer = trained
    (tmp_path / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_token_id == trained_tokenizer.eos_token_id
    assert loaded.encode(UNSEEN[0]) == trained_tokenizer.encode(UNSEEN[0])
    assert loaded.decode(loaded.encode(UNSEEN[0])) == UNSEEN[0]


def test_falls_back_to_tokenizers_when_transformers_cannot_load(trained, tmp_path):
    directory, trained_tokenizer = trained
    (tmp_path / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    loaded = load_tokenizer(tmp_path)
    assert type(loaded.backend).__module__.startswith("tokenizers")
    assert loaded.vocab_size == 320 and loaded.eos_token_id == trained_tokenizer.eos_token_id
    assert loaded.encode(UNSEEN[0]) == trained_tokenizer.encode(UNSEEN[0])
    assert loaded.decode(loaded.encode(UNSEEN[0])) == UNSEEN[0]


def test_files_train_like_texts(trained, tmp_path):
    files = []
    for k, text in enumerate(TEXTS):
        files.append(tmp_path / f"{k}.txt")
        files[-1].write_text(text, encoding="utf-8")
    from_files = train_bpe_tokenizer(files, 320, tmp_path / "from_files")
    assert from_files.encode(UNSEEN[0]) == trained[1].encode(UNSEEN[0])


def test_save_pretrained_copies_a_loadable_tokenizer(trained, tmp_path):
    load_tokenizer(trained[0]).save_pretrained(tmp_path / "export")
    assert load_tokenizer(tmp_path / "export").encode(TEXTS[0]) == trained[1].encode(TEXTS[0])


def test_errors_name_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer directory .*nowhere not found"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty holds no tokenizer files .*train-tokenizer"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(ValueError, match="must be at least 257"):
        train_bpe_tokenizer(TEXTS, 100, tmp_path / "small")

"""`forge-data`: pretrain / train-tokenizer / quickstart end to end on small real corpora."""

import json
import operator
import os
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from forge_lightning.datamodules.corpus import collect_stdlib_corpus
from forge_lightning.datamodules.indexed import IndexedDataset
from forge_lightning.tools import data as forge_data
from forge_lightning.tools.data import main

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns that Transformer Engine / Apex are absent on CPU
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset


def forge(*args):
    """Run ``forge-data`` with ``args`` (paths and numbers are turned into strings)."""
    return main([str(arg) for arg in args])


def _stdlib_snippets(count):
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]
    return [f.read_text(encoding="utf-8")[:1500] for f in files]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """jsonl + txt + a directory tree of both, and a BPE tokenizer trained on them with the CLI."""
    root = tmp_path_factory.mktemp("forge_data")
    snippets = _stdlib_snippets(40)
    jsonl = root / "docs.jsonl"
    records = [json.dumps({"text": s, "id": k}) for k, s in enumerate(snippets[:30])]
    jsonl.write_text("\n".join(records) + "\n\n")
    txt = root / "notes.txt"
    txt.write_text("First line of notes.\n\nSecond line — ünïcode 🙂\nthird\n", encoding="utf-8")
    tree = root / "tree"
    (tree / "b").mkdir(parents=True)
    (tree / "a").mkdir()
    (tree / "b" / "y.txt").write_text(snippets[30], encoding="utf-8")
    (tree / "a" / "x.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in snippets[31:]))
    (tree / "README.md").write_text("not an input")
    tokenizer = root / "tokenizer"
    forge("train-tokenizer", "--input", jsonl, txt, "--vocab-size", 400, "--output", tokenizer)
    return {"jsonl": jsonl, "txt": txt, "tree": tree, "tokenizer": tokenizer, "snippets": snippets}


def _expected_documents(corpus):
    """The documents of inputs [jsonl, txt, tree] in the order pretrain must write them."""
    snippets = corpus["snippets"]
    return [*snippets[:30], corpus["txt"].read_text(encoding="utf-8"), *snippets[31:], snippets[30]]


def _pretrain(corpus, prefix, *extra):
    inputs = ["--input", corpus["jsonl"], corpus["txt"], corpus["tree"], "--tokenizer", corpus["tokenizer"]]
    assert forge("pretrain", *inputs, "--output-prefix", prefix, *extra) == 0


def test_pretrain_equals_direct_tokenization_and_workers_agree(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(forge_data, "_CHUNK_DOCUMENTS", 3)  # many chunks, so worker ordering matters
    _pretrain(corpus, tmp_path / "one", "--workers", "1")
    _pretrain(corpus, tmp_path / "two", "--workers", "2")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()

    hf = AutoTokenizer.from_pretrained(corpus["tokenizer"], local_files_only=True)
    texts = _expected_documents(corpus)
    expected = [hf.encode(text, add_special_tokens=False) + [hf.eos_token_id] for text in texts]
    ours, megatron = IndexedDataset(tmp_path / "two"), MegatronIndexedDataset(str(tmp_path / "two"))
    assert ours.dtype == np.uint16
    assert len(ours) == len(megatron) == len(expected)
    for k, ids in enumerate(expected):
        assert ours[k].tolist() == megatron[k].tolist() == ids
    summary = capsys.readouterr().out
    assert f"{len(expected)} documents, {ours.num_tokens:,} tokens (uint16)" in summary
    assert "tokens/s" in summary


def test_split_lines_json_key_and_no_eod(corpus, tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("alpha beta\n\n  \ngamma\r\ndelta", encoding="utf-8")
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"content": "def f(): pass"}) + "\n")
    args = ["--input", lines, records, "--tokenizer", corpus["tokenizer"], "--split-lines"]
    forge("pretrain", *args, "--output-prefix", tmp_path / "out", "--json-key", "content", "--no-append-eod")
    hf = AutoTokenizer.from_pretrained(corpus["tokenizer"], local_files_only=True)
    data = IndexedDataset(tmp_path / "out")
    texts = ["alpha beta", "gamma", "delta", "def f(): pass"]
    expected = [hf.encode(text, add_special_tokens=False) for text in texts]
    assert [data[k].tolist() for k in range(len(data))] == expected


def test_malformed_json_names_file_and_line_and_writes_nothing(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": "broken"\n')
    args = ["pretrain", "--input", bad, "--tokenizer", corpus["tokenizer"], "--output-prefix", tmp_path / "o"]
    with pytest.raises(SystemExit, match=r"bad\.jsonl:3: malformed JSON"):
        forge(*args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl:2: missing key 'text' \(found \['body'\]\)"):
        forge(*args, "--workers", 2)
    bad.write_text('{"text": 3}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl:1: 'text' is a int, not a string"):
        forge(*args)


def test_missing_and_unsupported_inputs(corpus, tmp_path):
    base = ["pretrain", "--tokenizer", corpus["tokenizer"], "--output-prefix", tmp_path / "out"]
    with pytest.raises(SystemExit, match=r"input .*missing\.jsonl not found"):
        forge(*base, "--input", tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(SystemExit, match=r"data\.csv: unsupported file type"):
        forge(*base, "--input", tmp_path / "data.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"empty holds no \.jsonl or \.txt files"):
        forge(*base, "--input", tmp_path / "empty")
    with pytest.raises(SystemExit, match="holds no tokenizer files"):
        forge("pretrain", "--input", corpus["txt"], "--tokenizer", tmp_path, "--output-prefix", "x")


def _word_level_tokenizer(directory, size):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size - 2)} | {"[UNK]": size - 2, "<|endoftext|>": size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "unk_token": "[UNK]"}))


def test_large_vocabulary_switches_to_int32(tmp_path, capsys):
    _word_level_tokenizer(tmp_path / "big", 70_000)
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "w69000 w1 w65536 zzz"}) + "\n")
    args = ["--input", tmp_path / "docs.jsonl", "--tokenizer", tmp_path / "big"]
    forge("pretrain", *args, "--output-prefix", tmp_path / "out", "--workers", 1)
    assert "exceeds uint16: writing int32" in capsys.readouterr().out
    megatron = MegatronIndexedDataset(str(tmp_path / "out"))
    assert megatron.index.dtype == np.int32
    expected = [69000, 1, 65536, 69998, 69999]  # zzz is unknown (69998), then end-of-text (69999)
    assert megatron[0].tolist() == IndexedDataset(tmp_path / "out")[0].tolist() == expected


def test_quickstart_builds_once_and_is_idempotent(tmp_path, capsys):
    output = tmp_path / "quickstart"
    args = ["quickstart", "--output", output, "--max-bytes", 150_000, "--vocab-size", 512, "--workers", 2]
    forge(*args)
    record = json.loads((output / "quickstart.json").read_text())
    data = IndexedDataset(output / "stdlib_text_document")
    corpus = collect_stdlib_corpus(max_bytes=150_000)
    assert record["documents"] == len(data) == len(corpus)
    assert record["tokens"] == data.num_tokens
    assert 0 < record["corpus_bytes"] <= 150_000
    hf = AutoTokenizer.from_pretrained(output / "tokenizer", local_files_only=True)
    assert len(hf) == 512
    assert data[0][-1] == hf.eos_token_id
    assert hf.decode(data[0][:-1].tolist()) == corpus[0][1]
    assert "quick-start data ready" in capsys.readouterr().out

    written = (output / "stdlib_text_document.bin").stat().st_mtime_ns
    forge(*args)
    assert "up to date" in capsys.readouterr().out
    assert (output / "stdlib_text_document.bin").stat().st_mtime_ns == written
    forge(*args, "--force")
    assert "quick-start data ready" in capsys.readouterr().out
    assert (output / "stdlib_text_document.bin").stat().st_mtime_ns != written


def test_corpus_is_deterministic_sorted_and_capped():
    small = collect_stdlib_corpus(max_bytes=100_000)
    assert small == collect_stdlib_corpus(max_bytes=100_000)
    paths = [path for path, _ in small]
    assert paths == sorted(paths)
    assert sum(len(text.encode()) for _, text in small) <= 100_000
    assert not any(part in {"site-packages", "test", "tests"} for p in paths for part in p.split("/")[:-1])
    assert len({p.split("/")[0] for p in paths}) > 5  # spread over the library, not its alphabetical head


def test_tokenizer_workers_are_not_forked_from_the_caller(corpus):
    """Workers forked from a caller with threads can wait forever on a lock one of them held at the fork (a test
    runner's or progress bar's thread): they come from a fork server instead, whose parent is not this process."""
    initargs = (str(corpus["tokenizer"]), None)
    with forge_data._ordered_pool(operator.call, workers=2, initargs=initargs) as run:
        parents = {parent for _, parent in run([(os.getppid,)] * 4)}
    assert os.getpid() not in parents


def test_a_dead_tokenizer_worker_is_an_error_not_a_hang(corpus):
    initargs = (str(corpus["tokenizer"]), None)
    died = pytest.raises(forge_data.DataError, match="tokenizer worker process died.*fewer --workers")
    with died, forge_data._ordered_pool(os._exit, workers=2, initargs=initargs) as run:
        list(run([(3,)] * 4))

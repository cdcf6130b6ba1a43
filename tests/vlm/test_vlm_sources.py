"""Vision-language records from WebDataset shards and from an Energon-prepared dataset (the real ``energon
prepare`` CLI): the same batches as the records with their images on disk, bad samples named ``shard.tar:key`` and
skipped or refused, images read back from the shards in DataLoader workers, and the missing-extra message."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny import write_vlm_tokenizer

from forge_lightning.datamodules.vlm import BadSampleError, VLMDataModule

wds = pytest.importorskip("webdataset")

LIMITS = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}


def _image(width: int, height: int, seed: int, suffix: str) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG" if suffix == "jpg" else "PNG", quality=90)
    return out.getvalue()


def _llava(refs: list[str], answer: str = "red") -> dict:
    turns = [
        {"from": "human", "value": "<image>" * len(refs) + "\nWhat colour?"},
        {"from": "gpt", "value": answer},
    ]
    return {"image": refs, "conversations": turns}


def _openai(ref: str) -> dict:
    content = [{"type": "image", "image": ref}, {"type": "text", "text": "describe the image"}]
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a small shape"}]
    }


IMAGES = {"0.png": _image(60, 45, 0, "png"), "1.jpg": _image(100, 30, 1, "jpg")}
GOOD = {  # key -> (record, member names)
    "good_two": (_llava(["0.png", "1.jpg"]), ["0.png", "1.jpg"]),
    "good_parts": (_openai("1.jpg"), ["1.jpg"]),
    "good_text": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "two"}]},
        [],
    ),
}
BAD = {  # key -> (reason, record or raw json bytes, members)
    "bad_missing": ("missing image", _llava(["0.png", "2.png"]), ["0.png"]),
    "bad_corrupt": ("corrupt image", _llava(["0.png"]), ["corrupt"]),
    "bad_count": (
        "image count mismatch",
        _llava(["0.png"]) | {"image": ["0.png", "1.jpg"]},
        ["0.png", "1.jpg"],
    ),
    "bad_long": ("too long", _llava(["0.png"], " ".join(["the triangle is red"] * 200)), ["0.png"]),
    "bad_json": ("malformed record", b'{"image": ["0.png"], "conversations": [', ["0.png"]),
    "bad_nojson": ("malformed record", None, ["0.png"]),
}


def _sample(key: str, record, members: list[str]) -> dict:
    sample = {"__key__": key}
    if record is not None:
        sample["json"] = record if isinstance(record, bytes) else json.dumps(record).encode()
    for name in members:
        sample["0.png" if name == "corrupt" else name] = (
            b"\x89PNG\r\n\x1a\n" + b"garbage" * 9 if name == "corrupt" else IMAGES[name]
        )
    return sample


def _write_shards(directory: Path, with_bad: bool = True) -> Path:
    """Two shards: the good samples spread over both, the bad ones in the second."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = list(GOOD)
    with wds.TarWriter(str(directory / "part-0.tar")) as writer:
        for key in keys[:2]:
            writer.write(_sample(key, *GOOD[key]))
    with wds.TarWriter(str(directory / "part-1.tar")) as writer:
        writer.write(_sample(keys[2], *GOOD[keys[2]]))
        for key, (_, record, members) in BAD.items() if with_bad else ():
            writer.write(_sample(key, record, members))
    return directory


def _local_copy(directory: Path) -> Path:
    """The good records as a JSONL file with their images on disk under the same names."""
    lines = []
    for key, (record, members) in GOOD.items():
        (directory / key).mkdir(parents=True)
        for name in members:
            (directory / key / name).write_bytes(IMAGES[name])
        text = json.dumps(record)
        for name in members:
            text = text.replace(f'"{name}"', f'"{key}/{name}"')
        lines.append(text + "\n")
    (directory / "local.jsonl").write_text("".join(lines))
    return directory / "local.jsonl"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vlm_tokenizer(tmp_path_factory.mktemp("vlm_tokenizer"))


def _fit(tokenizer_dir: Path, train, **options) -> VLMDataModule:
    options = {"num_workers": 0, "pin_memory": False, "batch_size": 3, "seq_length": 256, **LIMITS, **options}
    datamodule = VLMDataModule(train, str(tokenizer_dir), **options)
    datamodule.setup("fit")
    return datamodule


def _batch(datamodule: VLMDataModule) -> dict[str, torch.Tensor]:
    dataset = datamodule.train_dataset
    return datamodule.collate_fn([dataset[i] for i in range(len(dataset))])


def _assert_same_batch(batch: dict, expected: dict) -> None:
    assert sorted(batch) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(batch[key], value), key


def test_webdataset_shards_give_the_batches_of_local_files_and_name_bad_samples(
    tokenizer_dir, tmp_path, caplog
):
    shards = _write_shards(tmp_path / "shards")
    expected = _batch(_fit(tokenizer_dir, str(_local_copy(tmp_path / "local"))))
    caplog.set_level("INFO")
    datamodule = _fit(tokenizer_dir, str(shards / "part-{0..1}.tar"))
    report = datamodule.reports["train"]
    assert (report.records, report.kept, report.images) == (len(GOOD) + len(BAD), len(GOOD), 3)
    assert {reason: len(names) for reason, names in report.skipped.items()} == {
        "missing image": 1,
        "corrupt image": 1,
        "image count mismatch": 1,
        "too long": 1,
        "malformed record": 2,
    }
    for key, (reason, _, _) in BAD.items():
        assert any(m.startswith(f"part-1.tar:{key}: ") for m in report.skipped[reason]), key
    assert any(
        "2.png is not a member of the sample (its members: 0.png, json)" in m
        for m in report.skipped["missing image"]
    )
    assert any("the sample has no json member" in m for m in report.skipped["malformed record"])
    assert f"{len(GOOD)} of {len(GOOD) + len(BAD)} samples kept" in caplog.text
    assert [s.source for s in datamodule.train_dataset.samples] == [
        "part-0.tar:good_two",
        "part-0.tar:good_parts",
        "part-1.tar:good_text",
    ]
    _assert_same_batch(_batch(datamodule), expected)
    # Kept images hold no bytes: a loader worker (forked here) reads them back from the shard.
    assert all(i.data is None for s in datamodule.train_dataset.samples for i in s.images)
    pickle.loads(pickle.dumps(datamodule.train_dataset))
    loader = torch.utils.data.DataLoader(
        datamodule.train_dataset, batch_size=3, num_workers=1, collate_fn=datamodule.collate_fn
    )
    _assert_same_batch(next(iter(loader)), expected)


@pytest.mark.parametrize("key", ["bad_missing", "bad_long"])
def test_bad_shard_samples_raise_under_error(tokenizer_dir, tmp_path, key):
    shards = _write_shards(tmp_path / "shards", with_bad=False)
    with wds.TarWriter(str(shards / "part-2.tar")) as writer:
        writer.write(_sample(key, *BAD[key][1:]))
    with pytest.raises(BadSampleError, match=rf"^part-2\.tar:{key}: ") as error:
        _fit(
            tokenizer_dir,
            [str(shards / "part-{0..1}.tar"), str(shards / "part-2.tar")],
            on_bad_sample="error",
        )
    assert error.value.reason == BAD[key][0]


def test_shard_and_directory_errors(tokenizer_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"part-\{0\.\.2\}\.tar: 3 of 3 shard\(s\) not found"):
        _fit(tokenizer_dir, str(tmp_path / "part-{0..2}.tar"))
    with pytest.raises(
        ValueError, match=r"is a directory without \.nv-meta: prepare it with `energon prepare"
    ):
        _fit(tokenizer_dir, str(tmp_path))
    with pytest.raises(ValueError, match=r"data\.csv: a VLM data entry must be"):
        _fit(tokenizer_dir, str(tmp_path / "data.csv"))


def test_a_missing_extra_is_named(tokenizer_dir, tmp_path, monkeypatch):
    shards = _write_shards(tmp_path / "shards", with_bad=False)
    monkeypatch.setitem(sys.modules, "webdataset.shardlists", None)  # as if not installed
    with pytest.raises(
        ImportError,
        match=r"reading WebDataset shards needs the webdataset package: pip install 'forge-lightning\[vlm\]'",
    ):
        _fit(tokenizer_dir, str(shards / "part-0.tar"))


def test_energon_prepared_dataset_reads_through_energon(tokenizer_dir, tmp_path):
    pytest.importorskip("megatron.energon")
    shards = _write_shards(tmp_path / "prepared")
    energon = Path(sys.executable).parent / "energon"
    command = [
        str(energon),
        "prepare",
        str(shards),
        "--non-interactive",
        "--split-parts",
        "train:part-{0..1}.tar",
    ]
    subprocess.run(
        [*command, "--split-parts", "val:part-0.tar", "--sample-type", "CrudeWebdataset", "--no-progress"],
        check=True,
        capture_output=True,
    )
    assert (shards / ".nv-meta" / "index.sqlite").is_file()
    expected = _batch(_fit(tokenizer_dir, str(_local_copy(tmp_path / "local"))))
    datamodule = _fit(tokenizer_dir, str(shards), val_files=str(shards))
    report = datamodule.reports["train"]
    assert (report.records, report.kept) == (len(GOOD) + len(BAD), len(GOOD))
    assert report.skipped["missing image"][0].startswith(
        f"{shards}/part-1.tar:bad_missing: 2.png is not a member"
    )
    assert sorted(s.source for s in datamodule.train_dataset.samples) == sorted(
        [f"{shards}/part-0.tar:good_two", f"{shards}/part-0.tar:good_parts", f"{shards}/part-1.tar:good_text"]
    )
    order = {s.source.rpartition(":")[2]: i for i, s in enumerate(datamodule.train_dataset.samples)}
    batch = datamodule.collate_fn([datamodule.train_dataset[order[key]] for key in GOOD])
    _assert_same_batch(batch, expected)
    assert [s.source.rpartition(":")[2] for s in datamodule.val_dataset.samples] == ["good_two", "good_parts"]
    loader = torch.utils.data.DataLoader(
        datamodule.val_dataset, batch_size=2, num_workers=1, collate_fn=datamodule.collate_fn
    )
    assert torch.equal(
        next(iter(loader))["pixel_values"],
        datamodule.collate_fn([datamodule.val_dataset[i] for i in range(2)])["pixel_values"],
    )

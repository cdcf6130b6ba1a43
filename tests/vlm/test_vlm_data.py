"""The vision-language SFT data path: three record formats to one encoding, vision tokens and pixel values against the
image processors (ours and transformers'), the loss mask, collation of mixed batches, the fixed-resolution
processor, the pre-scan's bad-sample reports, the datamodule's checks and its generation references."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny import write_vlm_tokenizer

from forge_lightning.datamodules.tokenizer import load_tokenizer
from forge_lightning.datamodules.vlm import (
    BadSampleError,
    Qwen2VLImageProcessor,
    VisionInputs,
    VLMDataModule,
    num_merged_tokens,
    smart_resize,
    vlm_collate,
)
from forge_lightning.datamodules.vlm.image_processor import to_rgb

LIMITS = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}  # at most 16 tokens per image
# (width, height) -> Qwen2-VL merged tokens under LIMITS: 56x56 -> 4, 28x112 -> 4, 84x112 (downscaled) -> 12.
SIZES = {"a.png": (60, 45), "b.jpg": (100, 30), "c.png": (200, 150)}
TOKENS = {"a.png": 4, "b.jpg": 4, "c.png": 12}
IGNORE = -100


def _noise(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 150, width)[None, :, None] + np.linspace(0, 60, height)[:, None, None]
    rgba = (ramp + rng.integers(0, 100, (height, width, 4))).clip(0, 255).astype(np.uint8)
    return Image.fromarray(rgba, "RGBA").convert(mode)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vlm_tokenizer(tmp_path_factory.mktemp("vlm_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir).backend


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A data directory with ``a.png`` (RGB), ``b.jpg`` and ``c.png`` (RGBA, composited onto white)."""
    _noise(*SIZES["a.png"], seed=0).save(tmp_path / "a.png")
    _noise(*SIZES["b.jpg"], seed=1).save(tmp_path / "b.jpg", quality=90)
    _noise(*SIZES["c.png"], seed=2, mode="RGBA").save(tmp_path / "c.png")
    return tmp_path


def _write(path: Path, records: list) -> Path:
    """``.jsonl`` (strings are raw lines) or a ``.json`` list, by the suffix."""
    if path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _datamodule(tokenizer_dir: Path, train, **options) -> VLMDataModule:
    options = {"num_workers": 0, "pin_memory": False, "batch_size": 1, "seq_length": 256, **options}
    if options.get("processor", "qwen2_vl") == "qwen2_vl":
        options = {**LIMITS, **options}
    files = [str(f) for f in train] if isinstance(train, list) else str(train)
    return VLMDataModule(files, str(tokenizer_dir), **options)


def _fit(tokenizer_dir: Path, train, **options) -> VLMDataModule:
    datamodule = _datamodule(tokenizer_dir, train, **options)
    datamodule.setup("fit")
    return datamodule


def _llava(images=("a.png", "b.jpg")) -> dict:
    return {
        "id": "s0",
        "image": list(images),
        "conversations": [
            {"from": "system", "value": "You see shapes."},
            {"from": "human", "value": "<image>\nWhat colour is the triangle?"},
            {"from": "gpt", "value": "red"},
            {"from": "human", "value": "<image>how many shapes?"},
            {"from": "gpt", "value": "two"},
        ],
    }


def _runs(labels: torch.Tensor) -> list[list[int]]:
    """Maximal runs of trained labels."""
    runs, current = [], []
    for value in labels.tolist():
        if value != IGNORE:
            current.append(value)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


# ----- formats and encoding -----------------------------------------------------------------------------------
def test_three_formats_encode_to_the_same_sample(tokenizer_dir, data):
    a_url = "data:image/png;base64," + base64.b64encode((data / "a.png").read_bytes()).decode()
    system = {"role": "system", "content": "You see shapes."}
    sharegpt = {
        "images": ["a.png", "b.jpg"],
        "messages": [
            system,
            {"role": "user", "content": "<image>\nWhat colour is the triangle?"},
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": "<image>how many shapes?"},
            {"role": "assistant", "content": "two"},
        ],
    }

    def openai(first: dict, second: dict) -> dict:
        return {
            "messages": [
                system,
                {
                    "role": "user",
                    "content": [first, {"type": "text", "text": "\nWhat colour is the triangle?"}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
                {"role": "user", "content": [second, {"type": "text", "text": "how many shapes?"}]},
                {"role": "assistant", "content": "two"},
            ]
        }

    openai_parts = openai({"type": "image", "image": "a.png"}, {"type": "image", "image": "b.jpg"})
    openai_urls = openai(
        {"type": "image_url", "image_url": {"url": a_url}},
        {"type": "image_url", "image_url": {"url": f"file://{data / 'b.jpg'}"}},
    )
    openai_refless = {**openai({"type": "image"}, {"type": "image"}), "images": ["a.png", "b.jpg"]}
    files = [
        _write(data / "llava.jsonl", [_llava()]),
        _write(data / "sharegpt.json", [sharegpt]),
        _write(data / "openai.jsonl", [openai_parts, openai_urls, openai_refless]),
    ]
    datamodule = _fit(tokenizer_dir, files)
    samples = [datamodule.train_dataset[i] for i in range(len(datamodule.train_dataset))]
    assert len(samples) == 5 and datamodule.reports["train"].kept == 5
    assert set(samples[0]) == {"input_ids", "labels", "pixel_values", "image_grid_thw"}
    for sample in samples[1:]:
        for key, value in samples[0].items():
            assert torch.equal(sample[key], value), key


def test_vision_tokens_and_pixels_equal_the_processors(tokenizer_dir, tokenizer, data):
    train = _write(data / "train.jsonl", [_llava(("a.png", "c.png"))])
    sample = _fit(tokenizer_dir, train).train_dataset[0]
    ids = tokenizer.get_vocab()
    pad, start, end = ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"]
    input_ids = sample["input_ids"]
    starts = torch.nonzero(input_ids == start).flatten().tolist()
    ends = torch.nonzero(input_ids == end).flatten().tolist()
    counts = [int((input_ids[s + 1 : e] == pad).sum()) for s, e in zip(starts, ends)]
    assert counts == [e - s - 1 for s, e in zip(starts, ends)] == [TOKENS["a.png"], TOKENS["c.png"]]
    assert counts == num_merged_tokens(sample["image_grid_thw"], 2).tolist()
    assert int((input_ids == pad).sum()) == sum(counts)

    images = [Image.open(data / "a.png"), Image.open(data / "c.png")]
    ours = Qwen2VLImageProcessor(**LIMITS).preprocess_images(images)
    assert torch.equal(sample["pixel_values"], ours["pixel_values"])
    assert torch.equal(sample["image_grid_thw"], ours["image_grid_thw"])
    assert sample["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]
    assert sample["pixel_values"].shape == (16 + 48, 3 * 2 * 14 * 14)
    hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    theirs = hf_pil.Qwen2VLImageProcessorPil(**LIMITS)(images, return_tensors="pt")
    assert torch.equal(sample["pixel_values"], theirs["pixel_values"])
    assert torch.equal(sample["image_grid_thw"], theirs["image_grid_thw"])


def test_expanding_after_tokenizing_equals_tokenizing_the_expanded_text(tokenizer_dir, tokenizer, data):
    """What transformers' processor does: the text with N image tokens per image, rendered and tokenized whole."""
    train = _write(data / "train.jsonl", [_llava()])
    sample = _fit(tokenizer_dir, train).train_dataset[0]
    expanded = [
        "<|vision_start|>" + "<|image_pad|>" * TOKENS[name] + "<|vision_end|>" for name in ("a.png", "b.jpg")
    ]
    messages = [
        {"role": "system", "content": "You see shapes."},
        {"role": "user", "content": expanded[0] + "\nWhat colour is the triangle?"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": expanded[1] + "how many shapes?"},
        {"role": "assistant", "content": "two"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    reference = tokenizer.encode(text, add_special_tokens=False)
    assert sample["input_ids"].tolist() == reference[:-1]


def test_labels_are_exactly_the_assistant_answers(tokenizer_dir, tokenizer, data):
    train = _write(data / "train.jsonl", [_llava()])
    sample = _fit(tokenizer_dir, train).train_dataset[0]
    input_ids, labels = sample["input_ids"], sample["labels"]
    assert input_ids.dtype == labels.dtype == torch.long and input_ids.shape == labels.shape
    assert [tokenizer.decode(run) for run in _runs(labels)] == ["red<|im_end|>\n", "two<|im_end|>\n"]
    trained = labels != IGNORE
    assert torch.equal(labels[:-1][trained[:-1]], input_ids[1:][trained[:-1]])  # next-token targets
    vision = set(tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]))
    assert not any(label in vision for label in labels.tolist())


# ----- collation ------------------------------------------------------------------------------------------------
def test_a_batch_mixes_several_images_and_text_only_samples(tokenizer_dir, tokenizer, data):
    text_only = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "goodbye"}]}
    one_image = _llava(("c.png",))
    one_image["conversations"] = one_image["conversations"][:3]
    train = _write(data / "train.jsonl", [_llava(), text_only, one_image])
    datamodule = _fit(tokenizer_dir, train, batch_size=3)
    dataset = datamodule.train_dataset
    samples = [dataset[i] for i in range(3)]
    assert "pixel_values" not in samples[1] and dataset.num_patches == [16 + 16, 0, 48]
    assert dataset.lengths == [len(s["input_ids"]) for s in samples]

    batch = vlm_collate(samples, pad_id=datamodule.pad_id)
    assert list(batch) == ["input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw"]
    longest = max(dataset.lengths)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (3, longest)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        assert torch.equal(batch["input_ids"][row, :n], sample["input_ids"])
        assert torch.equal(batch["labels"][row, :n], sample["labels"])
        assert (batch["input_ids"][row, n:] == datamodule.pad_id).all() and (
            batch["labels"][row, n:] == IGNORE
        ).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (longest - n)
    assert torch.equal(
        batch["pixel_values"], torch.cat([samples[0]["pixel_values"], samples[2]["pixel_values"]])
    )
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 8], [1, 6, 8]]
    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((batch["input_ids"] == pad_id).sum()) == int(
        num_merged_tokens(batch["image_grid_thw"], 2).sum()
    )

    assert set(vlm_collate([samples[1], samples[1]], pad_id=0)) == {"input_ids", "attention_mask", "labels"}
    loaded = next(iter(datamodule.train_dataloader()))  # the StepLoader's batch: same keys plus step_tokens
    assert set(loaded) == {*batch, "step_tokens"}
    assert int(loaded["step_tokens"]) == int((batch["labels"] != IGNORE).sum())


def test_fixed_resolution_processor(tokenizer_dir, tokenizer, data):
    train = _write(data / "train.jsonl", [_llava(("a.png", "c.png")), _llava(("b.jpg", "a.png"))])
    datamodule = _fit(tokenizer_dir, train, processor="fixed", image_size=56, patch_size=14, batch_size=2)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert datamodule.special_token_ids == {"image_token_id": image_id}
    assert isinstance(datamodule.vision, VisionInputs)
    sample = datamodule.train_dataset[0]
    assert set(sample) == {"input_ids", "labels", "pixel_values"}
    assert sample["pixel_values"].shape == (2, 3, 56, 56) and sample["pixel_values"].dtype == torch.float32
    assert int((sample["input_ids"] == image_id).sum()) == 2 * 16
    starts = torch.nonzero(sample["input_ids"] == image_id).flatten()
    assert starts[15] - starts[0] == 15 and starts[31] - starts[16] == 15  # 16 in a row per image
    assert tokenizer.convert_tokens_to_ids("<|vision_start|>") not in sample["input_ids"].tolist()
    assert datamodule.train_dataset.num_patches == [32, 32]

    # c.png has alpha: composited onto white, as transformers does
    image = to_rgb(Image.open(data / "c.png")).resize((56, 56), Image.Resampling.BICUBIC)
    expected = (torch.from_numpy(np.asarray(image, np.float32) / 255) - 0.5) / 0.5
    torch.testing.assert_close(sample["pixel_values"][1], expected.permute(2, 0, 1), atol=1e-6, rtol=0)
    batch = vlm_collate([datamodule.train_dataset[0], datamodule.train_dataset[1]], pad_id=datamodule.pad_id)
    assert batch["pixel_values"].shape == (4, 3, 56, 56) and "image_grid_thw" not in batch
    siglip = pytest.importorskip("transformers.models.siglip.image_processing_pil_siglip")
    images = [Image.open(data / "a.png"), Image.open(data / "c.png")]
    theirs = siglip.SiglipImageProcessorPil(size={"height": 56, "width": 56})(images, return_tensors="pt")
    assert torch.equal(sample["pixel_values"], theirs["pixel_values"])


# ----- the pre-scan ---------------------------------------------------------------------------------------------
def _bad_records(data: Path) -> dict[str, object]:
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not an image" * 10)
    long_answer = " ".join(["the triangle is red"] * 200)
    return {
        "missing image": _llava(("a.png", "images/x.png")),
        "corrupt image": _llava(("a.png", "broken.png")),
        "image count mismatch": _llava(("a.png",)),
        "too long": {
            **_llava(),
            "conversations": [*_llava()["conversations"][:4], {"from": "gpt", "value": long_answer}],
        },
        "no assistant turn": {"image": "a.png", "conversations": [{"from": "human", "value": "<image>hi"}]},
        "malformed record": '{"image": "a.png", "conversations": [',
        "unsupported image": _llava(("a.png", "https://example.com/b.jpg")),
    }


def test_bad_records_are_named_skipped_and_counted(tokenizer_dir, data, caplog):
    bad = _bad_records(data)
    text_only = {
        "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "goodbye"}]
    }
    train = _write(data / "train.jsonl", [_llava(), *bad.values(), text_only])
    with caplog.at_level("INFO"):
        datamodule = _fit(tokenizer_dir, train)
    report = datamodule.reports["train"]
    assert (report.records, report.kept, len(datamodule.train_dataset)) == (9, 2, 2)
    for line, reason in enumerate(bad, start=2):
        assert len(report.skipped[reason]) == 1, reason
        assert report.skipped[reason][0].startswith(f"{train}:{line}: "), reason
    assert (
        report.skipped["missing image"][0] == f"{train}:2: images/x.png not found at {data / 'images/x.png'}"
    )
    assert "broken.png cannot be read" in report.skipped["corrupt image"][0]
    assert "2 <image> placeholder(s) in the text but 1 image(s)" in report.skipped["image count mismatch"][0]
    assert "> seq_length 256" in report.skipped["too long"][0]
    assert "https:// images are not fetched" in report.skipped["unsupported image"][0]
    summary = report.describe()
    assert summary.startswith(f"VLM data {train}: 2 of 9 samples kept")
    assert f"1 missing image ({train}:2: images/x.png not found" in summary and "1 too long (" in summary
    assert summary in caplog.text  # the one summary line of the log


@pytest.mark.parametrize(
    "reason",
    [
        "missing image",
        "corrupt image",
        "image count mismatch",
        "too long",
        "no assistant turn",
        "malformed record",
    ],
)
def test_bad_records_raise_under_error(tokenizer_dir, data, reason):
    train = _write(data / "train.jsonl", [_llava(), _bad_records(data)[reason]])
    with pytest.raises(BadSampleError, match=f"^{train}:2: ") as raised:
        _fit(tokenizer_dir, train, on_bad_sample="error")
    assert raised.value.reason == reason and isinstance(raised.value, ValueError)


def test_records_of_a_json_list_are_named_by_index_and_all_bad_raises(tokenizer_dir, data):
    train = _write(data / "train.json", [_llava(("missing.png", "b.jpg")), _llava(("a.png",))])
    with pytest.raises(ValueError, match=r"no usable train sample: .* 0 of 2 samples kept") as raised:
        _fit(tokenizer_dir, train)
    assert f"1 missing image ({train}[0]: missing.png not found" in str(raised.value)
    assert f"1 image count mismatch ({train}[1]: " in str(raised.value)


def test_image_root_and_verify_pixels(tokenizer_dir, data, tmp_path_factory):
    jpeg = (data / "b.jpg").read_bytes()
    (data / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    elsewhere = _write(
        tmp_path_factory.mktemp("records") / "train.jsonl", [_llava(("a.png", "truncated.jpg"))]
    )
    datamodule = _fit(tokenizer_dir, elsewhere, image_root=str(data))  # verify() passes a truncated JPEG
    assert datamodule.reports["train"].kept == 1
    with pytest.raises(ValueError, match=f"{elsewhere}:1: truncated.jpg cannot be decoded"):
        datamodule.train_dataset[0]
    with pytest.raises(BadSampleError, match="truncated.jpg cannot be read") as raised:
        _fit(tokenizer_dir, elsewhere, image_root=str(data), verify_pixels=True, on_bad_sample="error")
    assert raised.value.reason == "corrupt image"


def test_exif_orientation_is_applied(tokenizer_dir, data):
    image = _noise(60, 30, seed=3)
    exif = image.getexif()
    exif[0x0112] = 6  # rotated 90 degrees: shown 30 wide, 60 high
    image.save(data / "rotated.jpg", exif=exif, quality=95)
    train = _write(data / "train.jsonl", [_llava(("rotated.jpg", "a.png"))])
    sample = _fit(tokenizer_dir, train, verify_pixels=True).train_dataset[0]
    height, width = smart_resize(60, 30, 28, **LIMITS)
    assert sample["image_grid_thw"][0].tolist() == [1, height // 14, width // 14]


# ----- the datamodule -------------------------------------------------------------------------------------------
def test_special_tokens_are_checked_against_the_tokenizer(tokenizer_dir, tokenizer, data, tmp_path_factory):
    train = _write(data / "train.jsonl", [_llava()])
    datamodule = _datamodule(tokenizer_dir, train)
    assert isinstance(datamodule.vision, VisionInputs)
    assert datamodule.special_token_ids == {
        "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    }
    plain = write_vlm_tokenizer(tmp_path_factory.mktemp("plain"), image_tokens=("<image>",))
    with pytest.raises(
        ValueError, match=r"lacks the special token\(s\) <\|image_pad\|>, <\|vision_start\|>, "
    ):
        _datamodule(plain, train).setup("fit")
    with pytest.raises(ValueError, match="use the tokenizer of the model"):
        _datamodule(plain, train).setup("fit")
    _fit(plain, train, processor="fixed", image_size=28)  # the fixed processor needs only <image>


def test_options_of_the_other_processor_are_refused(tokenizer_dir, data):
    train = data / "train.jsonl"
    with pytest.raises(ValueError, match=r"max_pixels do\(es\) not apply to processor 'fixed'"):
        VLMDataModule(str(train), str(tokenizer_dir), processor="fixed", max_pixels=1000)
    with pytest.raises(ValueError, match=r"image_size do\(es\) not apply to processor 'qwen2_vl'"):
        VLMDataModule(str(train), str(tokenizer_dir), image_size=224)
    with pytest.raises(ValueError, match=r"tokens_per_second do\(es\) not apply to processor 'qwen3_vl'"):
        VLMDataModule(str(train), str(tokenizer_dir), processor="qwen3_vl", tokens_per_second=2.0)
    with pytest.raises(
        ValueError, match=r"video_cap_pixels_per_frame do\(es\) not apply to processor 'qwen2_vl'"
    ):
        VLMDataModule(str(train), str(tokenizer_dir), video_cap_pixels_per_frame=True)
    with pytest.raises(ValueError, match="processor \\('siglip'\\) must be one of qwen2_vl, qwen3_vl, fixed"):
        VLMDataModule(str(train), str(tokenizer_dir), processor="siglip")


def test_generation_references_carry_the_prompt_images(tokenizer_dir, tokenizer, data):
    text_only = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "goodbye"}]}
    train = _write(data / "train.jsonl", [_llava()])
    val = _write(data / "val.jsonl", [_llava(), text_only])
    datamodule = _fit(tokenizer_dir, train, val_files=str(val))
    assert len(datamodule.val_dataset) == 2
    with_images, text = datamodule.generation_references("val")
    assert (with_images.reference, text.reference) == ("two", "goodbye")
    assert with_images.source == f"{val}:1" and text.inputs is None
    assert tokenizer.decode(with_images.prompt_ids).endswith(
        "how many shapes?<|im_end|>\n<|im_start|>assistant\n"
    )
    sample = datamodule.val_dataset[0]
    prompt = torch.tensor(with_images.prompt_ids)
    assert torch.equal(prompt, sample["input_ids"][: len(prompt)])  # the same tokens as in training
    assert torch.equal(with_images.inputs["pixel_values"], sample["pixel_values"])
    assert torch.equal(with_images.inputs["image_grid_thw"], sample["image_grid_thw"])
    assert tokenizer.decode(text.prompt_ids).endswith("hello<|im_end|>\n<|im_start|>assistant\n")
    assert datamodule.stop_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]

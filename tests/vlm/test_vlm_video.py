"""Videos in ``VLMDataModule`` (``qwen2_vl``): records with ``<video>`` in LLaVA / ShareGPT text or OpenAI video parts,
an mp4 written with PyAV, a mixed batch (image, video, both, text only) whose token ids, grids, patches and
``second_per_grid_ts`` equal transformers' processing (its Qwen2-VL image processor on the sampled frames) and whose
forward through a tiny Qwen2.5-VL matches ``Qwen2_5_VLForConditionalGeneration``; packed rows with a video give
every token its unpacked loss; bad videos are named, skipped and counted or raised; generation references carry
the prompt's videos."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from qwen2_5_vl_case import VISION
from qwen_vl_parity import assert_matches_transformers, hf_checkpoint, hf_video_rows
from tiny import TINY_QWEN2_5_VL_TEXT, VLM_SPECIAL_TOKENS, write_vlm_tokenizer
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from video_case import (
    decoded_frames,
    llava_record,
    write_clip,
    write_jsonl,
    write_media,
)
from vlm_pack_case import MODEL_KEYS, OPTIONS, datamodule, model, per_sample_losses, token_losses

from forge_lightning.datamodules.tokenizer import load_tokenizer
from forge_lightning.datamodules.vlm import BadSampleError, VLMDataModule
from forge_lightning.modules.vlm import from_pretrained

hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

# Frames of 40 x 56 (height x width) at 8 x 8 pixels per token, 256 .. 512 pixels: resized to 16 x 24, 4 x 6 patches.
VIDEO_LIMITS = {"video_min_pixels": 8 * 8 * 4, "video_max_pixels": 8 * 8 * 8}
# transformers' sample_frames at fps 2: 13 / 5 * 2 = 5.2 -> 4 frames, arange(0, 13, 3.25); sampled_fps 4 / 13 * 5.
SAMPLED = [0, 3, 6, 9]
SECONDS_PER_GRID = 2 / (4 / 13 * 5)
VIDEO_TOKENS = 2 * 4 * 6 // 4
IGNORE = -100


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_vlm_tokenizer(
        tmp_path_factory.mktemp("tokenizer"), image_tokens=(*VLM_SPECIAL_TOKENS, "<|video_pad|>")
    )


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir).backend


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_media(tmp_path)


def _dm(tokenizer_dir: Path, train: Path, **options) -> VLMDataModule:
    return datamodule(tokenizer_dir, train, **{**VIDEO_LIMITS, **options})


def _mixed_records() -> list[dict]:
    both = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": "clip.mp4"},
                    {"type": "image", "image": "b.png"},
                    {"type": "text", "text": "what colour is it"},
                ],
            },
            {"role": "assistant", "content": "red"},
        ]
    }
    return [
        llava_record("<image>\nwhat colour is the triangle?", "red", image="a.png"),
        llava_record("<video>\nhow many shapes?", "two", video="clip.mp4"),
        llava_record("hello", "goodbye"),
        both,
    ]


def _hf_image_processor(**limits: int):
    return hf_pil.Qwen2VLImageProcessorPil(patch_size=4, **limits)


# ----- records and encoding ---------------------------------------------------------------------------------------
def test_video_formats_encode_to_the_same_sample(tokenizer_dir, data):
    messages = [
        {"role": "user", "content": "<video>\nhow many shapes?"},
        {"role": "assistant", "content": "two"},
    ]
    parts = [{"type": "text", "text": "\nhow many shapes?"}]
    openai = {
        "messages": [
            {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, *parts]},
            messages[1],
        ]
    }
    refless = {
        "videos": ["clip.mp4"],
        "messages": [{"role": "user", "content": [{"type": "video"}, *parts]}, messages[1]],
    }
    url = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": f"file://{data / 'clip.mp4'}"}},
                    *parts,
                ],
            },
            messages[1],
        ]
    }
    records = [
        llava_record("<video>\nhow many shapes?", "two", video="clip.mp4"),
        {"videos": ["clip.mp4"], "messages": messages},
        openai,
        refless,
        url,
    ]
    dm = _dm(tokenizer_dir, write_jsonl(data / "train.jsonl", records))
    samples = [dm.train_dataset[i] for i in range(len(records))]
    assert dm.reports["train"].kept == 5 and dm.reports["train"].videos == 5
    assert set(samples[0]) == {
        "input_ids",
        "labels",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    }
    for sample in samples[1:]:
        for key, value in samples[0].items():
            assert torch.equal(sample[key], value), key


def test_mixed_batch_equals_transformers_processing(tokenizer_dir, tokenizer, data):
    dm = _dm(tokenizer_dir, write_jsonl(data / "train.jsonl", _mixed_records()), batch_size=4)
    assert dm.special_token_ids["video_token_id"] == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert ", 2 videos)" in dm.reports["train"].describe()
    samples = [dm.train_dataset[i] for i in range(4)]

    # grids, patches and second_per_grid_ts: transformers' image processor on the images and the sampled frames
    batch = dm.collate_fn(samples)
    images = _hf_image_processor(min_pixels=OPTIONS["min_pixels"], max_pixels=OPTIONS["max_pixels"])(
        [Image.open(data / "a.png"), Image.open(data / "b.png")], return_tensors="pt"
    )
    assert torch.equal(batch["pixel_values"], images["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], images["image_grid_thw"])
    frames = _hf_image_processor(
        min_pixels=VIDEO_LIMITS["video_min_pixels"], max_pixels=VIDEO_LIMITS["video_max_pixels"]
    )
    rows, grid = hf_video_rows(decoded_frames(data / "clip.mp4", SAMPLED), frames)
    assert grid == [2, 4, 6]
    assert torch.equal(batch["pixel_values_videos"], torch.cat([rows, rows]))
    assert batch["video_grid_thw"].tolist() == [grid, grid]
    assert batch["second_per_grid_ts"].dtype == torch.float32
    assert torch.equal(batch["second_per_grid_ts"], torch.tensor([SECONDS_PER_GRID] * 2))
    image_patches = images["image_grid_thw"].prod(-1).tolist()
    assert dm.train_dataset.num_patches == [image_patches[0], 48, 0, 48 + image_patches[1]]

    # token ids: transformers' processor renders the text with every placeholder already expanded
    def expanded(pad: str, count: int) -> str:
        return "<|vision_start|>" + pad * count + "<|vision_end|>"

    image_a, image_b = (expanded("<|image_pad|>", n // 4) for n in image_patches)
    video = expanded("<|video_pad|>", VIDEO_TOKENS)
    texts = [
        (image_a + "\nwhat colour is the triangle?", "red"),
        (video + "\nhow many shapes?", "two"),
        ("hello", "goodbye"),
        (video + image_b + "what colour is it", "red"),
    ]
    for sample, (question, answer) in zip(samples, texts):
        chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        reference = tokenizer.encode(
            tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False
        )
        assert sample["input_ids"].tolist() == reference[:-1]
        assert not set(sample["labels"].tolist()) & set(dm.special_token_ids.values())

    # decoded in a loader worker too (the loader's order is shuffled; both videos are the same clip)
    dm.num_workers = 1
    loaded = next(iter(dm.train_dataloader()))
    assert torch.equal(loaded["pixel_values_videos"], batch["pixel_values_videos"])
    assert torch.equal(loaded["second_per_grid_ts"], batch["second_per_grid_ts"])


def test_mixed_batch_forward_matches_transformers(tokenizer_dir, data, tmp_path_factory):
    dm = _dm(tokenizer_dir, write_jsonl(data / "train.jsonl", _mixed_records()))
    batch = dm.collate_fn([dm.train_dataset[i] for i in range(4)])
    batch = {k: v for k, v in batch.items() if k in MODEL_KEYS}
    ids = dm.special_token_ids
    text = dict(vocab_size=dm.vocab_size, bos_token_id=1, eos_token_id=2, **TINY_QWEN2_5_VL_TEXT)
    path = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, text, VISION, path, tokens=ids)
    ours = from_pretrained(path).eval()
    assert_matches_transformers(hf, ours, batch, image=ids["image_token_id"], video=ids["video_token_id"])


# ----- packing ----------------------------------------------------------------------------------------------------
def test_packed_rows_with_a_video_give_each_token_its_unpacked_loss(tokenizer_dir, data):
    records = [
        *_mixed_records(),
        llava_record("<video>count them", "yes", video="clip.mp4"),
        llava_record("a blue square", "yes"),
    ]
    train = write_jsonl(data / "train.jsonl", records)
    plain, packed = _dm(tokenizer_dir, train), _dm(tokenizer_dir, train, pack=True)
    rows = packed.train_dataset
    assert len(rows) < len(records)
    batch = packed.collate_fn([rows[i] for i in range(len(rows))])
    assert (
        batch["video_grid_thw"].tolist() == [[2, 4, 6]] * 3
        and batch["pixel_values_videos"].shape[0] == 3 * 48
    )
    assert batch["position_ids"].shape == (3, len(rows), OPTIONS["seq_length"])

    vlm = model(plain)
    with torch.no_grad():  # the host-side positions (video timing included) are those the model computes
        without = {k: v for k, v in batch.items() if k != "position_ids"}
        torch.testing.assert_close(token_losses(vlm, batch), token_losses(vlm, without), atol=1e-6, rtol=0)
    ours, reference = per_sample_losses(vlm, packed), per_sample_losses(vlm, plain)
    assert ours.keys() == reference.keys()
    for i, losses in reference.items():
        torch.testing.assert_close(ours[i], losses, atol=1e-5, rtol=1e-5, msg=f"sample {i}")

    # tokens_per_second spaces the temporal positions of the video's frames (the model's own must agree)
    with_video = next(i for i in range(len(rows)) if "video_grid_thw" in rows[i])
    slower = _dm(tokenizer_dir, train, pack=True, tokens_per_second=1.0).train_dataset
    assert slower.bins == rows.bins
    assert not torch.equal(slower[with_video]["position_ids"], rows[with_video]["position_ids"])


# ----- bad videos -------------------------------------------------------------------------------------------------
def _bad_records(data: Path) -> dict[str, object]:
    (data / "broken.mp4").write_bytes(b"not a video" * 20)
    write_clip(data / "short.mp4", num_frames=1)
    long_answer = " ".join(["the red triangle"] * 60)
    return {
        "missing video": llava_record("<video>hi", "yes", video="nope.mp4"),
        "corrupt video": llava_record("<video>hi", "yes", video="broken.mp4"),
        "video count mismatch": llava_record("<video><video>hi", "yes", video="clip.mp4"),
        "unsupported video": llava_record("<video>hi", "yes", video="short.mp4"),
        "too long": llava_record("<video>hi", long_answer, video="clip.mp4"),
    }


def test_bad_videos_are_named_skipped_and_counted(tokenizer_dir, data):
    bad = _bad_records(data)
    extra = {
        "token in text": llava_record("<|video_pad|> hi", "yes"),
        "no placeholder": llava_record("hi", "yes", video="clip.mp4"),
        "remote": llava_record("<video>hi", "yes", video="https://example.com/a.mp4"),
    }
    train = write_jsonl(
        data / "train.jsonl",
        [llava_record("<video>hi", "yes", video="clip.mp4"), *bad.values(), *extra.values()],
    )
    report = _dm(tokenizer_dir, train).reports["train"]
    assert (report.records, report.kept, report.videos) == (9, 1, 1)
    for line, reason in enumerate(bad, start=2):
        assert report.skipped[reason][0].startswith(f"{train}:{line}: "), reason
    assert report.skipped["missing video"] == [f"{train}:2: nope.mp4: {data / 'nope.mp4'} not found"]
    assert (
        "broken.mp4: " in report.skipped["corrupt video"][0]
        and "cannot be opened as a video" in report.skipped["corrupt video"][0]
    )
    counts = report.skipped["video count mismatch"]
    assert "2 <video> placeholder(s) in the text but 1 video(s)" in counts[0]
    assert (
        counts[1]
        == f"{train}:7: the text holds the video token '<|video_pad|>' itself; mark videos with <video>"
    )
    assert counts[2] == f"{train}:8: 0 <video> placeholder(s) in the text but 1 video(s)"
    unsupported = report.skipped["unsupported video"]
    assert "short.mp4: a video of 1 frames cannot give 2 sampled frames" in unsupported[0]
    assert unsupported[1].startswith(f"{train}:9: ") and "https:// images are not fetched" in unsupported[1]
    assert "tokens after image / video expansion > seq_length 160" in report.skipped["too long"][0]
    assert "1 missing video (" in report.describe() and "1 corrupt video (" in report.describe()


@pytest.mark.parametrize(
    "reason", ["missing video", "corrupt video", "video count mismatch", "unsupported video", "too long"]
)
def test_bad_videos_raise_under_error(tokenizer_dir, data, reason):
    train = write_jsonl(
        data / "train.jsonl", [llava_record("<video>hi", "yes", video="clip.mp4"), _bad_records(data)[reason]]
    )
    with pytest.raises(BadSampleError, match=f"^{train}:2: ") as raised:
        _dm(tokenizer_dir, train, on_bad_sample="error")
    assert raised.value.reason == reason


def test_videos_need_the_video_token_and_the_qwen_processor(data, tmp_path_factory):
    records = [
        llava_record("<image>what colour is it", "red", image="a.png"),
        llava_record("<video>hi", "yes", video="clip.mp4"),
    ]
    train = write_jsonl(data / "train.jsonl", records)
    plain = write_vlm_tokenizer(tmp_path_factory.mktemp("no_video"))  # images only
    dm = _dm(plain, train)
    assert "video_token_id" not in dm.special_token_ids and dm.reports["train"].kept == 1
    (message,) = dm.reports["train"].skipped["unsupported video"]
    assert message.startswith(
        f"{train}:2: the record has videos but the tokenizer lacks the special token <|video_pad|>"
    )
    with pytest.raises(
        BadSampleError, match=r"lacks the special token <\|video_pad\|> that videos are written with"
    ):
        _dm(plain, train, on_bad_sample="error")
    fixed = datamodule(
        plain, train, processor="fixed", image_size=16, patch_size=4, min_pixels=None, max_pixels=None
    )
    assert fixed.reports["train"].skipped["unsupported video"] == [
        f"{train}:2: the record has videos but this processor takes images only"
    ]


def test_video_options_are_validated(tokenizer_dir, data):
    train = write_jsonl(data / "train.jsonl", [llava_record("<video>hi", "yes", video="clip.mp4")])
    with pytest.raises(ValueError, match=r"video_fps do\(es\) not apply to processor 'fixed'"):
        VLMDataModule(str(train), str(tokenizer_dir), processor="fixed", video_fps=1.0)
    cases = [
        (
            {"video_fps": 1.0, "video_num_frames": 4},
            r"video_fps \(1.0\) and video_num_frames \(4\) both choose",
        ),
        ({"video_fps": 0.0}, r"video fps \(0.0\) must be positive \(the video_\* options\)"),
        (
            {"video_min_frames": 8, "video_max_frames": 4},
            r"min_frames \(8\) must be positive and at most max_frames",
        ),
        ({"video_num_frames": 1}, r"video num_frames \(1\) must be at least temporal_patch_size \(2\)"),
        (
            {"video_min_pixels": 512, "video_max_pixels": 256},
            r"video_max_pixels \(256\) must be at least video_min_pixels",
        ),
        ({"tokens_per_second": 0.0}, r"tokens_per_second \(0.0\) must be positive"),
    ]
    for options, match in cases:
        with pytest.raises(ValueError, match=match):
            datamodule(tokenizer_dir, train, **options)
    dm = _dm(tokenizer_dir, train, video_fps=None, video_num_frames=6)
    assert dm.train_dataset[0]["video_grid_thw"].tolist() == [[3, 4, 6]]
    assert dm.train_dataset[0]["second_per_grid_ts"].item() == pytest.approx(2 / (6 / 13 * 5))


def test_a_video_changed_after_setup_is_named_and_verify_pixels_decodes(tokenizer_dir, data):
    train = write_jsonl(data / "train.jsonl", [llava_record("<video>hi", "yes", video="clip.mp4")])
    dm = _dm(tokenizer_dir, train, verify_pixels=True)
    write_clip(data / "clip.mp4", height=48)
    with pytest.raises(
        ValueError,
        match=rf"^{train}:1: clip.mp4 gives frames \[4, 48, 56, 3\] but \[4, 40, 56, 3\] at setup: the file changed since",
    ):
        dm.train_dataset[0]


# ----- generation references --------------------------------------------------------------------------------------
def test_generation_references_carry_the_prompt_videos(tokenizer_dir, tokenizer, data):
    turns = [
        {"from": "human", "value": "<video>how many shapes?"},
        {"from": "gpt", "value": "two"},
        {"from": "human", "value": "<image>what colour is it"},
        {"from": "gpt", "value": "red"},
    ]
    val = write_jsonl(data / "val.jsonl", [{"video": "clip.mp4", "image": "a.png", "conversations": turns}])
    dm = _dm(tokenizer_dir, val, val_files=str(val))
    (reference,) = dm.generation_references("val")
    sample = dm.val_dataset[0]
    assert reference.reference == "red"
    prompt = torch.tensor(reference.prompt_ids)
    assert torch.equal(prompt, sample["input_ids"][: len(prompt)])
    assert set(reference.inputs) == set(sample) - {"input_ids", "labels"}
    for key, value in reference.inputs.items():
        assert torch.equal(value, sample[key]), key

    first = write_jsonl(data / "first.jsonl", [{"video": "clip.mp4", "conversations": turns[:2]}])
    (only_text,) = _dm(tokenizer_dir, first, val_files=str(first)).generation_references("val")
    assert set(only_text.inputs) == {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"}
    assert tokenizer.decode(only_text.prompt_ids).endswith(
        "how many shapes?<|im_end|>\n<|im_start|>assistant\n"
    )

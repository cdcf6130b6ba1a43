"""Qwen3-VL videos in ``VLMDataModule`` (``processor: qwen3_vl``), against transformers' own Qwen3-VL classes: its
frame sampling (``Qwen3VLVideoProcessor.sample_frames``), video resize (``smart_resize`` of the video processor,
with and without ``cap_pixels_per_frame``), timestamps and prompt text (``Qwen3VLProcessor``); on an mp4 written
with PyAV, a batch of a video, a video + image, an image and a text-only record has exactly the token ids of
``Qwen3VLProcessor``'s text expansion of the same chat text, the image patches of its image processor and the video
patches of that processor on the sampled frames (``torch.equal``), and runs through a tiny Qwen3-VL as
``Qwen3VLForConditionalGeneration`` does; packed rows give every token its unpacked loss; a too short video is named
and counted.

transformers' video processor resizes and normalises with torchvision, which does not run here: its sampling, sizes
and text expansion are called directly, its pixels are those of the image processor frame by frame (as in
``test_vlm_video.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_vl_parity import assert_matches_transformers, hf_checkpoint, hf_video_rows
from tiny import TINY_QWEN3_VL_TEXT, VLM_SPECIAL_TOKENS, write_vlm_tokenizer
from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_smart_resize
from transformers.video_utils import VideoMetadata
from video_case import (
    FPS,
    FRAMES,
    decoded_frames,
    llava_record,
    write_clip,
    write_jsonl,
    write_media,
)
from vlm_pack_case import MODEL_KEYS, datamodule, per_sample_losses, token_losses

from forge_lightning.datamodules.vlm import (
    BadSampleError,
    Qwen3VideoSampling,
    Qwen3VLImageProcessor,
    VLMDataModule,
)
from forge_lightning.datamodules.vlm.video import VideoInfo
from forge_lightning.modules.vlm import VisionLanguageModel, VLMConfig, from_pretrained

PATCH = 4
# Images: 8 x 8 pixels per token, 4 .. 16 tokens. Videos: the bounds span all frames; 5 sampled frames of 40 x 56
# (4 after rounding to temporal patches) are over 2560 pixels, so they shrink to 16 x 24: 4 x 6 patches per frame.
OPTIONS = dict(
    processor="qwen3_vl",
    patch_size=PATCH,
    min_pixels=8 * 8 * 4,
    max_pixels=8 * 8 * 16,
    video_min_pixels=8 * 8 * 16,
    video_max_pixels=8 * 8 * 8 * 5,
)
SAMPLED = [0, 3, 6, 9, 12]  # int(13 / 5 * 2) = 5 frames, linspace(0, 12, 5)
GRID = [3, 4, 6]  # 5 frames padded to 6 with the last: 3 temporal patches
TIMES = ["<0.3 seconds>", "<1.5 seconds>", "<2.4 seconds>"]  # means of (0, 3), (6, 9), (12, 12) over 5 fps
VISION = dict(
    depth=3,
    deepstack_visual_indexes=[0, 2],
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=PATCH,
    num_position_embeddings=16,
)
TEXT = {**TINY_QWEN3_VL_TEXT, "num_hidden_layers": 3}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_vlm_tokenizer(
        tmp_path_factory.mktemp("tokenizer"), image_tokens=(*VLM_SPECIAL_TOKENS, "<|video_pad|>")
    )


def _image_processor(**limits: int) -> Qwen2VLImageProcessorPil:
    """transformers' image processor of Qwen3-VL (its auto class for ``qwen3_vl`` is Qwen2-VL's) at our sizes."""
    limits = limits or {"min_pixels": OPTIONS["min_pixels"], "max_pixels": OPTIONS["max_pixels"]}
    return Qwen2VLImageProcessorPil(patch_size=PATCH, image_mean=[0.5] * 3, image_std=[0.5] * 3, **limits)


def _video_processor(**options) -> Qwen3VLVideoProcessor:
    size = {"shortest_edge": OPTIONS["video_min_pixels"], "longest_edge": OPTIONS["video_max_pixels"]}
    return Qwen3VLVideoProcessor(**{"patch_size": PATCH, "size": size, **options})


@pytest.fixture(scope="module")
def hf_processor(tokenizer_dir) -> Qwen3VLProcessor:
    """transformers' ``Qwen3VLProcessor`` over our tokenizer. Its class check of the video processor looks for a
    base class that exists only with torchvision: skipped for that argument alone."""
    check = Qwen3VLProcessor.check_argument_for_proper_class

    def checked(self, name, argument):
        return None if name == "video_processor" else check(self, name, argument)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", checked)
        return Qwen3VLProcessor(
            image_processor=_image_processor(),
            tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
            video_processor=_video_processor(),
        )


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_media(tmp_path)


def _records() -> list[dict]:
    both = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look:"},
                    {"type": "video", "video": "clip.mp4"},
                    {"type": "image", "image": "b.png"},
                    {"type": "text", "text": "what colour is it"},
                ],
            },
            {"role": "assistant", "content": "red"},
        ]
    }
    return [
        llava_record("<video>\nhow many shapes?", "two", video="clip.mp4"),
        both,
        llava_record("<image>\nwhat colour is the triangle?", "red", image="a.png"),
        llava_record("hello", "goodbye"),
    ]


def _dm(tokenizer_dir: Path, train: Path, **options):
    return datamodule(tokenizer_dir, train, **{**OPTIONS, **options})


# ----- sampling, sizes and timestamps against transformers' functions ---------------------------------------------
@pytest.mark.parametrize(
    ("frames", "fps", "options"),
    [
        (13, 5.0, {}),  # int(5.2) = 5 frames: not a multiple of the temporal patch
        (23, 10.0, {}),  # below min_frames: 4
        (3, 10.0, {}),  # bounded by the video: 3
        (600, 30.0, {"max_frames": 16}),
        (100, 24.0, {"fps": 0.5, "min_frames": 2}),
        (40, 25.0, {"num_frames": 7}),  # num_frames as given, not rounded
        (5, 25.0, {"num_frames": 8}),  # more than the video: indices repeat
    ],
)
def test_frame_sampling_and_timestamps_equal_transformers(hf_processor, frames, fps, options):
    ours = Qwen3VideoSampling(**options)
    fields = {k: options.pop(k) for k in ("min_frames", "max_frames") if k in options}
    reference = _video_processor(**fields).sample_frames(
        VideoMetadata(total_num_frames=frames, fps=fps), **options
    )
    info = VideoInfo(num_frames=frames, fps=fps, width=64, height=64)
    assert ours.indices(info) == reference.tolist()
    assert ours.timestamps(info) == hf_processor._calculate_timestamps(reference, fps, 2)


@pytest.mark.parametrize(
    ("frames", "height", "width"),
    [(5, 40, 56), (4, 40, 56), (6, 20, 300), (2, 5, 30), (30, 96, 128), (64, 480, 640), (3, 1000, 8)],
)
@pytest.mark.parametrize("cap", [False, True])
def test_video_sizes_equal_transformers(frames, height, width, cap):
    ours = Qwen3VLImageProcessor(
        patch_size=PATCH,
        video_min_pixels=OPTIONS["video_min_pixels"],
        video_max_pixels=OPTIONS["video_max_pixels"] * 4,
        video_cap_pixels_per_frame=cap,
        video_max_frame_tokens=12,
    )
    size = {"shortest_edge": ours.video_min_pixels, "longest_edge": ours.video_max_pixels}
    hf = _video_processor(size=size, max_video_tokens=12)
    kwargs = {"size": size, "cap_pixels_per_frame": cap}
    assert np.prod(ours.video_grid(frames, height, width)) == hf.get_num_of_video_patches(
        frames, height, width, kwargs
    )
    if not cap:
        assert ours.video_size(frames, height, width) == hf_smart_resize(
            frames,
            height,
            width,
            temporal_factor=2,
            factor=8,
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
        )


def test_defaults_are_transformers_class_defaults(tokenizer_dir):
    ours, hf = Qwen3VLImageProcessor(), Qwen3VLVideoProcessor()
    vision = VLMDataModule("train.jsonl", str(tokenizer_dir), processor="qwen3_vl").vision  # no file is read
    assert vision.processor == ours and type(vision.sampling) is Qwen3VideoSampling
    assert (
        (ours.patch_size, ours.merge_size, ours.temporal_patch_size)
        == (16, 2, 2)
        == (
            hf.patch_size,
            hf.merge_size,
            hf.temporal_patch_size,
        )
    )
    assert (ours.video_min_pixels, ours.video_max_pixels) == (hf.size.shortest_edge, hf.size.longest_edge)
    assert ours.image_mean == tuple(hf.image_mean) and ours.image_std == tuple(hf.image_std)
    sampling = Qwen3VideoSampling()
    assert (sampling.fps, sampling.min_frames, sampling.max_frames) == (hf.fps, hf.min_frames, hf.max_frames)
    with pytest.raises(ValueError, match="must be larger than temporal_factor"):
        hf_smart_resize(1, 64, 64, temporal_factor=2, factor=32)
    with pytest.raises(
        ValueError, match=r"1 sampled frame\(s\) are fewer than one temporal patch \(2 frames\)"
    ):
        ours.video_grid(1, 64, 64)


# ----- a batch against transformers' processor and model ----------------------------------------------------------
def _reference_ids(hf_processor, question: str, answer: str, images: list, videos: int) -> list[int]:
    """``Qwen3VLProcessor``'s ids of the chat text (``<image>`` as the chat template writes an image, ``<video>`` as
    the bare video token), its own expansion of every image and video (the grid and metadata of
    ``Qwen3VLVideoProcessor``'s formulas for the clip)."""
    tokenizer = hf_processor.tokenizer
    question = question.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    chat = [{"role": "user", "content": question.replace("<video>", "<|video_pad|>")}]
    text = tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": answer}], tokenize=False)
    image_inputs = hf_processor.image_processor(images) if images else {}
    metadata = VideoMetadata(total_num_frames=FRAMES, fps=float(FPS), frames_indices=SAMPLED)
    video_inputs = {"video_grid_thw": torch.tensor([GRID]), "video_metadata": [metadata]}
    expanded, _ = hf_processor.get_text_with_replacements(
        [text],
        [hf_processor.replace_image_token(image_inputs, i) for i in range(len(images))],
        [hf_processor.replace_video_token(video_inputs, 0)] * videos,
    )
    return tokenizer(expanded[0], add_special_tokens=False)["input_ids"]


def test_batch_equals_transformers_processing(tokenizer_dir, hf_processor, data):
    dm = _dm(tokenizer_dir, write_jsonl(data / "train.jsonl", _records()), batch_size=4)
    assert dm.vision_settings == {"tokens_per_second": None}
    assert ", 2 videos)" in dm.reports["train"].describe()
    samples = [dm.train_dataset[i] for i in range(4)]
    images = [Image.open(data / "b.png"), Image.open(data / "a.png")]
    texts = [
        ("<video>\nhow many shapes?", "two", [], 1),
        ("look:<video><image>what colour is it", "red", images[:1], 1),
        ("<image>\nwhat colour is the triangle?", "red", images[1:], 0),
        ("hello", "goodbye", [], 0),
    ]
    for sample, (question, answer, sample_images, videos) in zip(samples, texts):
        reference = _reference_ids(hf_processor, question, answer, sample_images, videos)
        assert sample["input_ids"].tolist() == reference[:-1]
        assert not set(sample["labels"].tolist()) & set(dm.special_token_ids.values())
    decoded = hf_processor.tokenizer.decode(samples[0]["input_ids"])
    assert all(f"{t}<|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>" in decoded for t in TIMES)

    # transformers 5.0 to 5.24 keep the chat template's own <|vision_start|> / <|vision_end|> around the frames where
    # the text has them (two tokens more); 5.25 drops them, as transformers 4 replaced all three: the ids equal ours.
    bare = _reference_ids(hf_processor, *texts[0][:2], [], 1)
    wrapped = _reference_ids(
        hf_processor,
        "<|vision_start|><video><|vision_end|>" + texts[0][0].removeprefix("<video>"),
        "two",
        [],
        1,
    )
    if wrapped != bare:
        start, end = (
            dm.special_token_ids["vision_start_token_id"],
            dm.special_token_ids["vision_end_token_id"],
        )
        first = next(k for k, (a, b) in enumerate(zip(bare, wrapped)) if a != b)
        last = len(bare) - 1 - bare[::-1].index(end)
        assert wrapped[first] == start and wrapped[last + 2] == end
        assert wrapped[:first] + wrapped[first + 1 : last + 2] + wrapped[last + 3 :] == bare

    batch = dm.collate_fn(samples)
    assert "second_per_grid_ts" not in batch
    image_ref = hf_processor.image_processor(images, return_tensors="pt")
    assert torch.equal(batch["pixel_values"], image_ref["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], image_ref["image_grid_thw"])
    # transformers' video size (16 x 24, asserted below) taken by its image processor frame by frame
    frame_processor = _image_processor(min_pixels=8 * 8 * 4, max_pixels=8 * 8 * 8)
    rows, grid = hf_video_rows(decoded_frames(data / "clip.mp4", SAMPLED), frame_processor)
    assert grid == GRID
    assert torch.equal(batch["pixel_values_videos"], torch.cat([rows, rows]))
    assert batch["video_grid_thw"].tolist() == [GRID, GRID]


def _hf_config(dm) -> Qwen3VLConfig:
    text = dict(vocab_size=dm.vocab_size, bos_token_id=1, eos_token_id=2, **TEXT)
    return Qwen3VLConfig(text_config=text, vision_config=VISION, **dm.special_token_ids)


def test_batch_forward_matches_transformers(tokenizer_dir, data, tmp_path_factory):
    dm = _dm(tokenizer_dir, write_jsonl(data / "train.jsonl", _records()))
    batch = dm.collate_fn([dm.train_dataset[i] for i in range(4)])
    batch = {k: v for k, v in batch.items() if k in MODEL_KEYS}
    ids = dm.special_token_ids
    text = dict(vocab_size=dm.vocab_size, bos_token_id=1, eos_token_id=2, **TEXT)
    path = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(Qwen3VLForConditionalGeneration, Qwen3VLConfig, text, VISION, path, tokens=ids)
    ours = from_pretrained(path).eval()
    assert_matches_transformers(hf, ours, batch, image=ids["image_token_id"], video=ids["video_token_id"])


# ----- packing ----------------------------------------------------------------------------------------------------
def test_packed_rows_with_a_video_give_each_token_its_unpacked_loss(tokenizer_dir, data):
    records = [
        *_records(),
        llava_record("<video>count them", "yes", video="clip.mp4"),
        llava_record("a blue square", "yes"),
    ]
    train = write_jsonl(data / "train.jsonl", records)
    plain, packed = _dm(tokenizer_dir, train), _dm(tokenizer_dir, train, pack=True)
    rows = packed.train_dataset
    assert len(rows) < len(records)
    batch = packed.collate_fn([rows[i] for i in range(len(rows))])
    assert batch["video_grid_thw"].tolist() == [GRID] * 3 and batch["position_ids"].shape[0] == 3

    torch.manual_seed(0)
    vlm = VisionLanguageModel(VLMConfig.from_hf(_hf_config(plain).to_dict())).float()
    with torch.no_grad():
        for p in vlm.parameters():
            p.normal_(0, 0.1) if p.ndim > 1 else p.uniform_(0.5, 1.5)
        # the host-side positions (every frame its own item) are those the model computes from the grids
        without = {k: v for k, v in batch.items() if k != "position_ids"}
        torch.testing.assert_close(token_losses(vlm, batch), token_losses(vlm, without), atol=1e-6, rtol=0)
    ours, reference = per_sample_losses(vlm, packed), per_sample_losses(vlm, plain)
    assert ours.keys() == reference.keys()
    for i, losses in reference.items():
        torch.testing.assert_close(ours[i], losses, atol=1e-5, rtol=1e-5, msg=f"sample {i}")


# ----- bad videos and generation references -----------------------------------------------------------------------
def test_a_too_short_video_is_named_and_counted(tokenizer_dir, data):
    write_clip(data / "short.mp4", num_frames=1)
    records = [
        llava_record("<video>hi", "yes", video="clip.mp4"),
        llava_record("<video>hi", "yes", video="short.mp4"),
    ]
    train = write_jsonl(data / "train.jsonl", records)
    report = _dm(tokenizer_dir, train).reports["train"]
    assert (report.records, report.kept, report.videos) == (2, 1, 1)
    assert report.skipped["unsupported video"] == [
        f"{train}:2: short.mp4: a video of 1 frames gives 1 sampled frame(s) (fps 2.0, num_frames None), fewer "
        "than one temporal patch (2): use a longer video"
    ]
    with pytest.raises(BadSampleError, match=f"^{train}:2: short.mp4: a video of 1 frames") as raised:
        _dm(tokenizer_dir, train, on_bad_sample="error")
    assert raised.value.reason == "unsupported video"


def test_generation_references_carry_the_prompt_videos(tokenizer_dir, data):
    turns = [
        {"from": "human", "value": "<video>how many shapes?"},
        {"from": "gpt", "value": "two"},
        {"from": "human", "value": "<image><video>what colour is it"},
        {"from": "gpt", "value": "red"},
    ]
    record = {"video": ["clip.mp4", "clip.mp4"], "image": "a.png", "conversations": turns}
    val = write_jsonl(data / "val.jsonl", [record])
    dm = _dm(tokenizer_dir, val, val_files=str(val), seq_length=256)
    (reference,) = dm.generation_references("val")
    sample = dm.val_dataset[0]
    prompt = torch.tensor(reference.prompt_ids)
    assert torch.equal(prompt, sample["input_ids"][: len(prompt)])
    for key, value in reference.inputs.items():
        assert torch.equal(value, sample[key]), key

    assert reference.reference == "red"
    assert reference.inputs["video_grid_thw"].tolist() == [GRID, GRID]
    assert reference.inputs["image_grid_thw"].tolist() == sample["image_grid_thw"].tolist()

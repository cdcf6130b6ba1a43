"""LLaVA-OneVision in ``VLMDataModule`` (``processor: llava_onevision``): tiles equal (``torch.equal``) to transformers'
``LlavaOnevisionImageProcessorPil`` for single images of several sizes and modes, multi-image samples and the
released geometry; token ids equal to ``LlavaOnevisionProcessor``'s on the same chat text; videos sampled as
transformers' ``default_sample_indices_fn`` with the processor's token count; a data-module batch (multi-image,
video, single image, text only) through a tiny OneVision ``VisionLanguageModel`` equal to
``LlavaOnevisionForConditionalGeneration`` on transformers' processor output (logits 1e-4, loss 1e-5, every gradient
1e-4); packed rows with each token's unpacked loss and ``forge-data vlm-pack``'s bins; ``trainer.fit`` on the
records; bad samples named and counted."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from llava_parity import GRAD_TOL, LOGITS_TOL, LOSS_TOL, hf_name, randomize
from PIL import Image
from tiny import TINY_QWEN3_TEXT, TINY_SIGLIP_VISION, VLM_SPECIAL_TOKENS, write_vlm_tokenizer
from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
from transformers import SiglipVisionConfig as HFSiglipVisionConfig
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor
from transformers.processing_utils import ProcessorMixin
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from forge_lightning.datamodules.tokenizer import load_tokenizer
from forge_lightning.datamodules.vlm import BadSampleError, VLMDataModule, vlm_collate
from forge_lightning.datamodules.vlm.anyres_processor import (
    LlavaOnevisionImageProcessor,
    UniformFrameSampling,
)
from forge_lightning.datamodules.vlm.video import VideoInfo
from forge_lightning.modules.vlm import from_pretrained
from forge_lightning.modules.vlm.anyres import num_video_tokens
from forge_lightning.sim.video import write_video
from forge_lightning.tools.data import main as forge_data

SIZE = TINY_SIGLIP_VISION["image_size"]  # 16: tiles of 4 x 4 features
PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32], [16, 48], [48, 16], [48, 48]]
ASPECT = "anyres_max_2"
GEOMETRY = dict(image_size=SIZE, patch_size=4, image_grid_pinpoints=PINPOINTS, vision_aspect_ratio=ASPECT)
# (width, height): wide, tall and large (3 x 3 tiles), exactly one tile, a thin sliver, an odd size.
IMAGES = {"a.png": (30, 8), "b.png": (30, 50), "c.png": (16, 16), "d.png": (7, 33), "e.jpg": (41, 23)}
FRAMES, FPS, NUM_FRAMES = 13, 5, 4
IGNORE = -100


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_vlm_tokenizer(
        tmp_path_factory.mktemp("tokenizer"), image_tokens=(*VLM_SPECIAL_TOKENS, "<video>")
    )


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir).backend


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The :data:`IMAGES` (``a.png`` RGBA, ``d.png`` grey) and ``clip.mp4`` (13 frames of 56 x 40 at 5 fps)."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    modes = {"a.png": "RGBA", "d.png": "L"}
    for name, (width, height) in IMAGES.items():
        rgba = rng.integers(0, 255, (height, width, 4), dtype=np.uint8)
        rgba[..., 3] = np.maximum(rgba[..., 3], 40)
        Image.fromarray(rgba, "RGBA").convert(modes.get(name, "RGB")).save(root / name)
    frames = [rng.integers(0, 255, (40, 56, 3), dtype=np.uint8) for _ in range(FRAMES)]
    write_video(root / "clip.mp4", frames, fps=FPS, min_size=1)
    return root


def _hf_image_processor(**geometry) -> LlavaOnevisionImageProcessorPil:
    size = geometry.pop("image_size", SIZE)
    pinpoints = geometry.pop("image_grid_pinpoints", PINPOINTS)
    return LlavaOnevisionImageProcessorPil(
        size={"height": size, "width": size}, image_grid_pinpoints=pinpoints
    )


def _images(data: Path, names) -> list[Image.Image]:
    return [Image.open(data / name) for name in names]


def _unpadded(theirs: dict) -> torch.Tensor:
    """transformers' ``[images, max_tiles, 3, S, S]`` without its padding tiles (our layout)."""
    counts = [
        LlavaOnevisionImageProcessor(**GEOMETRY).num_tiles(h, w, n == 1)
        for (h, w), n in zip(
            theirs["image_sizes"].tolist(),
            [n for n in theirs["batch_num_images"].tolist() for _ in range(n)],
        )
    ]
    return torch.cat([p[:n] for p, n in zip(theirs["pixel_values"], counts)])


# ----- the image processor ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(IMAGES))
def test_a_single_image_equals_transformers(data, name: str) -> None:
    ours = LlavaOnevisionImageProcessor(**GEOMETRY).preprocess_images(_images(data, [name]))
    theirs = _hf_image_processor()(_images(data, [name]), return_tensors="pt")
    assert torch.equal(ours["pixel_values"], _unpadded(theirs))
    assert torch.equal(ours["image_sizes"], theirs["image_sizes"])
    assert ours["batch_num_images"].tolist() == theirs["batch_num_images"].tolist() == [1]


def test_a_multi_image_sample_equals_transformers(data) -> None:
    """Each image of a sample of several: padded to a square of the mean colour, one tile."""
    names = ["a.png", "b.png", "d.png", "e.jpg"]
    ours = LlavaOnevisionImageProcessor(**GEOMETRY).preprocess_images(_images(data, names))
    theirs = _hf_image_processor()([_images(data, names)], return_tensors="pt")
    assert theirs["pixel_values"].shape == (4, 1, 3, SIZE, SIZE)
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"][:, 0])
    assert torch.equal(ours["image_sizes"], theirs["image_sizes"])
    assert ours["batch_num_images"].tolist() == theirs["batch_num_images"].tolist() == [4]


def test_the_released_geometry_equals_transformers() -> None:
    """384-pixel tiles, the 36 default pinpoints: an image tiled 1 x 2 and one tiled 3 x 1."""
    rng = np.random.default_rng(3)
    images = [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(300, 700), (900, 250)]
    ]
    processor = LlavaOnevisionImageProcessor()
    assert len(processor.image_grid_pinpoints) == 36 and processor.grid_side == 27
    hf = LlavaOnevisionImageProcessorPil()
    for image in images:
        ours = processor.preprocess_images([image])["pixel_values"]
        theirs = hf([image], return_tensors="pt")["pixel_values"][0]
        assert ours.shape[0] in (3, 4) and torch.equal(ours, theirs[: ours.shape[0]])


def test_option_errors_name_the_option() -> None:
    with pytest.raises(
        ValueError, match=r"image_grid_pinpoints must be \[height, width\] pairs of positive multiples"
    ):
        LlavaOnevisionImageProcessor(image_size=16, patch_size=4, image_grid_pinpoints=[[16, 20]])
    with pytest.raises(ValueError, match=r"vision_aspect_ratio \('anyres'\) must be 'anyres_max_N'"):
        LlavaOnevisionImageProcessor(vision_aspect_ratio="anyres")
    with pytest.raises(ValueError, match=r"patch_size \(17\) must be positive and at most image_size \(16\)"):
        LlavaOnevisionImageProcessor(image_size=16, patch_size=17)
    with pytest.raises(ValueError, match=r"video_num_frames \(0\) must be positive"):
        UniformFrameSampling(0)


def test_frame_sampling_is_transformers(data) -> None:
    for total, count in [(13, 4), (13, 13), (100, 32), (7, 3)]:
        info = VideoInfo(total, 5.0, 56, 40)
        theirs = default_sample_indices_fn(VideoMetadata(total_num_frames=total, fps=5.0), num_frames=count)
        assert UniformFrameSampling(count).indices(info) == theirs.tolist()
    with pytest.raises(ValueError, match=r"a video of 13 frames cannot give 14 sampled frames"):
        UniformFrameSampling(14).indices(VideoInfo(13, 5.0, 56, 40))


# ----- the data module ----------------------------------------------------------------------------------------
def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _datamodule(tokenizer_dir: Path, train: Path, **options) -> VLMDataModule:
    options = {
        "processor": "llava_onevision",
        **GEOMETRY,
        "video_num_frames": NUM_FRAMES,
        "num_workers": 0,
        "pin_memory": False,
        "batch_size": 4,
        "seq_length": 256,
        **options,
    }
    dm = VLMDataModule(str(train), str(tokenizer_dir), **options)
    dm.setup("fit")
    return dm


def _record(question: str, answer: str, **media) -> dict:
    return {
        **media,
        "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
    }


RECORDS = [
    _record("<image>\nwhat colour is the triangle?<image>", "red", image=["a.png", "b.png"]),
    _record("<video>\nhow many shapes?", "two", video="clip.mp4"),
    _record("describe the image: <image>", "a small shape", image="e.jpg"),
    _record("hello", "goodbye"),
]
MEDIA = [["a.png", "b.png"], [], ["e.jpg"], []]


def _chat_text(tokenizer, record: dict) -> str:
    """The record's chat text as a transformers user writes it for the processor: ``<image>`` / ``<video>``."""
    roles = {"human": "user", "gpt": "assistant"}
    messages = [{"role": roles[m["from"]], "content": m["value"]} for m in record["conversations"]]
    return tokenizer.apply_chat_template(messages, tokenize=False)


@pytest.fixture
def hf_processor(tokenizer, monkeypatch) -> LlavaOnevisionProcessor:
    """transformers' processor with the PIL image processor and no video processor (it needs torchvision)."""
    check = ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(
        ProcessorMixin,
        "check_argument_for_proper_class",
        lambda self, name, arg: None if arg is None else check(self, name, arg),
    )
    return LlavaOnevisionProcessor(
        image_processor=_hf_image_processor(),
        tokenizer=tokenizer,
        video_processor=None,
        num_image_tokens=(SIZE // 4) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=ASPECT,
    )


def _hf_inputs(hf_processor, tokenizer, data: Path, video_tokens: int) -> dict[str, torch.Tensor]:
    """transformers' processor on the records' chat texts and images, right-padded; the video row's ``<video>``
    written out as its tokens (the processor expands videos only with its torchvision video processor)."""
    texts = [_chat_text(tokenizer, r).replace("<video>", "<video>" * video_tokens) for r in RECORDS]
    tokenizer.pad_token = tokenizer.eos_token
    hf_processor.video_token = None  # the written-out <video> tokens are text to it, not videos it lacks
    return hf_processor(
        text=texts, images=[_images(data, m) for m in MEDIA], return_tensors="pt", padding=True
    ).data


def test_token_ids_and_pixels_equal_the_processor(tokenizer_dir, tokenizer, data, hf_processor) -> None:
    dm = _datamodule(tokenizer_dir, _write(data / "train.jsonl", RECORDS))
    samples = [dm.train_dataset[i] for i in range(4)]
    video_tokens = num_video_tokens(dm.vision.processor, NUM_FRAMES)
    theirs = _hf_inputs(hf_processor, tokenizer, data, video_tokens)
    image_id, video_id = (
        tokenizer.convert_tokens_to_ids("<image>"),
        tokenizer.convert_tokens_to_ids("<video>"),
    )
    assert dm.special_token_ids == {"image_token_id": image_id, "video_token_id": video_id}
    for row, sample in enumerate(samples):
        n = int(theirs["attention_mask"][row].sum())
        assert (
            sample["input_ids"].tolist() == theirs["input_ids"][row, : n - 1].tolist()
        )  # ours: shifted inputs
    single = dm.vision.processor.num_image_tokens(23, 41)  # e.jpg: 2 x 3 tiles of 4 x 4, cropped, shrunk
    assert [int((s["input_ids"] == image_id).sum()) for s in samples] == [2 * (16 + 1), 0, single, 0]
    assert int((samples[1]["input_ids"] == video_id).sum()) == video_tokens == NUM_FRAMES * 2 * 2 + 1
    batch = vlm_collate(samples, pad_id=dm.pad_id)
    assert set(batch) == {
        "input_ids",
        "attention_mask",
        "labels",
        "pixel_values",
        "image_sizes",
        "batch_num_images",
        "pixel_values_videos",
    }
    assert torch.equal(batch["pixel_values"], _unpadded(theirs))
    assert torch.equal(batch["image_sizes"], theirs["image_sizes"])
    assert batch["batch_num_images"].tolist() == theirs["batch_num_images"].tolist() == [2, 1]
    assert batch["pixel_values_videos"].shape == (1, NUM_FRAMES, 3, SIZE, SIZE)


def test_video_frames_are_the_sampled_frames(tokenizer_dir, data) -> None:
    """The frames PyAV decodes at transformers' indices, each resized to the tile size and normalised."""
    dm = _datamodule(tokenizer_dir, _write(data / "video.jsonl", [RECORDS[1]]))
    with av.open(str(data / "clip.mp4")) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    indices = default_sample_indices_fn(
        VideoMetadata(total_num_frames=FRAMES, fps=FPS), num_frames=NUM_FRAMES
    )
    expected = LlavaOnevisionImageProcessor(**GEOMETRY).preprocess_video(decoded[indices])
    assert torch.equal(dm.train_dataset[0]["pixel_values_videos"][0], expected)


def _hf_model(tokenizer, path: Path) -> LlavaOnevisionForConditionalGeneration:
    config = LlavaOnevisionConfig(
        vision_config=HFSiglipVisionConfig(**TINY_SIGLIP_VISION, vision_use_head=False),
        text_config={**TINY_QWEN3_TEXT, "model_type": "qwen2", "vocab_size": len(tokenizer)},
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio=ASPECT,
    )
    hf = randomize(LlavaOnevisionForConditionalGeneration(config))
    hf.save_pretrained(path)
    return hf


def test_a_batch_through_the_model_matches_transformers(
    tokenizer_dir, tokenizer, data, hf_processor, tmp_path
):
    """Our batch through our model, transformers' processor output (plus our video frames) through theirs."""
    dm = _datamodule(tokenizer_dir, _write(data / "train.jsonl", RECORDS))
    batch = vlm_collate([dm.train_dataset[i] for i in range(4)], pad_id=dm.pad_id)
    hf = _hf_model(tokenizer, tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    theirs = _hf_inputs(hf_processor, tokenizer, data, num_video_tokens(dm.vision.processor, NUM_FRAMES))
    theirs["pixel_values_videos"] = batch["pixel_values_videos"]
    keys = (
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_sizes",
        "batch_num_images",
        "pixel_values_videos",
    )
    logits = model(**{k: batch[k] for k in keys})
    hf_logits = hf(**theirs).logits[:, :-1]  # ours are the shifted inputs: one position shorter
    keep = batch["attention_mask"].bool()
    assert (logits - hf_logits[:, : logits.shape[1]])[keep].abs().max().item() <= LOGITS_TOL

    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
    hf_loss = F.cross_entropy(
        hf_logits[:, : logits.shape[1]].flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE
    )
    assert abs(loss.item() - hf_loss.item()) <= LOSS_TOL * hf_loss.item()
    loss.backward()
    hf_loss.backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    for name, p in model.named_parameters():
        want = hf_grads[hf_name(name)]
        if want is None:
            assert p.grad is None, name
            continue
        rel = ((p.grad - want).norm() / want.norm()).item()
        assert rel <= GRAD_TOL, f"{name}: relative gradient error {rel:.2e}"


def _token_losses(model, batch: dict) -> torch.Tensor:
    keys = ("input_ids", "attention_mask", "pixel_values", "image_sizes", "batch_num_images")
    keys += ("pixel_values_videos", "document_ids")
    logits = model(**{k: batch[k] for k in keys if k in batch})
    losses = F.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE, reduction="none"
    )
    return losses.view(batch["labels"].shape)


def test_packed_rows_give_each_token_its_unpacked_loss(tokenizer_dir, tokenizer, data, tmp_path) -> None:
    """Rows that hold a multi-image sample beside a single image keep each sample's tiling; ``forge-data
    vlm-pack`` with the tile geometry gives the same rows."""
    train = _write(data / "train.jsonl", RECORDS * 2)
    plain, packed = _datamodule(tokenizer_dir, train), _datamodule(tokenizer_dir, train, pack=True)
    rows = packed.train_dataset
    counts = [[len(rows.dataset.samples[i].images) for i in b] for b in rows.bins]
    assert any(2 in c and 1 in c for c in counts), counts
    _hf_model(tokenizer, tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        reference = _token_losses(model, plain.collate_fn([plain.train_dataset[i] for i in range(8)]))
        ours = _token_losses(model, packed.collate_fn([rows[i] for i in range(len(rows))]))
    for row, members in enumerate(rows.bins):
        cursor = 0
        for i in members:
            n = plain.train_dataset.lengths[i]
            torch.testing.assert_close(ours[row, cursor : cursor + n], reference[i, :n], atol=1e-5, rtol=1e-5)
            cursor += n

    out = tmp_path / "bins.jsonl"
    argv = ["vlm-pack", "--input", str(train), "--tokenizer", str(tokenizer_dir), "--output", str(out)]
    argv += [
        "--processor",
        "llava_onevision",
        "--image-size",
        "16",
        "--patch-size",
        "4",
        "--seq-length",
        "256",
    ]
    argv += ["--image-grid-pinpoints", json.dumps(PINPOINTS), "--vision-aspect-ratio", ASPECT]
    forge_data([*argv, "--video-num-frames", str(NUM_FRAMES)])
    assert _datamodule(tokenizer_dir, train, packed_bins=str(out)).train_dataset.bins == rows.bins


def test_fine_tuning_through_the_data_module(tokenizer_dir, tokenizer, data, tmp_path) -> None:
    """``trainer.fit`` of a OneVision checkpoint on image, multi-image, video and text records lowers the loss; the
    module's setup accepts the data's token ids, and the export loads in transformers."""
    import lightning.pytorch as pl

    from forge_lightning.modules.vlm import VisionLanguageModule

    _hf_model(tokenizer, tmp_path / "hf")
    module = VisionLanguageModule(
        pretrained=str(tmp_path / "hf"),
        optimizer={"lr": 3e-3, "weight_decay": 0.0},
        scheduler={"name": "constant", "warmup_steps": 0},
    )
    dm = _datamodule(tokenizer_dir, _write(data / "train.jsonl", RECORDS))
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        before = (lambda s: (s[0] / s[1]).item())(module.loss_sum(batch))
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=dm)
    with torch.no_grad():
        after = (lambda s: (s[0] / s[1]).item())(module.loss_sum(batch))
    assert after < 0.8 * before, (before, after)
    module.save_pretrained(tmp_path / "out")
    again = LlavaOnevisionForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    keys = (
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_sizes",
        "batch_num_images",
        "pixel_values_videos",
    )
    with torch.no_grad():
        ours = module.model.eval()(**{k: batch[k] for k in keys})
        theirs = again(**{k: batch[k] for k in keys}).logits
    assert (ours - theirs)[batch["attention_mask"].bool()].abs().max().item() <= LOGITS_TOL


def test_bad_samples_are_named_and_counted(tokenizer_dir, data, caplog) -> None:
    (data / "broken.png").write_bytes(b"not a png")
    records = [
        RECORDS[2],
        _record("<image>", "x", image="missing.png"),
        _record("<image>", "x", image="broken.png"),
        _record("<image><image>", "x", image="e.jpg"),
        _record("<video>", "x", video="clip.mp4"),  # fine
        _record("<image>" + " hello" * 120, "x", image="b.png"),
    ]
    train = _write(data / "bad.jsonl", records)
    dm = _datamodule(tokenizer_dir, train, seq_length=200, video_num_frames=NUM_FRAMES)
    assert len(dm.train_dataset) == 2
    report = caplog.text
    for reason in ("missing image", "corrupt image", "image count mismatch", "too long"):
        assert reason in report, reason
    with pytest.raises(BadSampleError, match=r"bad.jsonl:2: .*missing.png"):
        _datamodule(tokenizer_dir, train, on_bad_sample="error")
    short = _write(data / "short.jsonl", [RECORDS[1]])
    with pytest.raises(BadSampleError, match=r"a video of 13 frames cannot give 20 sampled frames"):
        _datamodule(tokenizer_dir, short, video_num_frames=20, on_bad_sample="error")
    with pytest.raises(ValueError, match=r"min_pixels do\(es\) not apply to processor 'llava_onevision'"):
        VLMDataModule(str(short), str(tokenizer_dir), processor="llava_onevision", min_pixels=100)

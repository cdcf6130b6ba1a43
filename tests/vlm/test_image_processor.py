"""The Qwen2-VL image / video processor against transformers' PIL backend (``Qwen2VLImageProcessorPil``, what
``Qwen2VLImageProcessor`` falls back to without torchvision): ``smart_resize`` on a sweep of sizes and limits,
pixel values ``torch.equal`` on synthetic images of several sizes, modes and pixel limits, video frames
against transformers' per-frame output in its video layout, token counts, and the errors."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_vl_parity import hf_video_rows

from forge_lightning.datamodules.vlm import Qwen2VLImageProcessor, num_merged_tokens, smart_resize
from forge_lightning.datamodules.vlm.video import VideoInfo, VideoSampling, probe_video, read_video

hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

PIXEL_LIMITS = {  # (min_pixels, max_pixels)
    "default": (56 * 56, 28 * 28 * 1280),
    "downscale": (56 * 56, 28 * 28 * 16),
    "upscale": (28 * 28 * 256, 28 * 28 * 1024),
    "checkpoint": (3136, 12845056),  # Qwen2-VL / Qwen2.5-VL preprocessor_config.json
}


def _image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Noise over a gradient (noise makes bicubic overshoot and clip), alpha varying, in ``mode``."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 160, width)[None, :, None] + np.linspace(0, 60, height)[:, None, None]
    rgba = (ramp + rng.integers(0, 96, (height, width, 4))).clip(0, 255).astype(np.uint8)
    if mode == "RGBA":
        return Image.fromarray(rgba)
    if mode == "LA":
        return Image.fromarray(rgba[..., [0, 3]])
    rgb = Image.fromarray(rgba[..., :3])
    if mode == "P":  # a palette image whose entry 0 is transparent
        palette = rgb.quantize(16)
        palette.info["transparency"] = 0
        return palette
    return rgb.convert(mode)


def _hf(**limits: int):
    return hf_pil.Qwen2VLImageProcessorPil(**limits)


def _limits(name: str) -> dict[str, int]:
    min_pixels, max_pixels = PIXEL_LIMITS[name]
    return {"min_pixels": min_pixels, "max_pixels": max_pixels}


# ----- smart_resize ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factor", [28, 32])
@pytest.mark.parametrize("limits", PIXEL_LIMITS)
def test_smart_resize_matches_transformers(factor, limits):
    sides = [1, 2, 13, 27, 28, 29, 41, 42, 55, 56, 70, 97, 224, 300, 480, 640, 1000, 1023, 4000, 9999]
    min_pixels, max_pixels = PIXEL_LIMITS[limits]
    for height in sides:
        for width in sides:
            try:
                expected = hf_pil.smart_resize(height, width, factor, min_pixels, max_pixels)
            except ValueError:
                with pytest.raises(ValueError, match="aspect ratio"):
                    smart_resize(height, width, factor, min_pixels, max_pixels)
                continue
            assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected, (height, width)


def test_smart_resize_rounds_halves_to_even_and_upscales_tiny_images():
    assert smart_resize(42, 70) == (56, 56)  # 1.5 and 2.5 factors both round to 2
    assert smart_resize(1, 1) == (56, 56)  # upscaled to min_pixels, not refused
    assert smart_resize(1, 200) == (28, 812)  # a ratio of exactly 200 is accepted


# ----- images ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [(224, 224), (480, 640), (640, 480), (97, 300), (300, 97), (1, 1), (1, 150)])
def test_image_matches_transformers(size):
    image = _image(*size)
    expected = _hf()(images=[image], return_tensors="pt")
    out = Qwen2VLImageProcessor().preprocess_images([image])
    assert out["pixel_values"].dtype == torch.float32
    assert torch.equal(out["pixel_values"], expected["pixel_values"])
    assert torch.equal(out["image_grid_thw"], expected["image_grid_thw"])


@pytest.mark.parametrize("mode", ["L", "RGBA", "LA", "P", "CMYK"])
def test_image_modes_match_transformers(mode):
    image = _image(97, 130, mode)
    assert image.mode == mode
    expected = _hf()(images=[image], return_tensors="pt")
    out = Qwen2VLImageProcessor().preprocess_images([image])
    assert torch.equal(out["pixel_values"], expected["pixel_values"])
    assert torch.equal(out["image_grid_thw"], expected["image_grid_thw"])


@pytest.mark.parametrize("limits", ["downscale", "upscale", "checkpoint"])
def test_pixel_limits_match_transformers(limits):
    images = [_image(480, 640, seed=1), _image(56, 56, seed=2), _image(97, 300, "RGBA", seed=3)]
    expected = _hf(**_limits(limits))(images=images, return_tensors="pt")
    out = Qwen2VLImageProcessor(**_limits(limits)).preprocess_images(images)
    assert torch.equal(out["pixel_values"], expected["pixel_values"])
    assert torch.equal(out["image_grid_thw"], expected["image_grid_thw"])
    min_pixels, max_pixels = PIXEL_LIMITS[limits]
    pixels = out["image_grid_thw"][:, 1:].prod(-1) * 14**2
    assert ((pixels >= min_pixels) & (pixels <= max_pixels)).all()
    if limits == "downscale":
        assert out["image_grid_thw"][0].tolist() == [1, 6, 8]  # 480x640 -> 84x112
    if limits == "upscale":
        assert out["image_grid_thw"][1].tolist() == [1, 32, 32]  # 56x56 -> 448x448


def test_several_images_concatenate_in_order():
    images = [_image(224, 224, seed=4), _image(97, 300, "L", seed=5), _image(640, 480, seed=6)]
    processor = Qwen2VLImageProcessor()
    out = processor.preprocess_images(images)
    expected = _hf()(images=images, return_tensors="pt")
    assert torch.equal(out["pixel_values"], expected["pixel_values"])
    assert torch.equal(out["image_grid_thw"], expected["image_grid_thw"])
    alone = torch.cat([processor.preprocess_images([image])["pixel_values"] for image in images])
    assert torch.equal(out["pixel_values"], alone)
    assert out["pixel_values"].shape == (int(out["image_grid_thw"].prod(-1).sum()), processor.patch_dim)


def test_processor_pickles_for_loader_workers():
    processor = Qwen2VLImageProcessor(max_pixels=28 * 28 * 64, resample="bilinear")
    clone = pickle.loads(pickle.dumps(processor))
    assert clone == processor
    image = _image(97, 300)
    assert torch.equal(
        clone.preprocess_images([image])["pixel_values"], processor.preprocess_images([image])["pixel_values"]
    )


def test_image_fills_its_temporal_patch_with_copies():
    processor = Qwen2VLImageProcessor()
    rows = processor.preprocess_images([_image(97, 300)])["pixel_values"]
    rows_NCSPP = rows.reshape(len(rows), 3, processor.temporal_patch_size, 14, 14)
    assert torch.equal(rows_NCSPP[:, :, 0], rows_NCSPP[:, :, 1])


# ----- videos ------------------------------------------------------------------------------------------------
def _expected_video(frames: list[Image.Image], processor: Qwen2VLImageProcessor) -> tuple[torch.Tensor, list]:
    hf = _hf(min_pixels=processor.video_min_pixels, max_pixels=processor.video_max_pixels)
    return hf_video_rows(frames, hf, processor.temporal_patch_size)


@pytest.mark.parametrize("num_frames", [3, 4])
@pytest.mark.parametrize("as_array", [False, True])
def test_video_matches_transformers_layout(num_frames, as_array):
    processor = Qwen2VLImageProcessor()
    frames = [_image(240, 320, seed=10 + t) for t in range(num_frames)]
    video = np.stack([np.asarray(f) for f in frames]) if as_array else frames
    out = processor.preprocess_videos([video])
    expected, grid = _expected_video(frames, processor)
    assert grid == [math.ceil(num_frames / 2), 20, 28]  # 240x320 -> 280x392: up to video_min_pixels
    assert out["video_grid_thw"].tolist() == [grid]
    assert torch.equal(out["pixel_values_videos"], expected)


def test_videos_of_tensors_grey_frames_and_several_videos():
    processor = Qwen2VLImageProcessor(video_min_pixels=56 * 56, video_max_pixels=28 * 28 * 64)
    grey = [_image(97, 130, "L", seed=20 + t) for t in range(3)]
    rgb = [_image(200, 150, seed=30 + t) for t in range(2)]
    grey_array = torch.from_numpy(np.stack([np.asarray(f) for f in grey]))[..., None]  # [T, H, W, 1]
    out = processor.preprocess_videos([grey_array, rgb])
    rows = [_expected_video(grey, processor), _expected_video(rgb, processor)]
    assert torch.equal(out["pixel_values_videos"], torch.cat([r for r, _ in rows]))
    assert out["video_grid_thw"].tolist() == [g for _, g in rows]
    assert [processor.video_grid(3, 97, 130), processor.video_grid(2, 200, 150)] == [
        tuple(g) for _, g in rows
    ]


# ----- token counts ------------------------------------------------------------------------------------------
def test_merged_token_counts():
    processor = Qwen2VLImageProcessor()
    sizes = [(224, 224), (480, 640), (97, 300)]
    out = processor.preprocess_images([_image(*s) for s in sizes])
    counts = processor.num_tokens(out["image_grid_thw"])
    assert torch.equal(counts, num_merged_tokens(out["image_grid_thw"], 2))
    assert counts.tolist() == [_hf().get_number_of_image_patches(*s) // 4 for s in sizes] == [64, 391, 33]
    assert int(counts.sum()) * 4 == len(out["pixel_values"])
    assert [processor.image_grid(*s) for s in sizes] == [tuple(g) for g in out["image_grid_thw"].tolist()]
    video = processor.preprocess_videos([np.zeros((5, 240, 320, 3), np.uint8)])
    assert processor.num_tokens(video["video_grid_thw"]).tolist() == [3 * 20 * 28 // 4]


# ----- errors ------------------------------------------------------------------------------------------------
def test_errors_for_aspect_ratio_and_empty_images():
    processor = Qwen2VLImageProcessor()
    with pytest.raises(ValueError, match=r"1x201 .*aspect ratio of 201; .* at most 200"):
        processor.preprocess_images([_image(1, 201)])
    with pytest.raises(ValueError, match="aspect ratio of 233.333"):
        processor.preprocess_images([_image(700, 3)])
    with pytest.raises(ValueError, match="aspect ratio"):
        processor.preprocess_videos([np.zeros((2, 2, 500, 3), np.uint8)])
    with pytest.raises(ValueError, match=r"image of 0x10 .* is empty"):
        processor.preprocess_images([Image.new("RGB", (10, 0))])
    with pytest.raises(ValueError, match="is empty"):
        smart_resize(5, 0)


def test_errors_for_inputs():
    processor = Qwen2VLImageProcessor()
    with pytest.raises(ValueError, match="non-empty sequence of Pillow images"):
        processor.preprocess_images(_image(28, 28))
    with pytest.raises(TypeError, match=r"images\[1\] is a ndarray"):
        processor.preprocess_images([_image(28, 28), np.zeros((28, 28, 3), np.uint8)])
    with pytest.raises(TypeError, match=r"videos\[0\] must be a list of Pillow frames .* pass \[frames\]"):
        processor.preprocess_videos([_image(28, 28), _image(28, 28)])
    with pytest.raises(ValueError, match="sequence of videos"):
        processor.preprocess_videos(np.zeros((2, 28, 28, 3), np.uint8))
    with pytest.raises(ValueError, match=r"videos\[0\] is a float32 array of shape \[2, 28, 28, 3\]"):
        processor.preprocess_videos([np.zeros((2, 28, 28, 3), np.float32)])
    with pytest.raises(ValueError, match=r"videos\[0\] is a uint8 array of shape \[2, 28, 28, 4\]"):
        processor.preprocess_videos([np.zeros((2, 28, 28, 4), np.uint8)])
    with pytest.raises(ValueError, match=r"videos\[0\] has no frames"):
        processor.preprocess_videos([[]])
    with pytest.raises(ValueError, match=r"videos\[0\] has frames of several sizes"):
        processor.preprocess_videos([[_image(28, 28), _image(28, 56)]])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"min_pixels": 0}, r"min_pixels \(0\) must be positive"),
        (
            {"max_pixels": 1000, "min_pixels": 2000},
            r"max_pixels \(1000\) must be at least min_pixels \(2000\)",
        ),
        ({"video_max_pixels": 1000}, r"video_max_pixels \(1000\) must be at least video_min_pixels"),
        ({"merge_size": 0}, r"merge_size \(0\) must be positive"),
        ({"image_mean": (0.5, 0.5)}, "one value per RGB channel"),
        ({"image_std": (0.5, 0.0, 0.5)}, "image_std .* must be positive"),
        ({"resample": "cubic"}, r"resample \('cubic'\) must be one of \[.*'bicubic'"),
    ],
)
def test_config_errors(options, match):
    with pytest.raises(ValueError, match=match):
        Qwen2VLImageProcessor(**options)


def test_resample_is_a_pillow_filter_name():
    image = _image(97, 300)
    hf = hf_pil.Qwen2VLImageProcessorPil(resample=Image.Resampling.LANCZOS)
    out = Qwen2VLImageProcessor(resample="LANCZOS").preprocess_images([image])
    assert torch.equal(out["pixel_values"], hf(images=[image], return_tensors="pt")["pixel_values"])


# ----- video files -------------------------------------------------------------------------------------------
def _write_video(path, num_frames: int, fps: int, height: int = 72, width: int = 96):
    from forge_lightning.sim.video import write_video

    return write_video(
        path, [np.asarray(_image(height, width, seed=50 + t)) for t in range(num_frames)], fps=fps, min_size=1
    )


@pytest.mark.parametrize(
    ("sampling", "indices"),
    [
        # transformers' sample_frames on 23 frames at 10 fps: 23 / 10 * 2 = 4.6 -> 4 frames, arange(0, 23, 5.75)
        ({"fps": 2.0}, [0, 5, 11, 17]),
        ({"fps": 0.5}, [0, 5, 11, 17]),  # 1.15 frames, raised to min_frames 4
        ({"fps": 6.0}, [0, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21]),  # 13.8 -> 12
        ({"num_frames": 5}, [0, 5, 11, 17]),  # rounded to a multiple of temporal_patch_size
        ({"num_frames": 6}, [0, 3, 7, 11, 15, 19]),
        ({"fps": 100.0}, list(range(22))),  # capped at the frame count, floored to a multiple of 2
    ],
)
def test_video_frame_sampling_follows_transformers(sampling, indices):
    info = VideoInfo(num_frames=23, fps=10.0, width=96, height=72)
    assert VideoSampling(**sampling).indices(info) == indices


def test_video_file_frames_and_pixels(tmp_path):
    import av

    path = _write_video(tmp_path / "clip.mp4", num_frames=23, fps=10)
    info = probe_video(path)
    assert info == VideoInfo(num_frames=23, fps=10.0, width=96, height=72)
    with av.open(str(path)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    sampling = VideoSampling(fps=2.0)
    frames = read_video(path, sampling)
    assert frames.shape == (4, 72, 96, 3) and frames.dtype == np.uint8
    assert np.array_equal(frames, np.stack([decoded[i] for i in [0, 5, 11, 17]]))
    processor = Qwen2VLImageProcessor(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 16)
    out = processor.preprocess_videos([frames])
    expected, grid = _expected_video([Image.fromarray(decoded[i]) for i in [0, 5, 11, 17]], processor)
    assert out["video_grid_thw"].tolist() == [grid] == [[2, 6, 6]]  # 72x96 -> 84x84
    assert torch.equal(out["pixel_values_videos"], expected)
    # transformers' sampled_fps: 4 of 23 frames at 10 fps are 1.74 frames per second, not the 2 asked for
    assert sampling.seconds_per_grid(info) == pytest.approx(2 / (4 * 10 / 23))
    assert VideoSampling(num_frames=6).seconds_per_grid(info) == pytest.approx(2 / (6 * 10 / 23))


def test_video_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.mp4 not found"):
        probe_video(tmp_path / "nope.mp4")
    (tmp_path / "bad.mp4").write_bytes(b"not a video" * 10)
    with pytest.raises(ValueError, match=r"bad\.mp4 cannot be opened as a video"):
        probe_video(tmp_path / "bad.mp4")
    with pytest.raises(ValueError, match=r"a video of 1 frames cannot give 2 sampled frames"):
        VideoSampling().indices(VideoInfo(num_frames=1, fps=10.0, width=8, height=8))
    with pytest.raises(ValueError, match=r"video fps \(0\) must be positive"):
        VideoSampling(fps=0)

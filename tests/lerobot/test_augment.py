"""Camera resize and train-time augmentation on the batch's device: each transform against a plain reference,
dtype / range, seeding, per-sample parameters, config errors, and training-only application under a Trainer."""

from __future__ import annotations

import colorsys
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import yaml

from forge_lightning.datamodules.lerobot import LeRobotDataModule, LeRobotDataset
from forge_lightning.datamodules.lerobot.augment import (
    ImageAugment,
    ImageAugmentConfig,
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    adjust_sharpness,
    affine_theta,
    crop_theta,
    grayscale,
    resize_frames,
    warp,
)

CAMERA = "observation.images.cam"
NAMES = ("brightness", "contrast", "saturation", "hue", "sharpness", "affine", "crop")  # default order


def _frames(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def _only(name: str, **options) -> ImageAugmentConfig:
    """A config with one transform enabled (with ``options``) and every other disabled."""
    values = {n: {"enable": n == name} for n in NAMES}
    values[name] |= options
    return ImageAugmentConfig.from_dict({"enable": True, **values})


def _full(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full((x.shape[0],), value)


# ----- each transform against a plain reference ------------------------------------------------------------
def test_brightness_scales_and_clamps():
    x = _frames(3, 1, 3, 5, 4)
    out = adjust_brightness(x, torch.tensor([0.0, 0.5, 1.7]))
    torch.testing.assert_close(out[0], torch.zeros_like(x[0]))
    torch.testing.assert_close(out[1], x[1] * 0.5)
    torch.testing.assert_close(out[2], (x[2] * 1.7).clamp(max=1.0))
    augment = ImageAugment(_only("brightness", range=[0.5, 0.5]), seed=0)
    torch.testing.assert_close(augment(x[:, 0]), x[:, 0] * 0.5)  # through the config and the sampler


def test_saturation_zero_is_grayscale_and_one_is_identity():
    x = _frames(2, 1, 3, 4, 6)
    r, g, b = x.unbind(-3)
    gray = (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(-3)
    torch.testing.assert_close(grayscale(x), gray)
    torch.testing.assert_close(adjust_saturation(x, _full(x, 0.0)), gray.expand_as(x))
    torch.testing.assert_close(adjust_saturation(x, _full(x, 1.0)), x)
    torch.testing.assert_close(adjust_saturation(x, _full(x, 1.5)), (1.5 * x - 0.5 * gray).clamp(0, 1))


def test_contrast_blends_with_each_frames_mean_gray():
    x = _frames(2, 3, 3, 4, 4)  # a time stack of 3 frames per sample: each frame has its own mean
    mean = grayscale(x).mean(dim=(-3, -2, -1), keepdim=True)
    torch.testing.assert_close(adjust_contrast(x, _full(x, 0.0)), mean.expand_as(x))
    torch.testing.assert_close(adjust_contrast(x, _full(x, 0.6)), 0.6 * x + 0.4 * mean)
    torch.testing.assert_close(adjust_contrast(x, _full(x, 1.0)), x)


def test_hue_shift_matches_colorsys_and_zero_is_identity():
    x = _frames(2, 1, 3, 3, 4)
    torch.testing.assert_close(adjust_hue(x, _full(x, 0.0)), x, atol=1e-6, rtol=0)
    shifts = torch.tensor([0.13, -0.4])
    out = adjust_hue(x, shifts)
    for i, shift in enumerate(shifts.tolist()):
        for y in range(3):
            for z in range(4):
                h, s, v = colorsys.rgb_to_hsv(*x[i, 0, :, y, z].tolist())
                expected = colorsys.hsv_to_rgb((h + shift) % 1.0, s, v)
                torch.testing.assert_close(out[i, 0, :, y, z], torch.tensor(expected), atol=1e-6, rtol=0)
    red = torch.zeros(1, 1, 3, 2, 2)
    red[:, :, 0] = 1
    green = adjust_hue(red, torch.tensor([1 / 3]))  # a third of a turn: red -> green
    torch.testing.assert_close(green[0, 0, :, 0, 0], torch.tensor([0.0, 1.0, 0.0]), atol=1e-6, rtol=0)


def test_sharpness_blends_with_the_smoothed_interior():
    x = _frames(2, 1, 3, 5, 6)
    kernel = torch.tensor([[1.0, 1, 1], [1, 5, 1], [1, 1, 1]]) / 13
    smoothed = x.clone()
    for y in range(1, 4):
        for z in range(1, 5):
            smoothed[..., y, z] = (x[..., y - 1 : y + 2, z - 1 : z + 2] * kernel).sum(dim=(-2, -1))
    torch.testing.assert_close(adjust_sharpness(x, _full(x, 0.0)), smoothed)
    torch.testing.assert_close(adjust_sharpness(x, _full(x, 1.0)), x)
    torch.testing.assert_close(adjust_sharpness(x, _full(x, 2.0)), (2 * x - smoothed).clamp(0, 1))


def test_affine_rotates_counter_clockwise_and_shifts_whole_pixels():
    x = _frames(2, 2, 3, 6, 6)
    zero, one = torch.zeros(2), torch.ones(2)
    quarter = affine_theta(torch.full((2,), math.pi / 2), torch.zeros(2, 2), one, 6, 6)
    torch.testing.assert_close(warp(x, quarter), torch.rot90(x, 1, dims=(-2, -1)), atol=1e-6, rtol=0)
    shift = affine_theta(zero, torch.tensor([[2.0, 1.0], [-1.0, 0.0]]), one, 6, 6)  # [x, y] pixels
    expected = torch.zeros_like(x)  # uncovered area is black
    expected[0, ..., 1:, 2:] = x[0, ..., :-1, :-2]
    expected[1, ..., :, :-1] = x[1, ..., :, 1:]
    torch.testing.assert_close(warp(x, shift), expected, atol=1e-6, rtol=0)
    wide = _frames(2, 1, 3, 4, 8)
    torch.testing.assert_close(warp(wide, affine_theta(zero, torch.zeros(2, 2), one, 4, 8)), wide)


def test_crop_reads_the_window_and_resizes_it():
    """On a horizontal ramp (which bilinear sampling reproduces exactly) a crop of side s at centre c reads
    ``ramp(c + s * x_out)``; a full-size centred crop is the identity."""
    height, width = 4, 10
    columns = (2 * torch.arange(width) + 1) / width - 1  # pixel centres, normalised
    ramp = columns.expand(1, 1, 3, height, width).clone()
    side, center = torch.tensor([0.5]), torch.tensor([[0.2, 0.0]])
    out = warp(ramp, crop_theta(side, center), padding_mode="border")
    torch.testing.assert_close(out, (0.2 + 0.5 * columns).expand_as(ramp), atol=1e-6, rtol=0)
    x = _frames(2, 1, 3, 5, 7)
    identity = crop_theta(torch.ones(2), torch.zeros(2, 2))
    torch.testing.assert_close(warp(x, identity, padding_mode="border"), x, atol=1e-6, rtol=0)


def test_resize_matches_interpolate_per_frame_and_keeps_dtype():
    x = _frames(2, 3, 3, 12, 16)
    out = resize_frames(x, [6, 8])
    reference = F.interpolate(x.view(6, 3, 12, 16), size=(6, 8), mode="bilinear", antialias=True)
    torch.testing.assert_close(out, reference.view(2, 3, 3, 6, 8))
    frames = (x * 255).round().to(torch.uint8)
    resized = resize_frames(frames, [6, 8])
    assert resized.dtype == torch.uint8 and resized.shape == (2, 3, 3, 6, 8)
    assert resize_frames(x, [12, 16]) is x


# ----- sampling ---------------------------------------------------------------------------------------------
def _every_transform(**options) -> ImageAugmentConfig:
    strong = {
        "brightness": {"range": [0.2, 2.0]},
        "contrast": {"range": [0.2, 2.0]},
        "saturation": {"range": [0.0, 2.0]},
        "hue": {"range": [-0.5, 0.5]},
        "sharpness": {"range": [0.0, 3.0]},
        "affine": {"degrees": [-30, 30], "translate": [0.2, 0.2], "scale": [0.8, 1.2]},
        "crop": {"enable": True, "scale": [0.6, 0.9]},
    }
    return ImageAugmentConfig.from_dict({"enable": True, "max_num_transforms": 7, **strong, **options})


@pytest.mark.parametrize("shape", [(6, 3, 8, 10), (6, 2, 3, 8, 10)], ids=["frames", "time-stack"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.uint8])
def test_outputs_keep_shape_dtype_and_range(shape, dtype):
    x = _frames(*shape)
    frames = (x * 255).round().to(dtype) if dtype == torch.uint8 else x.to(dtype)
    out = ImageAugment(_every_transform(random_order=True), seed=0)(frames)
    assert out.shape == frames.shape and out.dtype == dtype
    top = 255 if dtype == torch.uint8 else 1.0
    assert out.min() >= 0 and out.max() <= top
    assert not torch.equal(out, frames)


def test_same_seed_same_output_and_every_sample_its_own_parameters():
    config = _every_transform(max_num_transforms=3)
    frame = _frames(1, 2, 3, 8, 8).expand(16, -1, -1, -1, -1)  # 16 copies of one 2-frame stack
    first, again = ImageAugment(config, seed=5)(frame), ImageAugment(config, seed=5)(frame)
    assert torch.equal(first, again)
    assert not torch.equal(first, ImageAugment(config, seed=6)(frame))
    flat = first.flatten(1)
    assert len({tuple(row.tolist()) for row in flat}) == 16  # copies augmented differently
    same_stack = ImageAugment(config, seed=5)(_frames(1, 1, 3, 8, 8).expand(16, 2, -1, -1, -1))
    assert torch.equal(same_stack[:, 0], same_stack[:, 1])  # the frames of a stack share the parameters


def test_subset_choice_follows_count_weights_and_order():
    config = _every_transform(max_num_transforms=3)
    augment = ImageAugment(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    chosen = augment.choose(500, generator)
    assert chosen.shape == (500, 3)
    assert all(len(set(row)) == 3 for row in chosen.tolist())
    assert torch.equal(chosen, chosen.sort(dim=1).values)  # configured order
    assert set(chosen.flatten().tolist()) == set(range(len(NAMES)))
    shuffled = ImageAugment(_every_transform(max_num_transforms=3, random_order=True), seed=0)
    order = shuffled.choose(500, generator)
    assert not torch.equal(order, order.sort(dim=1).values)
    heavy = ImageAugment(_every_transform(max_num_transforms=1, hue={"weight": 1e9}), seed=0)
    assert heavy.names[heavy.choose(200, generator)[:, 0].unique().item()] == "hue"


def test_random_order_composes_in_each_samples_order():
    """brightness x2 (clamps) and saturation 0 do not commute: each output is one of the two compositions."""
    config = ImageAugmentConfig.from_dict(
        {
            "enable": True,
            "max_num_transforms": 2,
            "random_order": True,
            **{n: {"enable": n in ("brightness", "saturation")} for n in NAMES},
            "brightness": {"range": [2.0, 2.0]},
            "saturation": {"range": [0.0, 0.0]},
        }
    )
    x = _frames(1, 3, 6, 6).expand(64, -1, -1, -1)
    out = ImageAugment(config, seed=0)(x)
    two, zero = _full(x, 2.0), _full(x, 0.0)
    b_then_s = adjust_saturation(adjust_brightness(x, two), zero)
    s_then_b = adjust_brightness(adjust_saturation(x, zero), two)
    first = torch.isclose(out, b_then_s).flatten(1).all(1)
    second = torch.isclose(out, s_then_b).flatten(1).all(1)
    assert bool((first | second).all()) and first.any() and second.any()


def test_state_dict_resumes_the_parameter_stream():
    config, x = _every_transform(), _frames(4, 3, 8, 8)
    uninterrupted = ImageAugment(config, seed=3)
    uninterrupted(x)
    expected = uninterrupted(x)
    first = ImageAugment(config, seed=3)
    first(x)
    resumed = ImageAugment(config, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(resumed(x), expected)


# ----- config -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_num_transfroms": 2}, r"augment has no option\(s\) \['max_num_transfroms'\]"),
        (
            {"hue": {"rnage": [0, 0.1]}},
            r"augment.hue has no option\(s\) \['rnage'\]; options: enable, weight",
        ),
        ({"hue": {"range": [0.1, 0.7]}}, r"augment.hue.range \(\[0.1, 0.7\]\) must be \[low, high\]"),
        ({"brightness": {"range": [1.2, 0.8]}}, r"augment.brightness.range"),
        ({"crop": {"scale": [0.0, 0.5]}}, r"augment.crop.scale .* in \(0.0, 1.0\]"),
        (
            {"affine": {"translate": [0.1, 1.5]}},
            r"augment.affine.translate \(height: 1.5\) must be in \[0, 1\]",
        ),
        ({"contrast": {"weight": 0}}, r"augment.contrast.weight \(0\) must be positive"),
        ({"max_num_transforms": 0}, r"augment.max_num_transforms \(0\) must be positive"),
        ({"enable": True, **{n: {"enable": False} for n in NAMES}}, "every transform is disabled"),
    ],
)
def test_config_errors_name_the_option(values, message):
    with pytest.raises(ValueError, match=message):
        ImageAugmentConfig.from_dict(values)


def test_datamodule_config_errors(fixtures_dir):
    root = str(fixtures_dir / "v30")
    with pytest.raises(ValueError, match=r"augment has no option\(s\) \['probability'\]"):
        LeRobotDataModule(root, augment={"probability": 0.5})
    with pytest.raises(ValueError, match=r"image_size \(\[32\]\) must be \[height, width\]"):
        LeRobotDataModule(root, image_size=[32])
    module = LeRobotDataModule(root, augment={"enable": True, "cameras": ["observation.images.wrist"]})
    with pytest.raises(ValueError, match=r"augment.cameras \['observation.images.wrist'\] are not cameras"):
        module.setup("fit")
    module = LeRobotDataModule(root, augment={"enable": True}, normalization={CAMERA: "mean_std"})
    with pytest.raises(ValueError, match="augment needs camera frames in \\[0, 1\\]"):
        module.setup("fit")


def test_disabled_is_identity(fixtures_dir):
    module = LeRobotDataModule(str(fixtures_dir / "v30"), batch_size=2, num_workers=0, pin_memory=False)
    module.setup("fit")
    assert module.augmenter is None and module.camera_keys == [CAMERA]
    frames = _frames(2, 3, 32, 32)
    batch = module.transform_cameras({CAMERA: frames, "task": ["a", "b"]}, training=True)
    assert batch[CAMERA] is frames


# ----- only in training, under a Trainer --------------------------------------------------------------------
class _Recorder(pl.LightningModule):
    """Checks the camera frames each step receives against the stored ones (halved in training, as configured)."""

    def __init__(self, reference: LeRobotDataset, size: list[int]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.position = {int(index): i for i, index in enumerate(reference.index)}
        self.reference, self.size = reference, size
        self.checked = {"train": 0, "val": 0}

    def _stored(self, batch: dict) -> torch.Tensor:
        frames = torch.stack([self.reference[self.position[int(i)]][CAMERA] for i in batch["index"]])
        return resize_frames(frames, self.size)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        assert batch[CAMERA].shape[-2:] == tuple(self.size)
        torch.testing.assert_close(batch[CAMERA], self._stored(batch) * 0.5)
        self.checked["train"] += 1
        return (self.weight * batch[CAMERA].mean()).sum()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        torch.testing.assert_close(batch[CAMERA], self._stored(batch))
        self.checked["val"] += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_augmentation_runs_in_training_only_and_resize_everywhere(fixtures_dir, tmp_path):
    root = fixtures_dir / "v30"
    module = LeRobotDataModule(
        str(root),
        val_fraction=0.34,
        batch_size=4,
        num_workers=0,
        pin_memory=False,
        image_size=[16, 16],
        augment=_only("brightness", range=[0.5, 0.5]),
    )
    model = _Recorder(LeRobotDataset(root), [16, 16])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=2,
        val_check_interval=2,
        num_sanity_val_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=module)
    trainer.validate(model, datamodule=module, verbose=False)
    assert model.checked["train"] == 3 and model.checked["val"] >= 4
    assert module.state_dict()["augment"]["device"] == "cpu"


def test_cli_parses_augment_options_and_rejects_unknown_ones(capsys):
    from forge_lightning.cli import ForgeCLI

    config = Path(__file__).resolve().parents[2] / "configs" / "quickstart" / "vla.yaml"
    base = ["fit", "--config", str(config)]
    options = ["--data.init_args.augment.enable", "true", "--data.init_args.augment.hue.range", "[-0.1, 0.1]"]
    with pytest.raises(SystemExit) as exit_info:
        ForgeCLI(args=[*base, *options, "--print_config"])
    assert exit_info.value.code in (0, None)
    augment = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]["augment"]
    assert augment["enable"] and augment["hue"] == {"enable": True, "weight": 1.0, "range": [-0.1, 0.1]}
    assert augment["saturation"]["range"] == [0.5, 1.5]  # the other transforms keep their defaults
    with pytest.raises(SystemExit) as exit_info:
        ForgeCLI(args=[*base, "--data.init_args.augment.hue.rnage", "[0, 1]"])
    assert exit_info.value.code == 2
    assert "rnage" in capsys.readouterr().err

"""Videos from the tiny Wan case (tests/wan_case.py: debug DiT, tiny random VAE and UMT5; CPU, fp32):

* ``VideoSamplingCallback`` samples after the right optimizer steps, writes mp4 files of the right size, logs a
  GIF image summary to TensorBoard and the mp4 to an offline W&B run, and its videos equal ``generate``'s;
* ``forge predict`` with ``configs/diffusion/debug/predict.yaml`` writes one mp4 per prompt and the index, from a
  checkpoint of the debug training recipe and from its diffusers export (the same videos);
* bad prompts, a module without a VAE and a misspelt key are refused with messages that name them.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import av
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from PIL import Image
from procs import assert_clean_exit
from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator
from torch.utils.data import DataLoader, Dataset
from wan_case import DIT, MAX_LENGTH, build_case, wan_module

from forge_lightning.callbacks import VideoPredictionWriter, VideoSamplingCallback
from forge_lightning.callbacks.video_log import video_frames, write_mp4
from forge_lightning.cli import ForgeCLI, main
from forge_lightning.datamodules.diffusion import VideoPromptDataModule, read_prompts
from forge_lightning.modules.diffusion import WanDiffusionModule
from forge_lightning.strategies import FSDP2Strategy

REPO = Path(__file__).resolve().parents[2]
TRAIN_RECIPE = REPO / "configs" / "diffusion" / "debug" / "cache_fsdp2.yaml"
PREDICT_RECIPE = REPO / "configs" / "diffusion" / "debug" / "predict.yaml"
PROMPTS = ["a red clip", "the sea"]
SIZE = {"num_frames": 5, "height": 16, "width": 16}


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    return build_case(tmp_path_factory.mktemp("wan_video"))


class _Latents(Dataset):
    """Cached-feature samples of the case's latent shape (5 frames of 16 x 16 -> [4, 2, 2, 2])."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.latents = torch.randn(4, 4, 2, 2, 2, generator=generator)
        self.text = torch.randn(4, MAX_LENGTH, 16, generator=generator)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        return {"latents": self.latents[index], "text_embeddings": self.text[index]}


def _decode_mp4(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def _sampler(output_dir: Path, **kwargs) -> VideoSamplingCallback:
    options = dict(
        prompts=PROMPTS, every_n_steps=2, **SIZE, num_inference_steps=3, guidance_scale=3.0, seed=5, fps=8
    )
    return VideoSamplingCallback(**{**options, **kwargs}, output_dir=str(output_dir))


def test_sampling_callback_writes_logs_and_equals_generate(case, tmp_path, monkeypatch):
    for key in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wandb_home"))
    torch.manual_seed(0)
    module = wan_module(case["wan"])
    modes: list[bool] = []

    class _Modes(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            modes.append(pl_module.training)

    sampler = _sampler(tmp_path / "videos")
    tensorboard = TensorBoardLogger(str(tmp_path), name="tb")
    wandb_logger = WandbLogger(save_dir=str(tmp_path), project="forge-test", offline=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        accumulate_grad_batches=2,  # the hook runs per micro-batch; sampling once per optimizer step
        logger=[tensorboard, wandb_logger],
        callbacks=[sampler, _Modes()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(_Latents(), batch_size=1))
    wandb_logger.experiment.finish()

    assert sorted(sampler.files) == [2, 4] and all(modes)  # back in train mode after each sampling
    written = sorted(p.name for p in (tmp_path / "videos").iterdir())
    assert written == [f"step_{s:06d}_{k}.mp4" for s in (2, 4) for k in (0, 1)]
    for path in sampler.files[4]:
        assert _decode_mp4(path).shape == (5, 16, 16, 3)
    # the last sampling ran on the final weights: the same videos as generate() with each prompt's seed
    for k, prompt in enumerate(PROMPTS):
        expected = module.generate([prompt], **SIZE, steps=3, guidance=3.0, seed=[5 + k])[0]
        torch.testing.assert_close(sampler.videos[k], expected, rtol=0, atol=0)
    assert not torch.equal(sampler.videos[0], sampler.videos[1])

    events = EventAccumulator(tensorboard.log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    assert {"samples/video_0", "samples/video_1"} <= set(events.Tags()["images"])
    images = events.Images("samples/video_1")
    assert [e.step for e in images] == [2, 4]
    gif = Image.open(io.BytesIO(images[-1].encoded_image_string))
    assert gif.format == "GIF" and gif.n_frames == 5 and gif.size == (16, 16)
    first = np.asarray(gif.convert("RGB"))
    # a 16 x 16 frame has at most 256 colours: the GIF's palette holds them exactly
    np.testing.assert_array_equal(first, video_frames(sampler.videos[1])[0])

    run = next((tmp_path / "wandb").glob("offline-run-*"))
    media = sorted((run / "files" / "media" / "videos").rglob("*.mp4"))
    assert len(media) == 4 and all(p.name.startswith(("video_0", "video_1")) for p in media)
    record = next(run.glob("run-*.wandb")).read_bytes()
    assert b"samples/video_0" in record and b"a red clip" in record


def _sample_in_recipe(case: dict, name: str, devices: int, strategy: dict | str) -> list[Path]:
    """The debug training recipe (2 steps, global batch 2) on ``devices`` processes with a VideoSamplingCallback
    sampling after step 2: the files it wrote."""
    root, wan = case["root"], str(case["wan"])
    config = yaml.safe_load(TRAIN_RECIPE.read_text())
    config["trainer"].update(
        devices=devices, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root / name),
    )  # fmt: skip
    sampler = {
        "prompts": PROMPTS,
        "every_n_steps": 2,
        **SIZE,
        "num_inference_steps": 3,
        "guidance_scale": 3.0,
    }
    sampler.update(seed=5, fps=8, output_dir=str(root / name / "videos"))
    config["trainer"]["callbacks"] = [
        {"class_path": "forge_lightning.callbacks.VideoSamplingCallback", "init_args": sampler}
    ]
    config["model"]["init_args"].update(
        vae=wan, text_encoder=wan, text_encoder_dtype="float32", text_max_length=MAX_LENGTH
    )
    config["data"]["init_args"].update(
        cache=str(root / "features"), cache_config=str(root / "precompute.yaml"), batch_size=2 // devices
    )
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "forge_lightning", "fit", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert_clean_exit(proc)
    return sorted((root / name / "videos").iterdir())


@pytest.mark.slow
def test_sampling_under_fsdp2_on_two_processes_matches_one(case):
    """Every rank runs the sharded DiT's sampling forwards (else the all-gathers hang), rank 0 alone writes."""
    one = _sample_in_recipe(case, "one", 1, "auto")
    two = _sample_in_recipe(case, "fsdp2", 2, {"class_path": "forge_lightning.strategies.FSDP2Strategy"})
    assert [p.name for p in one] == [p.name for p in two] == ["step_000002_0.mp4", "step_000002_1.mp4"]
    for a, b in zip(one, two):
        frames_one, frames_two = _decode_mp4(a).astype(int), _decode_mp4(b).astype(int)
        assert frames_one.shape == (5, 16, 16, 3)
        assert np.abs(frames_one - frames_two).max() <= 1, (a.name, np.abs(frames_one - frames_two).max())


def test_generate_per_prompt_seeds_do_not_depend_on_the_batch(case):
    module = wan_module(case["wan"]).eval()
    options = dict(**SIZE, steps=2, guidance=3.0, decode=False)
    both = module.generate(PROMPTS, seed=[3, 4], **options)
    for row, (prompt, seed) in enumerate(zip(PROMPTS, [3, 4])):
        alone = module.generate([prompt], seed=[seed], **options)
        torch.testing.assert_close(both[row : row + 1], alone, rtol=0, atol=1e-6)
        torch.testing.assert_close(module.generate([prompt], seed=seed, **options), alone, rtol=0, atol=0)
    with pytest.raises(ValueError, match="3 seeds for 2 prompts"):
        module.generate(PROMPTS, seed=[1, 2, 3], **options)


def _predict_args(case: dict, output: Path, *extra: str) -> list[str]:
    wan = str(case["wan"])
    return [
        "predict",
        "--config",
        str(PREDICT_RECIPE),
        "--model.init_args.vae",
        wan,
        "--model.init_args.text_encoder",
        wan,
        "--trainer.callbacks.output_dir",
        str(output),
        "--trainer.enable_progress_bar",
        "false",
        *extra,
    ]


def _index(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "index.jsonl").read_text().splitlines()]


def test_forge_predict_from_checkpoint_and_from_pretrained(case, tmp_path, monkeypatch):
    root = case["root"]
    monkeypatch.chdir(tmp_path)
    # the debug training recipe on one process, 2 steps, with a checkpoint
    fit = ["fit", "--config", str(TRAIN_RECIPE), "--trainer.devices", "1", "--trainer.strategy", "auto"]
    fit += ["--trainer.max_steps", "2", "--trainer.enable_checkpointing", "true", "--trainer.logger", "false"]
    fit += ["--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.enable_progress_bar", "false"]
    fit += ["--data.init_args.cache", str(root / "features")]
    fit += ["--data.init_args.cache_config", str(root / "precompute.yaml")]
    main(fit)
    ckpt = next((tmp_path / "run" / "checkpoints").glob("*.ckpt"))

    main(_predict_args(case, tmp_path / "from_ckpt", "--ckpt_path", str(ckpt)))
    index = _index(tmp_path / "from_ckpt")
    recipe_prompts = yaml.safe_load(PREDICT_RECIPE.read_text())["data"]["init_args"]["prompts"]
    assert (
        [r["prompt"] for r in index]
        == ["a red clip", "the sea", "a blue sky"]
        == [p if isinstance(p, str) else p["prompt"] for p in recipe_prompts]
    )
    assert [r["seed"] for r in index] == [0, 1, 7]
    assert sorted(p.name for p in (tmp_path / "from_ckpt").glob("*.mp4")) == [r["file"] for r in index]
    videos = {r["file"]: _decode_mp4(tmp_path / "from_ckpt" / r["file"]) for r in index}
    assert all(v.shape == (5, 16, 16, 3) for v in videos.values())

    # the trained weights: the predicted files equal generate()'s video written the same way
    trained = wan_module(case["wan"], flow_matching={"shift": 3.0})
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    trained.load_state_dict(state)
    trained.eval()
    expected = trained.generate(["a blue sky"], **SIZE, steps=4, guidance=3.0, seed=[7])[0]
    write_mp4(tmp_path / "expected.mp4", video_frames(expected), fps=8)
    np.testing.assert_array_equal(videos[index[2]["file"]], _decode_mp4(tmp_path / "expected.mp4"))

    # the same weights as a diffusers directory, no checkpoint, prompts from a JSONL file
    trained.save_pretrained(tmp_path / "export" / "transformer")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "seed": r["seed"]}) + "\n" for r in index))
    pretrained = ["--model.init_args.pretrained", str(tmp_path / "export" / "transformer")]
    pretrained += ["--data.init_args.prompts", "null", "--data.init_args.file", str(prompts)]
    main(_predict_args(case, tmp_path / "from_pretrained", *pretrained))
    assert _index(tmp_path / "from_pretrained") == index
    for name, video in videos.items():
        np.testing.assert_array_equal(_decode_mp4(tmp_path / "from_pretrained" / name), video)


@pytest.mark.parametrize(
    ("prompts", "content", "error", "message"),
    [
        (None, None, FileNotFoundError, r"prompts file .*missing\.txt does not exist"),
        ([], None, ValueError, "prompts holds no prompt"),
        (None, "\n\n", ValueError, r"prompts\.txt holds no prompt"),
        ([{"promt": "a red clip"}], None, ValueError, r"prompts\[0\]: unknown key\(s\) \['promt'\]"),
        (
            [{"prompt": "the sea", "seed": "one"}],
            None,
            ValueError,
            r"prompts\[0\]: 'seed' must be an integer",
        ),
        (["a red clip", "  "], None, ValueError, r"prompts\[1\]: 'prompt' must be a non-empty string"),
    ],
)
def test_bad_prompts_are_named(tmp_path, prompts, content, error, message):
    file = None
    if prompts is None:
        file = tmp_path / ("missing.txt" if content is None else "prompts.txt")
        if content is not None:
            file.write_text(content)
    with pytest.raises(error, match=message):
        VideoPromptDataModule(prompts=prompts, file=None if file is None else str(file))


def test_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("a red clip\n\n  the sea \n")
    assert read_prompts(file=tmp_path / "p.txt", seed=10) == [
        {"prompt": "a red clip", "seed": 10, "index": 0},
        {"prompt": "the sea", "seed": 11, "index": 1},
    ]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b", "seed": 3}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"p\.jsonl:3: not valid JSON"):
        read_prompts(file=tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match="not both or neither"):
        read_prompts(["a"], tmp_path / "p.txt")


def test_callbacks_refuse_a_module_without_vae(tmp_path):
    with pytest.raises(TypeError, match="needs a video-generating module"):
        _sampler(tmp_path).setup(pl.Trainer(accelerator="cpu", logger=False), pl.LightningModule(), "fit")
    module = WanDiffusionModule(config=DIT)
    for callback in (_sampler(tmp_path), VideoPredictionWriter(str(tmp_path))):
        with pytest.raises(ValueError, match=r"no decoder for its latents: configure model\.init_args\.vae"):
            callback.setup(pl.Trainer(accelerator="cpu", logger=False), module, "fit")
    sharded = pl.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), logger=False)  # not launched
    with pytest.raises(ValueError, match="under FSDP2Strategy on 2 ranks is not supported"):
        VideoPredictionWriter(str(tmp_path)).setup(
            sharded, wan_module(tmp_path / "no_weights_read"), "predict"
        )
    with pytest.raises(ValueError, match=r"every_n_steps \(0\) must be at least 1"):
        _sampler(tmp_path, every_n_steps=0)
    with pytest.raises(ValueError, match="non-empty list"):
        _sampler(tmp_path, prompts=[])


def test_misspelt_predict_key_fails_before_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ForgeCLI(args=["predict", "--config", str(PREDICT_RECIPE), "--data.init_args.promts", "[a]"])
    assert exit_info.value.code == 2
    assert "promts" in capsys.readouterr().err

"""The text-to-video quick start: the moving-shapes clips and their reader, and the whole pipeline
(``forge-data diffusion-quickstart`` -> ``forge-data precompute`` -> ``forge fit`` with the shipped
``configs/quickstart/diffusion.yaml``) at a few steps."""

from __future__ import annotations

import json
import random
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import yaml

from forge_lightning.cli import ForgeCLI
from forge_lightning.datamodules.diffusion import run_precompute
from forge_lightning.datamodules.diffusion.moving_shapes import (
    COLOURS,
    DIRECTIONS,
    SHAPES,
    Clip,
    all_clips,
    random_start,
    read_caption,
    read_clip,
    render_clip,
    split_clips,
)
from forge_lightning.datamodules.diffusion.precompute import load_precompute_config
from forge_lightning.datamodules.feature_cache import FeatureCacheDataset
from forge_lightning.sim.video import write_video
from forge_lightning.tools.data import build_diffusion_quickstart

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "quickstart" / "diffusion.yaml"


def _video(frames_FHWC: np.ndarray) -> torch.Tensor:
    """uint8 frames -> ``[3, F, H, W]`` in ``[-1, 1]``."""
    return torch.from_numpy(frames_FHWC).permute(3, 0, 1, 2).float() / 127.5 - 1


def test_split_holds_out_four_combinations_and_keeps_every_value_in_training():
    train, held_out = split_clips()
    assert len(train) == 28 and len(held_out) == 4 and not set(train) & set(held_out)
    for name, values in (("shape", SHAPES), ("colour", COLOURS), ("direction", DIRECTIONS)):
        assert {getattr(c, name) for c in train} == set(values)
        assert len({getattr(c, name) for c in held_out}) == min(4, len(values))
    # every colour-direction pair of a held-out clip is seen in training with the other shape
    assert all(any((c.colour, c.direction) == (h.colour, h.direction) for c in train) for h in held_out)


def test_reader_reads_every_rendered_clip_back():
    rng = random.Random(0)
    for clip in all_clips():
        for _ in range(3):
            assert read_clip(_video(render_clip(clip, random_start(clip, rng)))) == clip


def test_reader_reads_clips_back_through_the_mp4_codec(tmp_path):
    rng = random.Random(1)
    for k, clip in enumerate(all_clips()[::3]):
        path = write_video(
            tmp_path / f"{k}.mp4", list(render_clip(clip, random_start(clip, rng))), 8, min_size=1
        )
        with av.open(str(path)) as container:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        assert read_clip(_video(frames)) == clip


def test_reader_rejects_wrong_clips():
    red_square_left = Clip("square", "red", "left")
    wrong = [
        Clip("square", "blue", "left"),
        Clip("square", "red", "right"),
        Clip("square", "red", "up"),
        Clip("triangle", "red", "left"),
    ]
    rng = random.Random(2)
    for clip in wrong:
        assert read_clip(_video(render_clip(clip, random_start(clip, rng)))) != red_square_left
    # a shape that does not move has no direction; an empty (black) clip has no attribute
    still = np.repeat(render_clip(red_square_left, (14, 10))[:1], 5, axis=0)
    assert read_clip(_video(still)) == Clip("square", "red", None)
    assert read_clip(-torch.ones(3, 5, 32, 32)) == Clip(None, None, None)


def test_caption_round_trip_and_bad_captions():
    for clip in all_clips():
        assert read_caption(clip.caption) == clip
    with pytest.raises(ValueError, match="'a red blob moving left'"):
        read_caption("a red blob moving left")
    with pytest.raises(ValueError, match="not of the form"):
        read_caption("red square left")


def test_render_refuses_a_path_out_of_the_frame():
    with pytest.raises(ValueError, match="out of the 32-pixel frame"):
        render_clip(Clip("square", "red", "left"), (2, 10))


def test_quickstart_pipeline_runs_end_to_end(tmp_path, monkeypatch):
    """Data, precompute and ``forge fit`` of the shipped config at 3 steps, scored before and after (about 30 s)."""
    monkeypatch.chdir(tmp_path)
    output = Path("data/diffusion_quickstart")
    record = build_diffusion_quickstart(output, clips_per_caption=2)
    assert record == {"clips": 56, "train_captions": 28, "held_out_captions": 4}
    run_precompute(output / "precompute.yaml", output / "features", log=lambda _: None)
    cache = FeatureCacheDataset(
        str(output / "features"), modules=load_precompute_config(output / "precompute.yaml").modules
    )
    sample = cache[0]
    assert sample["latents"].shape == (3, 5, 32, 32) and sample["text_embeddings"].shape == (8, 16)
    assert read_clip(sample["latents"]) == read_caption(sample["caption"])  # pixel latents are the clip

    config = yaml.safe_load(CONFIG.read_text())
    config["trainer"]["max_steps"] = 3
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("MovingShapesScore"):
            callback["init_args"].update(samples_per_prompt={"train": 1, "held_out": 1}, steps=2)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    torch.manual_seed(0)
    cli = ForgeCLI(
        args=["fit", "--config", str(tmp_path / "run.yaml"), "--trainer.enable_progress_bar", "false"]
    )
    assert cli.trainer.global_step == 3
    scores = json.loads(Path("runs/diffusion_quickstart/scores.json").read_text())
    assert list(scores) == ["untrained (step 0)", "trained (step 3)"]
    for result in scores.values():
        assert result["train"]["clips"] == 28 and result["held_out"]["clips"] == 4
        assert all(0 <= result[s][k] <= 1 for s in result for k in ("colour", "direction", "shape", "score"))

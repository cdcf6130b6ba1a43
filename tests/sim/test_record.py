"""Expert demonstrations as a LeRobot v3.0 dataset: read back by ``LeRobotDataModule``, frames equal to what the
env renders, actions the expert's, and prompts that the written tokenizer covers."""

from __future__ import annotations

import numpy as np
import torch

from forge_lightning.datamodules.lerobot import LeRobotDataModule, LeRobotMeta, Normalizer
from forge_lightning.sim.reach import TASK, Reach2DExpert
from forge_lightning.sim.rollout import policy_batch

CHUNK = [round(0.1 * k, 1) for k in range(10)]


def test_dataset_reads_back_through_the_datamodule(reach_data):
    meta = LeRobotMeta(reach_data["dataset"])
    assert meta.version == "v3.0" and len(meta.episodes) == reach_data["episodes"] and meta.fps == 10
    assert meta.features["observation.images.top"]["shape"] == [32, 32, 3]
    assert meta.features["observation.state"]["shape"] == [2]
    datamodule = LeRobotDataModule(
        str(reach_data["dataset"]),
        delta_timestamps={"action": CHUNK},
        normalization={"observation.state": "min_max", "action": "min_max"},
        val_fraction=0.2,
        batch_size=4,
        num_workers=0,
        pin_memory=False,
    )
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["observation.images.top"].shape == (4, 3, 32, 32)
    assert batch["action"].shape == (4, 10, 2)
    assert batch["task"] == [TASK] * 4
    assert batch["observation.state"].abs().max() <= 1.0 + 1e-6  # min_max: the data span [-1, 1]
    assert len(datamodule.val_dataset) > 0


def test_frames_and_actions_are_the_envs_and_the_experts(reach_data, first_observation):
    from forge_lightning.datamodules.lerobot import LeRobotDataset

    dataset = LeRobotDataset(reach_data["dataset"], episodes=[0])
    first = dataset[0]
    obs, info = first_observation(0)
    rendered = torch.from_numpy(obs["pixels"]).permute(2, 0, 1).float() / 255
    assert (first["observation.images.top"] - rendered).abs().mean() < 0.02  # H.264 at crf 10
    np.testing.assert_allclose(first["observation.state"].numpy(), obs["agent_pos"])
    # the expert's first action points at the target, at full speed on the longer axis
    assert first["action"].abs().max() == 1.0
    expert = Reach2DExpert()
    np.testing.assert_allclose(
        first["action"].numpy(), expert(obs["agent_pos"], info["target_pos"]), atol=1e-6
    )


def test_rollout_batches_match_the_training_frames(reach_data, first_observation):
    """The rollout converts and normalises a live observation exactly as the dataset does a recorded one."""
    from forge_lightning.datamodules.lerobot import LeRobotDataset

    modes = {"observation.state": "quantiles"}
    dataset = LeRobotDataset(reach_data["dataset"], episodes=[0], normalization=modes)
    normalizer = Normalizer(stats=LeRobotMeta(reach_data["dataset"]).stats, modes=modes)
    obs, _ = first_observation(0)
    features = {"observation.images.top": obs["pixels"][None], "observation.state": obs["agent_pos"][None]}
    batch = policy_batch(features, [0], TASK, normalizer=normalizer)
    item = dataset[0]
    torch.testing.assert_close(batch["observation.state"][0], item["observation.state"])
    assert (batch["observation.images.top"][0] - item["observation.images.top"]).abs().mean() < 0.02


def test_tokenizer_covers_every_prompt(reach_data):
    from forge_lightning.modules.embodied import PromptTokenizer, build_prompts

    tokenizer = PromptTokenizer(reach_data["tokenizer"], max_length=16)
    states = torch.tensor([[-1.0, 1.0], [0.0, -0.5], [-1.5, 0.99]])
    tokens, mask = tokenizer(build_prompts([TASK] * 3, states))
    unk = tokenizer.backend.convert_tokens_to_ids("<unk>")
    assert not (tokens[mask] == unk).any()
    assert (tokens[:, 0] == tokenizer.backend.bos_token_id).all()
    # BOS + 14 words; a state below -1 is written as bin -1 (two tokens)
    assert mask.sum(-1).tolist() == [15, 15, 16]
    assert tokenizer.vocab_size <= 272  # fits the quickstart preset's vocab_size

"""Demonstrations from a scripted expert, written as a LeRobot v3.0 dataset, and a prompt tokenizer to train on.

``python -m forge_lightning.sim.record --output data/vla_quickstart --episodes 200`` writes::

    data/vla_quickstart/reach2d/     LeRobot v3.0: observation.images.top (mp4), observation.state, action
    data/vla_quickstart/tokenizer/   a word-level tokenizer for Pi0.5's prompt (task words, state bins)

The observation goes through the same :class:`~forge_lightning.sim.adapters.Reach2DAdapter` that maps the
simulator's observations for evaluation, so training and closed-loop evaluation see the same features.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

import gymnasium as gym
import numpy as np

from forge_lightning.sim.adapters import Reach2DAdapter
from forge_lightning.sim.reach import ENV_ID, TASK, Reach2DExpert, register

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # PaliGemma's ids 0-3
PROMPT_WORDS = ("Task", "State", "Action", ":", ",", ";", "-")


def record_reach2d(
    root: str | Path,
    *,
    num_episodes: int,
    seed: int = 0,
    image_size: int = 32,
    codec: str = "libx264",
    crf: int = 10,
) -> Path:
    """Runs the scripted expert for ``num_episodes`` successful episodes and writes them with ``LeRobotWriter``.

    Args:
        root: dataset directory (must not exist).
        num_episodes: episodes to record (episode ``i`` starts from ``reset(seed=seed + i)``).
        seed: seed of the first episode.
        image_size: camera resolution.
        codec: video encoder (``libx264`` keeps 32-pixel frames sharp at a low ``crf``).
        crf: constant rate factor of the encoder (lower: closer to the rendered frames).

    Returns:
        The dataset root.
    """
    from forge_lightning.datamodules.lerobot import LeRobotWriter

    register()
    env = gym.make(ENV_ID, image_size=image_size)
    adapter = Reach2DAdapter()
    expert = Reach2DExpert(env.unwrapped.max_speed)
    writer = LeRobotWriter(
        root,
        fps=env.metadata["render_fps"],
        features=adapter.features(env),
        robot_type="reach2d",
        codec=codec,
        crf=crf,
    )
    for episode in range(num_episodes):
        obs, info = env.reset(seed=seed + episode)
        done = False
        while not done:
            action = expert(obs["agent_pos"], info["target_pos"])
            frame = {key: value[0] for key, value in adapter.observation(_batched(obs)).items()}
            writer.add_frame({**frame, "action": action}, task=TASK)
            obs, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
        if not info["is_success"]:
            raise RuntimeError(f"the scripted expert failed episode {episode} (seed {seed + episode})")
        writer.save_episode()
    env.close()
    return writer.finalize()


def _batched(obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {key: value[None] for key, value in obs.items()}


def write_prompt_tokenizer(directory: str | Path, tasks: Iterable[str], num_bins: int = 256) -> Path:
    """Saves a word-level tokenizer for Pi0.5 prompts (``"Task: ..., State: 12 200;\\nAction: "``).

    Its vocabulary: PaliGemma's special tokens at their ids (pad 0, eos 1, bos 2, unk 3), the prompt's words
    and punctuation, the words of ``tasks`` and the state bins ``0 ... num_bins - 1``; a beginning-of-sequence
    token is prepended, as PaliGemma's tokenizer does.

    Args:
        directory: output directory (``tokenizer.json``, ``tokenizer_config.json``).
        tasks: task strings the prompts will hold.
        num_bins: state bins of the model (``Pi05Config.state_bins``).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pre_tokenizer = pre_tokenizers.Whitespace()
    task_words = [w for task in tasks for w, _ in pre_tokenizer.pre_tokenize_str(task.replace("_", " "))]
    words = [*SPECIAL_TOKENS, *PROMPT_WORDS, *task_words, *(str(i) for i in range(num_bins))]
    vocab = {word: i for i, word in enumerate(dict.fromkeys(words))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(str(directory))
    return Path(directory)


def main(argv: list[str] | None = None) -> None:
    """``python -m forge_lightning.sim.record``: Reach2D demonstrations and the prompt tokenizer."""
    parser = argparse.ArgumentParser(
        prog="python -m forge_lightning.sim.record", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--output", required=True, help="directory for reach2d/ (the dataset) and tokenizer/")
    parser.add_argument("--episodes", type=int, default=200, help="expert episodes to record")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first episode")
    parser.add_argument("--image-size", type=int, default=32, help="camera resolution in pixels")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    output = Path(args.output)
    if output.exists():
        if not args.force:
            print(f"{output} exists: keeping it (pass --force to record again)")
            return
        import shutil

        shutil.rmtree(output)
    root = record_reach2d(
        output / "reach2d", num_episodes=args.episodes, seed=args.seed, image_size=args.image_size
    )
    tokenizer = write_prompt_tokenizer(output / "tokenizer", [TASK])
    print(f"wrote {args.episodes} expert episodes to {root} and the prompt tokenizer to {tokenizer}")


if __name__ == "__main__":
    main()

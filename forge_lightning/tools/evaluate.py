"""``forge-eval``: closed-loop evaluation of a trained policy in a simulator.

``forge-eval --config run.yaml --ckpt last.ckpt [--episodes 100] [--baseline random] [--output DIR]`` builds the
model from the run's YAML (``model`` section), loads the checkpoint's weights and normalisation statistics, and
runs it in the env of the YAML's ``ClosedLoopEval`` callback (its arguments are the defaults; flags override
them). It prints the success rate with its Wilson interval, the mean reward and episode length with theirs,
writes ``metrics.json`` and the first episodes' videos under ``--output``, and logs them to W&B with
``--wandb-project``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from forge_lightning.sim.evaluate import EvalConfig, EvalReport, evaluate_policy, log_report
from forge_lightning.strategies.checkpoint_io import AtomicCheckpointIO

_CALLBACK = "ClosedLoopEval"
_FLAGS = {  # flag -> EvalConfig field
    "env": "env",
    "episodes": "num_episodes",
    "num_envs": "num_envs",
    "vectorization": "vectorization",
    "n_action_steps": "n_action_steps",
    "max_episode_steps": "max_episode_steps",
    "seed": "seed",
    "videos": "num_videos",
    "task": "task",
}


def eval_settings(run_config: dict[str, Any]) -> dict[str, Any]:
    """The ``init_args`` of the run's ``ClosedLoopEval`` callback (empty when it has none)."""
    callbacks = (run_config.get("trainer") or {}).get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith(_CALLBACK):
            return dict(callback.get("init_args") or {})
    return {}


def build_model(model_config: dict[str, Any]) -> torch.nn.Module:
    """The LightningModule a ``model: {class_path, init_args}`` section describes (validated by jsonargparse)."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model", required=True)
    parsed = parser.parse_object({"model": model_config})
    return parser.instantiate_classes(parsed).model


def load_policy(run_config: dict[str, Any], ckpt: str | Path, device: str) -> torch.nn.Module:
    """The configured model with the checkpoint's weights and its ``on_load_checkpoint`` state (statistics)."""
    if "model" not in run_config:
        raise ValueError("the config has no model section")
    model = build_model(run_config["model"])
    checkpoint = AtomicCheckpointIO().load_checkpoint(ckpt, map_location="cpu")  # verified, weights only
    model.load_state_dict(checkpoint["state_dict"])
    model.on_load_checkpoint(checkpoint)
    return model.to(device).eval()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forge-eval", description="Closed-loop evaluation of a policy in a simulator."
    )
    p.add_argument("--config", required=True, help="the run's YAML (model section; ClosedLoopEval settings)")
    p.add_argument("--ckpt", help="Lightning checkpoint of the model (required unless --policy random)")
    p.add_argument(
        "--policy", choices=("checkpoint", "random"), default="checkpoint", help="what to evaluate"
    )
    p.add_argument("--baseline", choices=("random",), help="also evaluate this baseline and compare")
    p.add_argument("--env", help="gymnasium id of the env")
    p.add_argument("--episodes", type=int, help="episodes to run")
    p.add_argument("--num-envs", type=int, help="envs stepped together")
    p.add_argument("--vectorization", choices=("sync", "async"), help="SyncVectorEnv or AsyncVectorEnv")
    p.add_argument("--n-action-steps", type=int, help="actions executed per chunk before re-planning")
    p.add_argument("--max-episode-steps", type=int, help="time limit per episode")
    p.add_argument("--seed", type=int, help="episode i starts from reset(seed=SEED + i)")
    p.add_argument("--videos", type=int, help="episodes written as mp4")
    p.add_argument("--task", help="task string given to the policy")
    p.add_argument("--output", default="runs/eval", help="folder for metrics.json and videos")
    p.add_argument("--device", default="cpu", help="device of the policy (cpu, cuda)")
    p.add_argument("--wandb-project", help="also log metrics and videos to this W&B project")
    return p


def _random_policy(config: EvalConfig, chunk_size: int) -> Any:
    from forge_lightning.sim.envs import make_env
    from forge_lightning.sim.rollout import RandomPolicy

    env = make_env(config.env, config.env_kwargs)
    try:
        return RandomPolicy(env.action_space, chunk_size=chunk_size, seed=config.seed)
    finally:
        env.close()


def _run(name: str, policy: Any, config: EvalConfig, output: Path, wandb_project: str | None) -> EvalReport:
    report = evaluate_policy(policy, config, video_dir=output / name / "videos")
    print(report.format(name), flush=True)
    (output / name).mkdir(parents=True, exist_ok=True)
    (output / name / "metrics.json").write_text(json.dumps(report.metrics, indent=2) + "\n")
    if wandb_project is not None:
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(
            project=wandb_project, name=f"eval-{name}", save_dir=str(output), job_type="eval"
        )
        log_report([logger], report, prefix=f"eval/{name}")
        logger.experiment.finish()
    return report


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``forge-eval``."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.policy == "checkpoint" and args.ckpt is None:
        raise SystemExit("forge-eval: error: --ckpt is required (or --policy random)")
    run_config = yaml.safe_load(Path(args.config).read_text()) or {}
    settings = eval_settings(run_config)
    settings |= {
        field: getattr(args, flag) for flag, field in _FLAGS.items() if getattr(args, flag) is not None
    }
    try:
        config = EvalConfig.from_mapping(settings)
    except (KeyError, ValueError) as error:
        raise SystemExit(f"forge-eval: error: {error}") from None
    output = Path(args.output)
    reports = {}
    if args.policy == "checkpoint":
        policy = load_policy(run_config, args.ckpt, args.device)
        chunk_size = getattr(getattr(policy, "config", None), "chunk_size", 1)
        reports["policy"] = _run("policy", policy, config, output, args.wandb_project)
    else:
        chunk_size = config.n_action_steps or 1
    if args.policy == "random" or args.baseline == "random":
        reports["random"] = _run(
            "random", _random_policy(config, chunk_size), config, output, args.wandb_project
        )
    if len(reports) == 2:
        trained, random = reports["policy"].metrics["success_rate"], reports["random"].metrics["success_rate"]
        ratio = f"{trained / random:.1f}x" if random > 0 else "inf (random: 0 successes)"
        print(f"success rate: policy {trained:.3f} vs random {random:.3f} ({ratio})", flush=True)


if __name__ == "__main__":
    main()

"""Prompt adherence of a text-to-video model on the moving-shapes task, before and after training."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from forge_lightning.datamodules.diffusion.moving_shapes import read_caption, read_clip

ATTRIBUTES = ("colour", "direction", "shape")


class MovingShapesScore(Callback):
    """Generates clips for the prompts of ``prompts`` (``forge-data diffusion-quickstart``'s ``prompts.jsonl``) when
    training starts and when it ends, reads each clip's colour, direction and shape back
    (:func:`~forge_lightning.datamodules.diffusion.moving_shapes.read_clip`) and reports, per split (``train`` and
    ``held_out`` prompts), the share of clips whose colour, direction and shape each match the prompt and ``score``:
    the share matching all three. Prints a table at the end and writes it as JSON to ``output``.

    One process only: the module's ``generate`` runs the whole DiT.

    Args:
        prompts: JSON lines ``{"caption", "split"}``.
        samples_per_prompt: clips per prompt, per split (``{"train": 2, "held_out": 8}``).
        num_frames: frames of a clip.
        side: its width and height.
        steps: Euler steps.
        guidance: classifier-free guidance scale.
        compression: ``(temporal, spatial)`` video-to-latent factors (pixel space: ``(1, 1)``).
        batch_size: clips generated together.
        output: the JSON file of the scores (``None``: none written).
    """

    def __init__(
        self,
        prompts: str,
        samples_per_prompt: dict[str, int] | None = None,
        *,
        num_frames: int = 5,
        side: int = 32,
        steps: int = 20,
        guidance: float = 3.0,
        compression: tuple[int, int] = (1, 1),
        batch_size: int = 32,
        output: str | None = None,
    ) -> None:
        self.prompts = [
            json.loads(line) for line in Path(prompts).read_text(encoding="utf-8").splitlines() if line
        ]
        self.samples_per_prompt = dict(samples_per_prompt or {"train": 2, "held_out": 8})
        splits = {p.get("split") for p in self.prompts}
        if not self.prompts or not splits <= set(self.samples_per_prompt):
            raise ValueError(
                f"{prompts}: every prompt needs a split of samples_per_prompt ({sorted(self.samples_per_prompt)}); "
                f"found {sorted(map(str, splits))}"
            )
        for record in self.prompts:
            read_caption(record["caption"])  # fails now, naming the caption, rather than after training
        self.options = {
            "num_frames": num_frames,
            "height": side,
            "width": side,
            "steps": steps,
            "guidance": guidance,
            "compression": tuple(compression),
            "decode": False,
        }
        self.batch_size = batch_size
        self.output = output
        self.results: dict[str, dict[str, dict[str, float]]] = {}

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            raise ValueError(f"MovingShapesScore runs in one process; this run has {trainer.world_size}")

    def evaluate(self, pl_module: Any) -> dict[str, dict[str, float]]:
        """Per split: the share of clips matching the prompt in each attribute and in all (``score``)."""
        jobs = [
            (record, seed)
            for record in self.prompts
            for seed in range(self.samples_per_prompt[record["split"]])
        ]
        hits: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        was_training = pl_module.training
        pl_module.eval()
        for start in range(0, len(jobs), self.batch_size):
            chunk = jobs[start : start + self.batch_size]
            # one seed per chunk: its clips start from different noise, the same at every evaluation
            clips = pl_module.generate([r["caption"] for r, _ in chunk], seed=start, **self.options)
            for (record, _), clip in zip(chunk, clips.float().cpu(), strict=True):
                wanted, got = read_caption(record["caption"]), read_clip(clip)
                counts = hits[record["split"]]
                counts["clips"] += 1
                for name in ATTRIBUTES:
                    counts[name] += getattr(got, name) == getattr(wanted, name)
                counts["score"] += got == wanted
        pl_module.train(was_training)
        return {
            split: {name: counts[name] / counts["clips"] for name in (*ATTRIBUTES, "score")}
            | {"clips": counts["clips"]}
            for split, counts in hits.items()
        }

    def _record(self, trainer: Trainer, pl_module: LightningModule, when: str) -> None:
        result = self.evaluate(pl_module)
        self.results[f"{when} (step {trainer.global_step})"] = result
        for split, values in result.items():
            rank_zero_info(f"{when} {split}: score {values['score']:.3f} over {int(values['clips'])} clips")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer, pl_module, "untrained" if trainer.global_step == 0 else "resumed")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer, pl_module, "trained")
        rank_zero_info(self.table())
        if self.output is not None:
            Path(self.output).parent.mkdir(parents=True, exist_ok=True)
            Path(self.output).write_text(json.dumps(self.results, indent=2) + "\n", encoding="utf-8")

    def table(self) -> str:
        """The scores so far as a text table: one row per evaluation and split."""
        header = f"{'model':<22} {'prompts':<9} {'clips':>5} " + " ".join(
            f"{n:>9}" for n in (*ATTRIBUTES, "score")
        )
        rows = [header, "-" * len(header)]
        for when, result in self.results.items():
            for split, values in sorted(result.items()):
                cells = " ".join(f"{values[n]:>9.3f}" for n in (*ATTRIBUTES, "score"))
                rows.append(f"{when:<22} {split:<9} {int(values['clips']):>5} {cells}")
        return "\n".join(rows)

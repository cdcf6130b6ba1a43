"""A synthetic visual question-answering set for the vision-language quick start: coloured shapes on a grid.

Each image is a ``grid x grid`` board of cells (``cell`` pixels a side); a few cells hold one shape each (a
triangle, square or circle, in red, green, blue or yellow, centred in its cell, on a light grey background). The
boards differ in which cells hold which shapes and colours; the rendering itself is fixed, so a model a few hundred
thousand parameters small learns the questions on a CPU in minutes. Each record asks one question whose answer is a single word::

    What colour is the triangle?     -> red      (only when the board has exactly one triangle)
    How many circles are there?      -> two      (a shape the board has)
    Which shape is blue?             -> square   (only when exactly one shape is blue)

Records are LLaVA JSON lines (``image`` + ``conversations`` with ``<image>``), the images PNG files beside them, so
the set exercises the same reader, scan and processor as real data.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAPES = ("triangle", "square", "circle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
BACKGROUND = (245, 245, 245)
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six")
IMAGE_TOKEN = "<image>"


@dataclass(frozen=True)
class Shape:
    """One shape on the board: its kind, colour name and cell (row-major index)."""

    kind: str
    colour: str
    cell: int


def random_board(rng: random.Random, *, grid: int, min_shapes: int = 2, max_shapes: int = 5) -> list[Shape]:
    """Shapes in distinct cells of a ``grid x grid`` board."""
    count = rng.randint(min_shapes, min(max_shapes, grid * grid))
    cells = rng.sample(range(grid * grid), count)
    return [Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), cell) for cell in cells]


def draw_board(shapes: list[Shape], *, grid: int, cell: int) -> Any:
    """A PIL RGB image of ``shapes``: each three quarters of its cell, centred, on a light grey background."""
    from PIL import Image, ImageDraw

    size = grid * cell
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    side = round(cell * 0.75)
    margin = (cell - side) // 2
    for shape in shapes:
        row, col = divmod(shape.cell, grid)
        x0, y0 = col * cell + margin, row * cell + margin
        x1, y1 = x0 + side - 1, y0 + side - 1
        colour = COLOURS[shape.colour]
        if shape.kind == "square":
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        elif shape.kind == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            draw.polygon(((x0 + x1) / 2, y0, x1, y1, x0, y1), fill=colour)
    return image


def questions(shapes: list[Shape]) -> list[tuple[str, str]]:
    """Every (question, one-word answer) the board answers unambiguously."""
    asked = []
    for kind in SHAPES:
        of_kind = [s for s in shapes if s.kind == kind]
        if len(of_kind) == 1:
            asked.append((f"What colour is the {kind}?", of_kind[0].colour))
        if of_kind:
            asked.append((f"How many {kind}s are there?", NUMBERS[len(of_kind)]))
    for colour in COLOURS:
        of_colour = [s for s in shapes if s.colour == colour]
        if len(of_colour) == 1:
            asked.append((f"Which shape is {colour}?", of_colour[0].kind))
    return asked


def write_shapes_dataset(
    output_dir: str | Path,
    *,
    num_train: int = 6000,
    num_val: int = 200,
    grid: int = 3,
    cell: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Write ``train.jsonl`` / ``val.jsonl`` (LLaVA records, one question each) and their PNG images under
    ``output_dir``; no validation board appears in training.

    Returns:
        The counts and sizes written (also the ``dataset.json`` record).
    """
    output = Path(output_dir)
    (output / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    seen: set[tuple[Shape, ...]] = set()
    counts = {}
    for split, num in (("val", num_val), ("train", num_train)):
        lines = []
        while len(lines) < num:
            shapes = random_board(rng, grid=grid)
            key = tuple(sorted(shapes, key=lambda s: s.cell))
            if split == "train" and key in seen:
                continue
            seen.add(key)
            question, answer = rng.choice(questions(shapes))
            name = f"images/{split}_{len(lines):06d}.png"
            draw_board(shapes, grid=grid, cell=cell).save(output / name)
            record = {
                "image": name,
                "conversations": [
                    {"from": "human", "value": f"{IMAGE_TOKEN}\n{question}"},
                    {"from": "gpt", "value": answer},
                ],
            }
            lines.append(json.dumps(record))
        (output / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        counts[split] = len(lines)
    record = {**counts, "image_size": grid * cell, "grid": grid, "cell": cell, "seed": seed}
    (output / "dataset.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def vocabulary_text() -> str:
    """Every word the questions and answers use (to train the quick start's tokenizer on)."""
    words = [
        *(q for kind in SHAPES for q in (f"What colour is the {kind}?", f"How many {kind}s are there?")),
        *(f"Which shape is {colour}?" for colour in COLOURS),
        *COLOURS,
        *SHAPES,
        *NUMBERS,
    ]
    return " ".join(words)

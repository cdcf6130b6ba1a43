"""Procedural unit-conversion dialogues: the fine-tuning quick start's chat data, made on the spot.

Each dialogue asks for one or two conversions between units a power of ten apart ("How many meters are in 37
kilometers?" -> "37 kilometers is 37000 meters."), phrased in several ways, with an optional system prompt. The
answers are exact, so held-out prompts give an exact-match accuracy. Records are written in the three supported
formats in turn (Alpaca, ShareGPT, OpenAI), which also exercises per-record format detection.
"""

from __future__ import annotations

import random
from typing import Any

UNITS: tuple[tuple[str, str, int], ...] = (
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("centimeters", "millimeters", 10),
    ("meters", "millimeters", 1000),
    ("kilograms", "grams", 1000),
    ("grams", "milligrams", 1000),
    ("liters", "milliliters", 1000),
    ("dollars", "cents", 100),
    ("kilowatts", "watts", 1000),
)
"""(larger unit, smaller unit, factor) pairs; conversions go both ways."""

QUESTIONS = (
    "How many {dst} are in {value} {src}?",
    "Convert {value} {src} to {dst}.",
    "What is {value} {src} in {dst}?",
    "{value} {src} is how many {dst}?",
)
SYSTEM = "You convert units exactly."


def conversion(rng: random.Random) -> tuple[str, str]:
    """One random (question, answer) pair."""
    big, small, factor = rng.choice(UNITS)
    amount = rng.randint(1, 999)
    if rng.random() < 0.5:
        src, dst, value, result = big, small, amount, amount * factor
    else:
        src, dst, value, result = small, big, amount * factor, amount
    question = rng.choice(QUESTIONS).format(value=value, src=src, dst=dst)
    return question, f"{value} {src} is {result} {dst}."


def _record(turns: list[tuple[str, str]], system: str | None, style: int) -> dict[str, Any]:
    *history, (question, answer) = turns
    if style == 0:
        record: dict[str, Any] = {
            "instruction": question,
            "output": answer,
            "history": [list(t) for t in history],
        }
        return {**record, "system": system} if system else record
    if style == 1:
        conversations = [{"from": "system", "value": system}] if system else []
        for q, a in turns:
            conversations += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        return {"conversations": conversations}
    messages = [{"role": "system", "content": system}] if system else []
    for q, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages}


def unit_dialogues(num: int, *, seed: int = 0, exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """``num`` dialogue records of one or two conversions, cycling through the three formats.

    Args:
        num: records to make.
        seed: random seed.
        exclude: final questions to avoid (e.g. the held-out ones), so splits never share a prompt.
    """
    rng = random.Random(seed)
    records, seen = [], set(exclude or ())
    while len(records) < num:
        turns = [conversion(rng) for _ in range(1 + (rng.random() < 0.3))]
        if turns[-1][0] in seen:
            continue
        seen.add(turns[-1][0])
        system = SYSTEM if rng.random() < 0.5 else None
        records.append(_record(turns, system, len(records) % 3))
    return records


def final_question(record: dict[str, Any]) -> str:
    """The last user question of a record made by :func:`unit_dialogues`."""
    if "instruction" in record:
        return record["instruction"]
    if "conversations" in record:
        return record["conversations"][-2]["value"]
    return record["messages"][-2]["content"]

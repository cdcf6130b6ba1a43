"""Records of JSON data files, each with the place it came from, for messages that name the bad record:

* ``.jsonl`` (any suffix but ``.json``): one record per line, blank lines skipped, named ``file:line``;
* ``.json``: one JSON list of records, named ``file[index]``.

A JSONL line that is not JSON comes as a :class:`MalformedRecord` in place of the record, so a reader can count or
report every problem of a file instead of stopping at the first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class MalformedRecord(ValueError):
    """A JSONL line that is not JSON; the message names ``file:line`` and what the parser found."""


def read_json_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(source, record)`` for each record of ``path``; a JSONL line that is not JSON comes as
    ``(source, MalformedRecord)``.

    Raises:
        ValueError: a ``.json`` file that is not JSON, or not a list.
    """
    path = Path(path)
    if path.suffix == ".json":
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: malformed JSON ({error.msg} at line {error.lineno})") from None
        if not isinstance(records, list):
            raise ValueError(
                f"{path}: a .json data file must hold a list of records; write one per line as .jsonl"
            )
        for index, record in enumerate(records):
            yield f"{path}[{index}]", record
        return
    with open(path, encoding="utf-8") as stream:
        for line_number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            source = f"{path}:{line_number}"
            try:
                yield source, json.loads(line)
            except json.JSONDecodeError as error:
                yield (
                    source,
                    MalformedRecord(f"{source}: malformed JSON ({error.msg} at column {error.colno})"),
                )

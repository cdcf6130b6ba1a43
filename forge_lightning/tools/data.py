"""``forge-data``: data preparation.

``forge-data pretrain --input A.jsonl B.txt DIR/ --tokenizer TOK --output-prefix OUT [--workers N]`` tokenizes
documents into a Megatron indexed dataset (``OUT.bin`` / ``OUT.idx``). ``forge-data train-tokenizer --input ...
--vocab-size N --output DIR`` trains a byte-level BPE tokenizer. ``forge-data quickstart --output DIR`` builds
the quick-start data (tokenizer + dataset) from the Python standard library's own sources. ``forge-data sft --check
FILE --tokenizer DIR [--template NAME] [--num N]`` prints rendered chat samples with the trained tokens highlighted.
``forge-data sft-quickstart --output DIR`` writes the fine-tuning quick start's chat data and tokenizer;
``forge-data vlm-quickstart --output DIR`` the vision-language one's images, questions and tokenizer.
``forge-data diffusion-quickstart --output DIR`` the text-to-video one's moving-shape clips, captions, word-level
text encoder and precompute config.
``forge-data vlm-pack`` packs vision-language records into rows offline (:mod:`forge_lightning.tools.vlm_pack`).
``forge-data precompute --config CFG.yaml --output DIR`` writes the frozen-encoder feature cache of a video-caption
dataset (:mod:`forge_lightning.datamodules.diffusion.precompute`). Later
subcommands plug in as one function each in ``COMMANDS``.

Inputs are ``.jsonl`` files (one document per line, text under ``--json-key``), ``.txt`` files (one document
per file, or per line with ``--split-lines``) and directories (their ``.jsonl`` / ``.txt`` files, recursively,
in sorted order).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import chain
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from forge_lightning.atomic_io import write_file
from forge_lightning.datamodules.corpus import DEFAULT_MAX_BYTES, collect_stdlib_corpus
from forge_lightning.datamodules.indexed import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    dtype_for_vocab_size,
)
from forge_lightning.datamodules.tokenizer import (
    TextTokenizer,
    TokenizerError,
    load_tokenizer,
    train_bpe_tokenizer,
)
from forge_lightning.tools import lerobot_data, vlm_pack

INPUT_SUFFIXES = (".jsonl", ".txt")
QUICKSTART_PREFIX = "stdlib_text_document"
QUICKSTART_TOKENIZER = "tokenizer"
QUICKSTART_MANIFEST = "quickstart.json"
DIFFUSION_QUICKSTART_TEXT_DIM = 16  # the word-level text encoder's width, the DiT's text_dim
_CHUNK_BYTES = 1 << 20
_CHUNK_DOCUMENTS = 1024

console = Console(highlight=False, soft_wrap=True)


class DataError(ValueError):
    """Input data that cannot be used (missing, malformed); the message names the file and line."""


def default_workers() -> int:
    """Number of CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------- inputs


def expand_inputs(inputs: Iterable[str | os.PathLike]) -> list[Path]:
    """Resolve input arguments to files: ``.jsonl`` / ``.txt`` files, and directories searched recursively.

    Raises:
        DataError: If an input is missing, has another suffix, or is a directory without input files.
    """
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in INPUT_SUFFIXES and p.is_file())
            if not found:
                raise DataError(f"input directory {path} holds no {' or '.join(INPUT_SUFFIXES)} files")
            files.extend(found)
        elif not path.exists():
            raise DataError(f"input {path} not found")
        elif path.suffix not in INPUT_SUFFIXES:
            raise DataError(f"input {path}: unsupported file type (expected .jsonl, .txt or a directory)")
        else:
            files.append(path)
    if not files:
        raise DataError("no inputs given")
    return files


def iter_documents(
    files: Sequence[Path], *, json_key: str = "text", split_lines: bool = False
) -> Iterator[tuple[str, int]]:
    """Yield ``(text, bytes consumed)`` for every document of ``files``, in order.

    Args:
        files: ``.jsonl`` and ``.txt`` files (see :func:`expand_inputs`).
        json_key: Key holding the text in each ``.jsonl`` record.
        split_lines: Read each non-blank line of a ``.txt`` file as a document (default: the whole file).

    Raises:
        DataError: For malformed JSON, a missing key, a non-string text or invalid UTF-8 (``file:line``).
    """
    for path in files:
        if path.suffix == ".jsonl":
            yield from _read_jsonl(path, json_key)
        elif split_lines:
            yield from _read_lines(path)
        else:
            raw = path.read_bytes()
            yield _decode(raw, path), len(raw)


def _read_jsonl(path: Path, json_key: str) -> Iterator[tuple[str, int]]:
    with open(path, "rb") as stream:
        for line_number, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{path}:{line_number}: malformed JSON ({error.msg} at column {error.pos + 1})"
                ) from None
            except UnicodeDecodeError:
                raise DataError(f"{path}:{line_number}: invalid UTF-8") from None
            if not isinstance(record, dict) or json_key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(
                    f"{path}:{line_number}: missing key {json_key!r} (found {keys}); set --json-key"
                )
            text = record[json_key]
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{line_number}: {json_key!r} is a {type(text).__name__}, not a string"
                )
            yield text, len(raw)


def _read_lines(path: Path) -> Iterator[tuple[str, int]]:
    with open(path, "rb") as stream:
        for line_number, raw in enumerate(stream, start=1):
            if raw.strip():
                yield _decode(raw, path, line_number).rstrip("\r\n"), len(raw)


def _decode(raw: bytes, path: Path, line_number: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        where = f"{path}:{line_number}" if line_number else f"{path} (byte {error.start})"
        raise DataError(f"{where}: invalid UTF-8") from None


# ----------------------------------------------------------------------------------------- tokenizing


@dataclass
class PretrainSummary:
    """What :func:`tokenize_to_indexed` wrote."""

    prefix: str
    documents: int
    tokens: int
    skipped_empty: int
    dtype: str
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Tokenizing throughput."""
        return self.tokens / max(self.seconds, 1e-9)


_worker_tokenizer: TextTokenizer | None = None
_worker_eod: int | None = None


def _init_worker(tokenizer_dir: str, eod: int | None, in_pool: bool) -> None:
    global _worker_tokenizer, _worker_eod
    if in_pool:
        # The processes are the parallelism; a Rust thread pool in each one would oversubscribe the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer, _worker_eod = load_tokenizer(tokenizer_dir), eod


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize texts in a worker; returns all ids back to back (+ EOD each) and the per-text lengths."""
    assert _worker_tokenizer is not None, "worker not initialised"
    eod = [] if _worker_eod is None else [_worker_eod]
    # A text that encodes to nothing stays empty (and is skipped); every other one ends with EOD.
    documents = [ids + eod if ids else ids for ids in _worker_tokenizer.encode_batch(texts)]
    lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
    flat = np.fromiter(chain.from_iterable(documents), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def _chunks(documents: Iterable[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    texts: list[str] = []
    size = 0
    for text, num_bytes in documents:
        texts.append(text)
        size += num_bytes
        if size >= _CHUNK_BYTES or len(texts) >= _CHUNK_DOCUMENTS:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


@contextmanager
def _ordered_pool(
    function: Callable, *, workers: int, initargs: tuple
) -> Iterator[Callable[[Iterable[tuple]], Iterator[tuple]]]:
    """Yield ``run(items)``, which yields ``(item, function(item[0]))`` in input order from ``workers``
    processes (or this one when ``workers`` is 1).

    The workers come from a fork server, not from ``fork`` of this process: a caller with threads (a progress
    bar, a test runner, a Rust thread pool) can hold a lock at the moment of the fork, and the child then waits on
    it forever. A worker that dies (killed for memory, say) raises :class:`DataError` instead of a silent hang.
    """
    if workers <= 1:
        _init_worker(*initargs, in_pool=False)
        yield lambda items: ((item, function(item[0])) for item in items)
        return
    if "forkserver" in get_all_start_methods():
        context = get_context("forkserver")
        context.set_forkserver_preload([__name__])
    else:
        context = get_context("spawn")
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(*initargs, True)
    )

    def result_of(future: Future) -> Any:
        try:
            return future.result()
        except BrokenProcessPool as error:
            raise DataError(
                f"a tokenizer worker process died ({error}); it may have been killed for memory: "
                "run again with fewer --workers"
            ) from error

    def run(items: Iterable[tuple]) -> Iterator[tuple]:
        # Pool.map would read the whole input ahead of the workers; a bounded window keeps memory flat.
        pending: deque = deque()
        for item in items:
            pending.append((item, pool.submit(function, item[0])))
            if len(pending) >= 2 * workers:
                item, future = pending.popleft()
                yield item, result_of(future)
        while pending:
            item, future = pending.popleft()
            yield item, result_of(future)

    try:
        yield run
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def tokenize_to_indexed(
    documents: Iterable[tuple[str, int]],
    *,
    tokenizer_dir: str | os.PathLike,
    output_prefix: str | os.PathLike,
    workers: int = 1,
    append_eod: bool = True,
    total_bytes: int | None = None,
    progress: bool = True,
) -> PretrainSummary:
    """Tokenize ``(text, bytes)`` documents with ``workers`` processes into ``OUTPUT_PREFIX.bin/.idx``.

    Token ids are stored as ``uint16`` when the vocabulary fits, else ``int32``. Documents that tokenize to
    nothing are skipped. The output appears atomically when every document is written.

    Args:
        documents: ``(text, size in bytes)`` pairs, e.g. from :func:`iter_documents`.
        tokenizer_dir: Hugging Face tokenizer directory.
        output_prefix: Output prefix of the indexed dataset.
        workers: Tokenizer processes (1: tokenize in this process).
        append_eod: End every document with the tokenizer's end-of-text token.
        total_bytes: Input size, for the progress bar.
        progress: Show a progress bar on stderr.
    """
    tokenizer = load_tokenizer(tokenizer_dir)
    if append_eod and tokenizer.eos_token_id is None:
        raise DataError(
            f"tokenizer {tokenizer_dir} has no end-of-text token; pass --no-append-eod or add one"
        )
    dtype = dtype_for_vocab_size(tokenizer.vocab_size)
    if dtype != np.uint16:
        console.print(f"vocabulary of {tokenizer.vocab_size} tokens exceeds uint16: writing int32 token ids")
    start, skipped = time.perf_counter(), 0
    initargs = (str(tokenizer_dir), tokenizer.eos_token_id if append_eod else None)
    with (
        _ordered_pool(_encode_chunk, workers=workers, initargs=initargs) as encode_in_order,
        _progress_bar(progress, total_bytes) as update,
        IndexedDatasetWriter(output_prefix, dtype=dtype) as writer,
    ):
        for (_, size), (flat, lengths) in encode_in_order(_chunks(documents)):
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            for k in np.flatnonzero(lengths):
                writer.add_document(flat[offsets[k] : offsets[k + 1]])
            skipped += int(np.count_nonzero(lengths == 0))
            update(advance=size, documents=writer.num_documents, tokens=writer.num_tokens)
    return PretrainSummary(
        prefix=os.fspath(output_prefix),
        documents=writer.num_documents,
        tokens=writer.num_tokens,
        skipped_empty=skipped,
        dtype=np.dtype(dtype).name,
        seconds=time.perf_counter() - start,
    )


@contextmanager
def _progress_bar(enabled: bool, total_bytes: int | None) -> Iterator[Callable[..., None]]:
    """Yield ``update(advance=bytes, documents=..., tokens=...)`` for a bar on stderr."""
    progress = Progress(
        TextColumn("tokenizing"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[documents]:,} docs, {task.fields[tokens]:,} tokens"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
    with progress:
        task = progress.add_task("tokenize", total=total_bytes, documents=0, tokens=0)
        yield partial(progress.update, task)


def _print_summary(summary: PretrainSummary) -> None:
    skipped = f"; skipped {summary.skipped_empty:,} empty documents" if summary.skipped_empty else ""
    console.print(
        f"wrote {summary.prefix}.bin / .idx: {summary.documents:,} documents, {summary.tokens:,} tokens "
        f"({summary.dtype}) in {summary.seconds:.1f} s, {summary.tokens_per_second:,.0f} tokens/s{skipped}"
    )


# ------------------------------------------------------------------------------------------ quickstart


def build_quickstart(
    output_dir: str | os.PathLike,
    *,
    vocab_size: int = 4096,
    max_bytes: int = DEFAULT_MAX_BYTES,
    workers: int | None = None,
    force: bool = False,
) -> dict:
    """Build the quick-start data: standard-library corpus, BPE tokenizer and indexed dataset.

    Writes ``OUTPUT_DIR/tokenizer/`` and ``OUTPUT_DIR/stdlib_text_document.bin/.idx``, then
    ``OUTPUT_DIR/quickstart.json`` recording the settings and sizes. When that record matches the settings
    and the outputs load, nothing is rebuilt unless ``force``.

    Args:
        output_dir: Directory to write.
        vocab_size: Tokenizer vocabulary size.
        max_bytes: Corpus budget (see :func:`~forge_lightning.datamodules.corpus.collect_stdlib_corpus`).
        workers: Tokenizer processes; all available cores by default.
        force: Rebuild even when the outputs are up to date.

    Returns:
        The record written to ``quickstart.json``.
    """
    output = Path(output_dir)
    settings = {"vocab_size": vocab_size, "max_bytes": max_bytes}
    if not force and (record := _current_quickstart(output, settings)) is not None:
        console.print(
            f"quick-start data in {output} is up to date ({record['tokens']:,} tokens); --force rebuilds it"
        )
        return record
    start = time.perf_counter()
    (output / QUICKSTART_MANIFEST).unlink(missing_ok=True)
    corpus = collect_stdlib_corpus(max_bytes=max_bytes)
    sizes = [len(text.encode("utf-8")) for _, text in corpus]
    console.print(f"corpus: {len(corpus)} standard-library files, {sum(sizes):,} bytes ({_since(start)})")
    step = time.perf_counter()
    tokenizer = train_bpe_tokenizer([text for _, text in corpus], vocab_size, output / QUICKSTART_TOKENIZER)
    console.print(
        f"tokenizer: byte-level BPE, {tokenizer.vocab_size} tokens -> {tokenizer.name} ({_since(step)})"
    )
    summary = tokenize_to_indexed(
        ((text, size) for (_, text), size in zip(corpus, sizes)),
        tokenizer_dir=output / QUICKSTART_TOKENIZER,
        output_prefix=output / QUICKSTART_PREFIX,
        workers=default_workers() if workers is None else workers,
        total_bytes=sum(sizes),
    )
    _print_summary(summary)
    record = {
        **settings,
        "python": ".".join(map(str, sys.version_info[:3])),
        "files": len(corpus),
        "corpus_bytes": sum(sizes),
        "tokenizer": QUICKSTART_TOKENIZER,
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "data_prefix": QUICKSTART_PREFIX,
        "documents": summary.documents,
        "tokens": summary.tokens,
    }
    _write_json_atomically(output / QUICKSTART_MANIFEST, record)
    console.print(
        f"quick-start data ready in {_since(start)}: data_prefix {output / QUICKSTART_PREFIX}, "
        f"tokenizer {output / QUICKSTART_TOKENIZER}"
    )
    return record


def _current_quickstart(output: Path, settings: dict) -> dict | None:
    """Return the quick-start record when it matches ``settings`` and the outputs load, else None."""
    try:
        record = json.loads((output / QUICKSTART_MANIFEST).read_text(encoding="utf-8"))
        if any(record.get(key) != value for key, value in settings.items()):
            return None
        data = IndexedDataset(output / record["data_prefix"])
        tokenizer = load_tokenizer(output / record["tokenizer"])
    except (OSError, ValueError, KeyError):
        return None
    current = data.num_tokens == record["tokens"] and tokenizer.vocab_size == record["tokenizer_vocab_size"]
    return record if current else None


def _write_json_atomically(path: Path, content: dict) -> None:
    text = json.dumps(content, indent=2) + "\n"
    write_file(path, lambda stream: stream.write(text.encode("utf-8")))


def _since(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


# ---------------------------------------------------------------------------------------- subcommands


def pretrain(args: argparse.Namespace) -> None:
    """Tokenize the inputs into a Megatron indexed dataset."""
    files = expand_inputs(args.input)
    summary = tokenize_to_indexed(
        iter_documents(files, json_key=args.json_key, split_lines=args.split_lines),
        tokenizer_dir=args.tokenizer,
        output_prefix=args.output_prefix,
        workers=args.workers,
        append_eod=args.append_eod,
        total_bytes=sum(path.stat().st_size for path in files),
        progress=not args.no_progress,
    )
    _print_summary(summary)


def train_tokenizer(args: argparse.Namespace) -> None:
    """Train a byte-level BPE tokenizer on the inputs."""
    files = expand_inputs(args.input)
    start = time.perf_counter()
    documents = iter_documents(files, json_key=args.json_key, split_lines=args.split_lines)
    tokenizer = train_bpe_tokenizer(
        (text for text, _ in documents), args.vocab_size, args.output, min_frequency=args.min_frequency
    )
    console.print(
        f"trained a byte-level BPE tokenizer of {tokenizer.vocab_size} tokens on {len(files)} file(s) "
        f"in {_since(start)} -> {args.output}"
    )
    if tokenizer.vocab_size < args.vocab_size:
        console.print(
            f"note: the corpus supports only {tokenizer.vocab_size} of the {args.vocab_size} tokens asked for"
        )


def quickstart(args: argparse.Namespace) -> None:
    """Build the quick-start tokenizer and dataset from the standard library's sources."""
    build_quickstart(
        args.output,
        vocab_size=args.vocab_size,
        max_bytes=args.max_bytes,
        workers=args.workers,
        force=args.force,
    )


def sft_check(args: argparse.Namespace) -> None:
    """Check every record of a chat file as training reads it (parsed, rendered with the template, tokenized, with
    tokens to train on), print the first ``--num`` rendered samples with their trained tokens highlighted, and
    report every problem with its ``file:line``."""
    from rich.text import Text

    from forge_lightning.datamodules.chat import ChatEncoder, ChatFormatError, read_records

    tokenizer = load_tokenizer(args.tokenizer)
    try:
        encoder = ChatEncoder(tokenizer.backend, args.template, train_on=args.train_on)
    except (ChatFormatError, ValueError) as error:
        raise DataError(str(error)) from None
    problems: list[str] = []
    untrained: list[str] = []  # training skips these
    records = shown = 0
    for conversation in read_records(args.check, args.format):
        records += 1
        if isinstance(conversation, ChatFormatError):
            problems.append(str(conversation))
            continue
        try:
            encoded = encoder.encode(conversation)
        except (ChatFormatError, ValueError) as error:
            problems.append(str(error))
            continue
        trained = int(encoded.trainable[1:].sum())
        if not trained:
            untrained.append(conversation.source)
        if shown < args.num:
            text = Text()
            for start, end, is_trained in encoded.segments:
                piece = tokenizer.decode(encoded.tokens[start:end].tolist())
                text.append(piece, style="bold black on green" if is_trained else "dim")
            console.rule(
                f"sample {shown} ({conversation.source}): {len(encoded.tokens)} tokens, {trained} trained"
            )
            console.print(text)
            shown += 1
    console.print(
        f"template {encoder.template.name!r}, train_on {args.train_on!r}: trained tokens are highlighted"
    )
    if untrained:
        console.print(
            f"{len(untrained)} record(s) have no token to train on (train_on {args.train_on!r}) and are skipped by "
            f"training: {', '.join(untrained[:5])}{' ...' if len(untrained) > 5 else ''}"
        )
    if problems:
        listed = "\n  ".join(problems[:50]) + (
            f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        )
        raise DataError(f"{len(problems)} problem(s) in {records} records of {args.check}:\n  {listed}")
    console.print(f"{records} records checked: all can be trained on")


def build_sft_quickstart(
    output_dir: str | os.PathLike, *, num_train: int = 4000, num_val: int = 200, seed: int = 0
) -> dict:
    """Write the fine-tuning quick start's data: unit-conversion dialogues and a ChatML tokenizer.

    ``OUTPUT_DIR/train.jsonl`` and ``OUTPUT_DIR/val.jsonl`` hold dialogues in the three chat formats; no validation
    question appears in training. ``OUTPUT_DIR/tokenizer/`` is a byte-level BPE trained on the dialogues with
    their digits removed, so every digit stays a token of its own (numbers are then copied digit by digit, which a
    tiny model learns in minutes), plus the ChatML special tokens and template.

    Returns:
        Sizes and paths of what was written.
    """
    import re

    from forge_lightning.datamodules.chat import add_chat_template
    from forge_lightning.datamodules.unit_dialogues import final_question, unit_dialogues

    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    val = unit_dialogues(num_val, seed=seed + 1)
    train = unit_dialogues(num_train, seed=seed, exclude={final_question(r) for r in val})
    for name, records in (("train.jsonl", train), ("val.jsonl", val)):
        (output / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    texts = [re.sub(r"[0-9]", " ", json.dumps(r)) for r in train]
    tokenizer = train_bpe_tokenizer(texts, 384, output / QUICKSTART_TOKENIZER)
    add_chat_template(output / QUICKSTART_TOKENIZER, "chatml")
    record = {"train": len(train), "val": len(val), "tokenizer_vocab_size": tokenizer.vocab_size + 2}
    console.print(
        f"sft quick-start data: {len(train)} train / {len(val)} held-out dialogues and a "
        f"{record['tokenizer_vocab_size']}-token ChatML tokenizer in {output}"
    )
    return record


def sft_quickstart(args: argparse.Namespace) -> None:
    """Write the fine-tuning quick-start data."""
    build_sft_quickstart(args.output, num_train=args.num_train, num_val=args.num_val, seed=args.seed)


def build_vlm_quickstart(
    output_dir: str | os.PathLike, *, num_train: int = 6000, num_val: int = 200, seed: int = 0
) -> dict:
    """Write the vision-language quick start's data: coloured-shape boards with one-word questions (LLaVA JSON
    lines + PNG images, see :mod:`forge_lightning.datamodules.vlm.shapes`) and a ChatML tokenizer with the
    ``<image>`` placeholder.

    Returns:
        Sizes and paths of what was written.
    """
    from forge_lightning.datamodules.chat import add_chat_template
    from forge_lightning.datamodules.tokenizer import add_special_tokens
    from forge_lightning.datamodules.vlm.shapes import IMAGE_TOKEN, vocabulary_text, write_shapes_dataset

    output = Path(output_dir)
    record = write_shapes_dataset(output, num_train=num_train, num_val=num_val, seed=seed)
    tokenizer = train_bpe_tokenizer(
        [vocabulary_text()] * 8, 320, output / QUICKSTART_TOKENIZER, min_frequency=1
    )
    add_chat_template(output / QUICKSTART_TOKENIZER, "chatml")
    add_special_tokens(output / QUICKSTART_TOKENIZER, [IMAGE_TOKEN])
    record["tokenizer_vocab_size"] = tokenizer.vocab_size + 3
    console.print(
        f"vlm quick-start data: {record['train']} train / {record['val']} held-out questions on "
        f"{record['image_size']}x{record['image_size']} boards and a ChatML tokenizer in {output}"
    )
    return record


def vlm_quickstart(args: argparse.Namespace) -> None:
    """Write the vision-language quick-start data."""
    build_vlm_quickstart(args.output, num_train=args.num_train, num_val=args.num_val, seed=args.seed)


def build_diffusion_quickstart(
    output_dir: str | os.PathLike, *, clips_per_caption: int = 40, seed: int = 0
) -> dict:
    """Write the text-to-video quick start's data: moving-shape clips with captions and the held-out prompts (see
    :mod:`forge_lightning.datamodules.diffusion.moving_shapes`), a word-level tokenizer with a tiny random UMT5
    (``encoder/``) and ``precompute.yaml``: pixel-space latents (``PixelLatents``) and the prompts' embeddings.

    Returns:
        Sizes of what was written.
    """
    import yaml

    from forge_lightning.datamodules.diffusion.moving_shapes import vocabulary, write_moving_shapes
    from forge_lightning.modules.diffusion.word_encoder import write_word_text_encoder

    output = Path(output_dir)
    record = write_moving_shapes(output, clips_per_caption=clips_per_caption, seed=seed)
    write_word_text_encoder(output / "encoder", vocabulary(), width=DIFFUSION_QUICKSTART_TEXT_DIM, seed=seed)
    precompute = {
        "data": {"entries": [str(output / "train.jsonl")], "buckets": [[5, 32, 32]], "fps": 8},
        "modules": [
            {
                "name": "pixels",
                "target": "forge_lightning.modules.diffusion.PixelLatents",
                "method": "encode",
                "inputs": {"video_BCFHW": "video"},
                "outputs": {"latents": ""},
            },
            {
                "name": "text_encoder",
                "target": "forge_lightning.modules.diffusion.WanTextEncoder.from_pretrained",
                "init_args": {"path": str(output / "encoder"), "dtype": "float32", "max_length": 8},
                "method": "encode",
                "inputs": {"prompts": "caption"},
                "outputs": {"text_embeddings": ""},
            },
        ],
        "batch_size": 32,
        "samples_per_shard": 512,
    }
    (output / "precompute.yaml").write_text(yaml.safe_dump(precompute, sort_keys=False), encoding="utf-8")
    console.print(
        f"diffusion quick-start data: {record['clips']} clips of {record['train_captions']} captions, "
        f"{record['held_out_captions']} held-out captions, a word-level text encoder and precompute.yaml in {output}"
    )
    return record


def diffusion_quickstart(args: argparse.Namespace) -> None:
    """Write the text-to-video quick-start data."""
    build_diffusion_quickstart(args.output, clips_per_caption=args.clips_per_caption, seed=args.seed)


def precompute_features(args: argparse.Namespace) -> None:
    """Run the config's frozen modules over its video-caption data into a feature cache (resumes a cut-off run)."""
    from forge_lightning.datamodules.diffusion.precompute import run_precompute

    try:
        run_precompute(args.config, args.output, device=args.device, log=console.print)
    except ValueError as error:  # a config, data or cache problem, named (CacheError, BadSampleError)
        raise DataError(str(error)) from None


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", nargs="+", required=True, help=".jsonl / .txt files or directories of them"
    )
    parser.add_argument(
        "--json-key", default="text", help="key of the text in .jsonl records (default: text)"
    )
    parser.add_argument("--split-lines", action="store_true", help="one document per line of .txt files")


def _add_pretrain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pretrain", help="tokenize documents into a Megatron indexed dataset (PREFIX.bin/.idx)"
    )
    _add_input_arguments(p)
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    p.add_argument("--workers", type=_positive_int, default=default_workers(), help="tokenizer processes")
    p.add_argument(
        "--append-eod", action=argparse.BooleanOptionalAction, default=True, help="end documents with EOS"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=pretrain)


def _add_train_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer (Hugging Face directory)")
    _add_input_arguments(p)
    p.add_argument("--vocab-size", type=_positive_int, required=True, help="vocabulary size")
    p.add_argument("--output", required=True, help="output tokenizer directory")
    p.add_argument("--min-frequency", type=_positive_int, default=2, help="minimum count of a merged pair")
    p.set_defaults(func=train_tokenizer)


def _add_quickstart(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quickstart", help="quick-start tokenizer + dataset from the Python standard library")
    p.add_argument(
        "--output", required=True, help=f"output directory (tokenizer/, {QUICKSTART_PREFIX}.bin/.idx)"
    )
    p.add_argument("--vocab-size", type=_positive_int, default=4096, help="vocabulary size (default: 4096)")
    p.add_argument("--max-bytes", type=_positive_int, default=DEFAULT_MAX_BYTES, help="corpus size budget")
    p.add_argument(
        "--workers", type=_positive_int, default=None, help="tokenizer processes (default: all cores)"
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the outputs are up to date")
    p.set_defaults(func=quickstart)


def _add_sft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sft", help="check chat data: print rendered samples with the trained tokens highlighted"
    )
    p.add_argument("--check", required=True, help="chat JSONL file (Alpaca, ShareGPT or OpenAI format)")
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory")
    p.add_argument(
        "--template", default=None, help="chatml, qwen, llama3 or a .jinja file (default: the tokenizer's)"
    )
    p.add_argument("--format", default="auto", help="auto, alpaca, sharegpt or openai (default: auto)")
    p.add_argument(
        "--train-on", default="assistant", help="assistant, last_assistant or all (default: assistant)"
    )
    p.add_argument("--num", type=_positive_int, default=3, help="samples to print (default: 3)")
    p.set_defaults(func=sft_check)


def _add_vlm_quickstart(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "vlm-quickstart", help="coloured-shape visual QA data + ChatML tokenizer for the VLM quick start"
    )
    p.add_argument("--output", type=Path, default=Path("data/vlm_quickstart"))
    p.add_argument("--num-train", type=_positive_int, default=6000)
    p.add_argument("--num-val", type=_positive_int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=vlm_quickstart)


def _add_diffusion_quickstart(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diffusion-quickstart",
        help="moving-shape clips + captions, a word-level text encoder and a precompute config for the diffusion "
        "quick start",
    )
    p.add_argument("--output", type=Path, default=Path("data/diffusion_quickstart"))
    p.add_argument("--clips-per-caption", type=_positive_int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=diffusion_quickstart)


def _add_sft_quickstart(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sft-quickstart", help="unit-conversion chat data + ChatML tokenizer for the SFT quick start"
    )
    p.add_argument("--output", required=True, help="output directory (train.jsonl, val.jsonl, tokenizer/)")
    p.add_argument("--num-train", type=_positive_int, default=4000, help="training dialogues (default: 4000)")
    p.add_argument("--num-val", type=_positive_int, default=200, help="held-out dialogues (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.set_defaults(func=sft_quickstart)


def _add_precompute(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "precompute", help="frozen-encoder features of video-caption data into a feature cache (safetensors)"
    )
    p.add_argument("--config", required=True, help="YAML: data, frozen modules, batch_size, device")
    p.add_argument("--output", required=True, help="the cache directory (an interrupted run resumes there)")
    p.add_argument("--device", default=None, help="where the modules run (default: the config's device)")
    p.set_defaults(func=precompute_features)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_pretrain,
    _add_train_tokenizer,
    _add_quickstart,
    _add_sft,
    _add_sft_quickstart,
    _add_vlm_quickstart,
    _add_diffusion_quickstart,
    lerobot_data.add_commands,
    vlm_pack.add_commands,
    _add_precompute,
]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``forge-data``; data errors exit with a one-line message naming the file."""
    parser = argparse.ArgumentParser(
        prog="forge-data",
        description="Data preparation: tokenizers, pre-training datasets, quick-start data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (DataError, IndexedDatasetError, TokenizerError, FileNotFoundError) as error:
        raise SystemExit(f"forge-data {args.command}: error: {error}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())

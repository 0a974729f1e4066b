"""Tokenizing worker processes for `mshpc prepare`: jobs in, tokenized documents out, in order.

At most two jobs per worker are in flight (each about records.BLOCK_BYTES of text), and a
worker encodes a job in pieces of about ENCODE_CHARS, so memory stays bounded whatever the corpus
size; results come back in job order, and a job's documents do not depend on which worker ran
it, so the dataset is the same bytes for any worker count. Workers are forked after the
tokenizer is loaded, each using one core (the tokenizers library's own thread pool is turned off
in them: the workers are the parallelism); one pool serves several streams of jobs in turn (the
held-out inputs, then the corpus).
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult, Pool

import numpy as np

from mshpc.data.records import Job, Reading
from mshpc.data.tokenizer import Tokenizer
from mshpc.errors import DataError

IN_FLIGHT_PER_WORKER = 2
# Text per call into the tokenizer library: `tokenizers` holds ~70 bytes a token while it encodes
# (token strings, offsets, masks), ~70 MB for a whole 4 MB job, ~10 MB for a piece of this size.
ENCODE_CHARS = 1 << 19


@dataclass(frozen=True)
class Tokenized:
    """A job's documents: their ids (each ending in the end-of-document id) back to back, their
    lengths, the sha256 of each one's text (when the held-out split needs them), what was skipped."""

    ids: np.ndarray
    lengths: np.ndarray  # int64
    digests: bytes  # 32 bytes per document, or empty
    input_bytes: int
    skipped: int  # bad records skipped
    first_bad: str | None  # the first skipped record's line, for the log


@dataclass(frozen=True)
class Task:
    """What every job is tokenized with."""

    tokenizer: Tokenizer
    reading: Reading
    dtype: np.dtype
    digests: bool


def _record_text(line: bytes, where: str, number: int, field: str) -> str:
    """The text of one JSONL line, or a DataError naming the file and line."""
    try:
        record = json.loads(line)
    except ValueError as exc:  # json's errors and invalid UTF-8 alike
        raise DataError(f"input {where}:{number}: not valid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise DataError(f"input {where}:{number}: a JSON {type(record).__name__}, not an object")
    if field not in record:
        raise DataError(f"input {where}:{number}: no field {field!r} (fields: {', '.join(map(str, record)) or 'none'}; "
                        "choose one with --text-field)")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"input {where}:{number}: field {field!r} is a JSON {type(text).__name__}, not a string")
    return text


def job_texts(job: Job, reading: Reading) -> tuple[list[str], int, str | None]:
    """The documents of a job, bad records skipped when asked (how many, and the first's error)."""
    if not job.lines:
        return list(job.texts), job.skipped, None
    texts, skipped, first = [], job.skipped, None
    for number, line in enumerate(job.lines.split(b"\n"), job.first):
        if not line.strip():
            continue
        try:
            text = _record_text(line, job.where, number, reading.text_field)
        except DataError as exc:
            if not reading.skip_bad:
                raise DataError(f"{exc} (--skip-bad-records skips such records)") from None
            skipped, first = skipped + 1, first or str(exc)
            continue
        if text:
            texts.append(text)
    return texts, skipped, first


def _encode(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """`tokenizer.encode_batch` of `texts`, in calls of about ENCODE_CHARS characters."""
    encoded: list[np.ndarray] = []
    start = size = 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= ENCODE_CHARS or i == len(texts) - 1:
            encoded += tokenizer.encode_batch(texts[start:i + 1])
            start, size = i + 1, 0
    return encoded


def tokenize(job: Job, task: Task) -> Tokenized:
    """The documents of `job`, tokenized: each the tokenizer's ids, then the end-of-document id."""
    texts, skipped, first = job_texts(job, task.reading)
    encoded = _encode(task.tokenizer, texts)
    eos = task.tokenizer.eos_id
    pieces: list[np.ndarray] = []
    for ids in encoded:
        pieces.append(ids)
        if not (len(ids) and int(ids[-1]) == eos):
            pieces.append(np.array([eos], dtype=ids.dtype))
    lengths = np.fromiter((len(a) + (0 if len(a) and int(a[-1]) == eos else 1) for a in encoded),
                          dtype=np.int64, count=len(encoded))
    flat = np.concatenate(pieces).astype(task.dtype, copy=False) if pieces else np.empty(0, task.dtype)
    digests = b"".join(hashlib.sha256(t.encode("utf-8", errors="surrogatepass")).digest() for t in texts) \
        if task.digests else b""
    return Tokenized(flat, lengths, digests, job.input_bytes, skipped, first)


_TASK: Task | None = None  # the forked workers' task, set in the parent before the fork


def _init_worker() -> None:
    # One core per worker: the tokenizers library would start a thread per core in each worker.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _run(job: Job) -> Tokenized:
    assert _TASK is not None
    return tokenize(job, _TASK)


class TokenizePool:
    """`tokenize` on `workers` processes (1: in this process), forked on entering; `map` may be
    called for one stream of jobs after another."""

    def __init__(self, task: Task, workers: int) -> None:
        self.task, self.workers = task, workers
        self._pool: Pool | None = None

    def __enter__(self) -> TokenizePool:
        global _TASK
        if self.workers > 1:
            # Whatever the tokenizer builds on its first batch (a BPE's fast engine) is built once,
            # here, and the forked workers share it.
            self.task.tokenizer.encode_batch([])
            _TASK = self.task
            self._pool = multiprocessing.get_context("fork").Pool(self.workers, initializer=_init_worker)
        return self

    def __exit__(self, *exc: object) -> None:
        global _TASK
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool, _TASK = None, None

    def map(self, jobs: Iterable[Job]) -> Iterator[Tokenized]:
        """`tokenize` of every job, in order."""
        if self._pool is None:
            yield from (tokenize(job, self.task) for job in jobs)
            return
        pending: collections.deque[AsyncResult[Tokenized]] = collections.deque()
        for job in jobs:
            pending.append(self._pool.apply_async(_run, (job,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def tokenize_all(jobs: Iterable[Job], task: Task, workers: int) -> Iterator[Tokenized]:
    """`tokenize` of every job, in order, on `workers` processes (1: in this process)."""
    with TokenizePool(task, workers) as pool:
        yield from pool.map(jobs)

"""timings/rank-N.jsonl: each rank's per-step phase times, and reading them back.

A rank's file starts (and, after each restart, continues) with a header line naming the rank,
its host, its (dp, tp, pp) coordinates and the mesh's [pp, dp, tp] sizes; then one line per step:
`{"step": 12, "time": unix s, "step_s": 0.31, "spans": 40, "phases": {"forward": 0.1, ...}}`
(spans: how many timed spans the step recorded, for the timers' own cost).
A step trained twice (a restart from a checkpoint before it) counts as its last record. A run
resumed at another layout is read at its last layout: each rank's records since that layout began,
and only the ranks of that mesh (`read_timings(..., mesh=)`).

Writing is off the hot path: the loop hands a step's unread marks to a queue; a thread reads
them once they have completed (CUDA events: a step or more later), writes the line, and flushes
every `flush_interval_s`. No rank gathers anything over the network for this.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mshpc.diagnose.timers import CATEGORIES, StepSpans, category
from mshpc.diagnose.watch_stream import StreamWriter
from mshpc.errors import RunEnvironmentError, writing_to
from mshpc.events import open_for_append
from mshpc.full_disk import HeldAppend
from mshpc.mesh_shape import Coords, MeshShape

log = logging.getLogger(__name__)

TIMINGS_DIR = "timings"
_POLL_S = 0.05  # how often the writer looks again at CUDA events that have not completed


def rank_file(run_dir: Path, rank: int) -> Path:
    return run_dir / TIMINGS_DIR / f"rank-{rank:05d}.jsonl"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str
    coords: Coords


def header(info: RankInfo, clock: str, start_step: int, mesh: MeshShape | None = None) -> dict[str, Any]:
    """A rank's header line; "rank" comes first, so `is_header` knows it without parsing."""
    c = info.coords
    head = {"rank": info.rank, "host": info.host, "pp": c.pp, "dp": c.dp, "tp": c.tp,
            "clock": clock, "start_step": start_step, "time": time.time()}
    if mesh is not None:
        head["mesh"] = [mesh.pp, mesh.dp, mesh.tp]
    return head


def layout_key(head: dict[str, Any]) -> tuple[Any, ...]:
    """What changes with the layout: the mesh's sizes and the rank's coordinates (a header from
    before the sizes were written: the coordinates alone)."""
    return (tuple(head.get("mesh") or ()), head.get("pp"), head.get("dp"), head.get("tp"))


def is_header(line: str) -> bool:
    return line.startswith('{"rank"')


class TimingsWriter:
    """Appends this rank's step records from a background thread; `after_write(step)` runs on
    that thread after each record (rank 0's straggler watch). A write that fails there (a full
    disk) stops the thread and is raised on the train loop's thread, at its next put or close."""

    def __init__(self, path: Path, head: dict[str, Any], flush_interval_s: float,
                 after_write: Callable[[int], None] = lambda step: None,
                 stream: StreamWriter | None = None) -> None:
        self.path, self._stream = path, stream  # stream: this rank's watch record of each step
        with writing_to(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            # a restart after a torn line; lines a full disk refuses wait there (mshpc/full_disk.py)
            self._file = HeldAppend(open_for_append(path), str(path))
            self._file.write((json.dumps(head) + "\n").encode())
            # where the next line starts (lines held back by a full disk included)
            self._offset = os.fstat(self._file.fd).st_size + len(self._file.held)
        self._flush_interval_s, self._after_write = flush_interval_s, after_write
        self._error: OSError | RunEnvironmentError | None = None  # set once, by the thread, as it stops
        self._raised = False
        self._queue: queue.SimpleQueue[StepSpans | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mshpc-timings", daemon=True)
        self._thread.start()

    def put(self, spans: StepSpans) -> None:
        """The hot path's whole cost: one queue put (and a look at whether the thread failed)."""
        self._raise_error()
        self._queue.put(spans)

    def close(self) -> None:
        """Write every step handed over so far, then stop."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:  # the buffer's rest fails again: the first error says it
            with contextlib.suppress(OSError):
                os.close(self._file.fd)
            self._raise_error()
            return
        with writing_to(self.path):
            self._file.close()
            if self._stream is not None:
                self._stream.close()

    def _raise_error(self) -> None:
        """Raise the thread's error once: a close during that error's unwinding must not hide it."""
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def _run(self) -> None:
        try:
            with writing_to(self.path):
                self._write_until_closed()
        except (OSError, RunEnvironmentError) as exc:
            self._error = exc

    def _write_until_closed(self) -> None:
        waiting: list[StepSpans] = []
        last_flush, closing = time.monotonic(), False
        while not closing or waiting:
            try:
                item = self._queue.get(timeout=_POLL_S if waiting else None)
                if item is None:
                    closing = True
                else:
                    waiting.append(item)
            except queue.Empty:
                pass
            while waiting and (waiting[0].ready() or (closing and _settle(waiting[0]))):
                self._write(waiting.pop(0))  # in step order: a later step never waits on nothing
            if closing or time.monotonic() - last_flush >= self._flush_interval_s:
                # the stream after the lines its records point into; a full disk holds both
                if self._file.flush() and self._stream is not None:
                    self._stream.flush()
                last_flush = time.monotonic()

    def _write(self, spans: StepSpans) -> None:
        step_s, phases = spans.resolve()
        record = {"step": spans.step, "time": time.time(), "step_s": round(step_s, 7),
                  "spans": len(spans.spans), "phases": {k: round(v, 7) for k, v in phases.items()}}
        line = json.dumps(record) + "\n"  # ASCII (json's default): its length is its bytes
        self._file.add(line.encode())
        if self._stream is not None:
            compute, data_wait = (sum(v for p, v in phases.items() if category(p) == c) for c in ("compute", "data wait"))
            self._stream.add(spans.step, step_s, compute, data_wait, self._offset)
        self._offset += len(line)
        try:
            self._after_write(spans.step)
        except Exception:  # noqa: BLE001  diagnosis must never stop training; say why, once per step
            log.exception("straggler watch failed at step %d", spans.step)


def _settle(spans: StepSpans) -> bool:
    """At close only: wait (on this thread) for the last marks to complete."""
    while not spans.ready():
        time.sleep(_POLL_S)
    return True


# ---------------------------------------------------------------- reading


def parse_records(lines: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(headers, step records in file order) of one rank's lines; torn lines are skipped. The
    step lines are parsed in one `json.loads` of a JSON array (a call per line costs twice as
    much at 12,288 ranks x 1,000 steps); only a file with a torn line pays line by line."""
    headers: list[str] = []
    body: list[str] = []
    for line in lines:
        (headers if is_header(line) else body).append(line)
    try:
        records = json.loads("[" + ",".join(body) + "]") if body else []
    except ValueError:
        records = [r for r in map(_loads_or_none, body) if r is not None]
    return [h for h in map(_loads_or_none, headers) if h is not None], records


def _loads_or_none(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None  # torn by a crash mid-write
    return record if isinstance(record, dict) else None


def parse_lines(lines: list[str]) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """(headers, {step: record}) of one rank's lines; a repeated step keeps its last record."""
    headers, records = parse_records(lines)
    return headers, {r["step"]: r for r in records}


def rank_info(head: dict[str, Any]) -> RankInfo:
    return RankInfo(head["rank"], head["host"], Coords(pp=head["pp"], dp=head["dp"], tp=head["tp"]))


@dataclass(frozen=True)
class RankColumns:
    """One rank's step records as columns in step order (a repeated step: its last record)."""

    info: RankInfo
    steps: np.ndarray  # (n,) int64
    step_s: np.ndarray  # (n,)
    phases: dict[str, np.ndarray]  # phase -> (n,) seconds; 0 where a step had none of it

    @staticmethod
    def of(info: RankInfo, records: list[dict[str, Any]]) -> RankColumns:
        n = len(records)
        names = sorted({p for r in records for p in r["phases"]})
        return RankColumns.last_per_step(
            info, np.fromiter((r["step"] for r in records), np.int64, n),
            np.fromiter((r["step_s"] for r in records), float, n),
            {p: np.fromiter((r["phases"].get(p, 0.0) for r in records), float, n) for p in names})

    @staticmethod
    def last_per_step(info: RankInfo, steps: np.ndarray, step_s: np.ndarray,
                      phases: dict[str, np.ndarray]) -> RankColumns:
        """Columns in file order -> in step order, each step's last record only."""
        _, last = np.unique(steps[::-1], return_index=True)
        keep = len(steps) - 1 - last
        return RankColumns(info, steps[keep], step_s[keep], {p: v[keep] for p, v in phases.items()})


def read_rank_file(path: Path) -> RankColumns | None:
    """One rank's file (None without a header): its last header names the rank. A file of one
    process's steps, each line with the same keys in the same order (what the writer writes),
    takes the fast path: its numbers are read as one table, without a parsed dict per line."""
    data = path.read_bytes()
    head, _, body = data.partition(b"\n")
    if head.startswith(b'{"rank"') and b'{"rank"' not in body:
        table = step_table(body)
        if table is not None:
            keys, values = table
            column = {key: values[:, i] for i, key in enumerate(keys)}
            phases = {key[len(PHASE_KEY):]: v for key, v in column.items() if key.startswith(PHASE_KEY)}
            return RankColumns.last_per_step(rank_info(json.loads(head)), column["step"].astype(np.int64),
                                             column["step_s"], phases)
    headers, records = parse_records(_last_layout(data.decode(errors="replace").splitlines()))
    return RankColumns.of(rank_info(headers[-1]), records) if headers else None


def _last_layout(lines: list[str]) -> list[str]:
    """The lines from the first header of the last layout on (a restart at the same layout
    continues its history; a resume at another starts a new one)."""
    starts = [(i, _loads_or_none(line)) for i, line in enumerate(lines) if is_header(line)]
    heads = [(i, h) for i, h in starts if h is not None]
    if not heads:
        return lines
    last, first = layout_key(heads[-1][1]), heads[-1][0]
    for i, h in reversed(heads):
        if layout_key(h) != last:
            break
        first = i
    return lines[first:]


PHASE_KEY = "phases/"


def step_table(body: bytes) -> tuple[list[str], np.ndarray] | None:
    """Whole step lines that all have the same keys in the same order, as (keys, a (lines, keys)
    table of their numbers); None for anything else (a torn line, a phase only some steps have),
    which the caller parses line by line. Without braces and commas a line is `"key": value`
    tokens; bytes.split does that at C speed, where a regex or a dict per line would not."""
    n = body.count(b"\n")
    if not n or not body.endswith(b"\n"):
        return None
    try:
        first = json.loads(body[:body.index(b"\n")])
    except ValueError:
        return None
    if not isinstance(first, dict):
        return None
    keys = _flat_keys(first)
    tokens = body.replace(b'"phases": {', b"").translate(None, b"{},").split()
    names = [f'"{key.removeprefix(PHASE_KEY)}":'.encode() for key in keys]
    if len(tokens) != 2 * n * len(keys) or tokens[0::2] != names * n or not {"step", "step_s"} <= set(keys):
        return None
    try:
        values = np.array(tokens[1::2], dtype=float)
    except ValueError:
        return None  # a value that is not a number
    return keys, values.reshape(n, len(keys))


def _flat_keys(record: dict[str, Any]) -> list[str]:
    """A step record's keys in order, its phases as "phases/<name>"."""
    keys = []
    for key, value in record.items():
        keys += [PHASE_KEY + p for p in value] if key == "phases" and isinstance(value, dict) else [key]
    return keys


@dataclass(frozen=True)
class Timings:
    """Every rank's step records as arrays over (rank, step); NaN where a rank lacks a step."""

    ranks: list[RankInfo]  # in rank order
    steps: np.ndarray  # (n_steps,)
    step_s: np.ndarray  # (n_ranks, n_steps)
    phases: dict[str, np.ndarray]  # phase -> (n_ranks, n_steps); 0 where a step had none of it

    def category(self, name: str) -> np.ndarray:
        """(n_ranks, n_steps) seconds in one of timers.CATEGORIES."""
        assert name in CATEGORIES, name
        total = np.where(np.isnan(self.step_s), np.nan, 0.0)
        for phase, seconds in self.phases.items():
            if category(phase) == name:
                total += seconds
        return total


def read_timings(run_dir: Path, mesh: MeshShape | None = None) -> Timings | None:
    """Every rank's timings under `run_dir` (None when there are none): each file becomes columns
    as it is read, so memory holds numbers, never the 12 million parsed records of a large run.
    With `mesh` (the run's last layout), only the ranks of that mesh: a rank beyond it, or at
    coordinates outside it, trained at an earlier layout."""
    per_rank = [c for c in map(read_rank_file, sorted((run_dir / TIMINGS_DIR).glob("rank-*.jsonl")))
                if c is not None and (mesh is None or in_mesh(c.info, mesh))]
    return assemble(per_rank) if per_rank else None


def in_mesh(info: RankInfo, mesh: MeshShape) -> bool:
    """Whether a rank's last header places it in `mesh` (where the rank is, its coordinates are)."""
    return info.rank < mesh.world_size and mesh.coords(info.rank) == info.coords


def to_arrays(per_rank: list[tuple[RankInfo, dict[int, dict[str, Any]]]]) -> Timings:
    return assemble([RankColumns.of(info, list(recs.values())) for info, recs in per_rank])


def assemble(per_rank: list[RankColumns]) -> Timings:
    """The (rank, step) arrays of every rank's columns."""
    per_rank = sorted(per_rank, key=lambda c: c.info.rank)
    steps = np.unique(np.concatenate([c.steps for c in per_rank]))
    names = sorted({p for c in per_rank for p in c.phases})
    step_s = np.full((len(per_rank), len(steps)), np.nan)
    phases = {name: np.full_like(step_s, np.nan) for name in names}
    for row, c in enumerate(per_rank):
        cols = np.searchsorted(steps, c.steps)
        step_s[row, cols] = c.step_s
        for name in names:
            phases[name][row, cols] = c.phases.get(name, 0.0)
    return Timings([c.info for c in per_rank], steps, step_s, phases)

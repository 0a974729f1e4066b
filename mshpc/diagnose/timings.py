"""timings/rank-N.jsonl: each rank's per-step phase times, and reading them back.

A rank's file starts (and, after each restart, continues) with a header line naming the rank,
its host and its (dp, tp, pp) coordinates; then one line per step:
`{"step": 12, "time": unix s, "step_s": 0.31, "spans": 40, "phases": {"forward": 0.1, ...}}`
(spans: how many timed spans the step recorded, for the timers' own cost).
A step trained twice (a restart from a checkpoint before it) counts as its last record.

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
from typing import Any, TextIO

import numpy as np

from mshpc.diagnose.timers import CATEGORIES, StepSpans, category
from mshpc.errors import RunEnvironmentError, writing_to
from mshpc.events import open_for_append
from mshpc.mesh_shape import Coords

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


def header(info: RankInfo, clock: str, start_step: int) -> dict[str, Any]:
    """A rank's header line; "rank" comes first, so `is_header` knows it without parsing."""
    c = info.coords
    return {"rank": info.rank, "host": info.host, "pp": c.pp, "dp": c.dp, "tp": c.tp,
            "clock": clock, "start_step": start_step, "time": time.time()}


def is_header(line: str) -> bool:
    return line.startswith('{"rank"')


class TimingsWriter:
    """Appends this rank's step records from a background thread; `after_write(step)` runs on
    that thread after each record (rank 0's straggler watch). A write that fails there (a full
    disk) stops the thread and is raised on the train loop's thread, at its next put or close."""

    def __init__(self, path: Path, head: dict[str, Any], flush_interval_s: float,
                 after_write: Callable[[int], None] = lambda step: None) -> None:
        self.path = path
        with writing_to(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file: TextIO = os.fdopen(open_for_append(path), "a")  # a restart after a torn line
            self._file.write(json.dumps(head) + "\n")
            self._file.flush()
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
                self._file.close()
            self._raise_error()
            return
        with writing_to(self.path):
            self._file.close()

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
                self._file.flush()
                last_flush = time.monotonic()

    def _write(self, spans: StepSpans) -> None:
        step_s, phases = spans.resolve()
        record = {"step": spans.step, "time": time.time(), "step_s": round(step_s, 7),
                  "spans": len(spans.spans), "phases": {k: round(v, 7) for k, v in phases.items()}}
        self._file.write(json.dumps(record) + "\n")
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


def parse_lines(lines: list[str]) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """(headers, {step: record}) of one rank's lines; torn lines are skipped, a repeated step
    keeps its last record."""
    headers, steps = [], {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # torn by a crash mid-write
        if "step" in record:
            steps[record["step"]] = record
        elif "rank" in record:
            headers.append(record)
    return headers, steps


def rank_info(head: dict[str, Any]) -> RankInfo:
    return RankInfo(head["rank"], head["host"], Coords(pp=head["pp"], dp=head["dp"], tp=head["tp"]))


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
                total = total + seconds
        return total


def read_timings(run_dir: Path) -> Timings | None:
    """Every rank's timings under `run_dir` (None when there are none)."""
    per_rank = []
    for path in sorted((run_dir / TIMINGS_DIR).glob("rank-*.jsonl")):
        headers, steps = parse_lines(path.read_text().splitlines())
        if headers:
            per_rank.append((rank_info(headers[-1]), steps))
    if not per_rank:
        return None
    return to_arrays(per_rank)


def to_arrays(per_rank: list[tuple[RankInfo, dict[int, dict[str, Any]]]]) -> Timings:
    per_rank = sorted(per_rank, key=lambda item: item[0].rank)
    steps = np.array(sorted({s for _, recs in per_rank for s in recs}), dtype=np.int64)
    column = {int(s): i for i, s in enumerate(steps)}
    step_s = np.full((len(per_rank), len(steps)), np.nan)
    names = sorted({p for _, recs in per_rank for r in recs.values() for p in r["phases"]})
    phases = {name: np.where(np.isnan(step_s), np.nan, 0.0) for name in names}
    for row, (_, records) in enumerate(per_rank):
        for step, record in records.items():
            col = column[step]
            step_s[row, col] = record["step_s"]
            for name in names:
                phases[name][row, col] = record["phases"].get(name, 0.0)
    return Timings([info for info, _ in per_rank], steps, step_s, phases)

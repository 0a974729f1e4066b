"""Straggler detection: which rank is persistently slower than its peers.

Two scores per step, rank and phase, after NVIDIA's resiliency extension (nvidia-resiliency-ext,
straggler detection: "relative" and "individual" performance scores, 1.0 = as fast as the
reference, 0.5 = twice as slow):

- relative: the median of the other ranks' times in the phase over this rank's time (the
  extension compares with the best rank; a median is not fooled by one lucky rank);
- individual: the rank's best median over a window of its own history over its median of the
  last window (the extension's reference is the rank's best performance, too).

Times below `floor` x the step's median duration count as that floor, so that jitter in a phase
that is nearly empty (data wait, usually) is not slowness. A rank is a straggler while the
rolling median (over `window_steps`) of its relative score falls below `threshold` for its own
work: compute, or data wait. Communication and bubble are not scored for blame: a collective
lasts until its slowest member arrives, so the healthy ranks are the ones that wait longest.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mshpc.config import DiagnoseConfig, load_config
from mshpc.diagnose.timers import category
from mshpc.diagnose.timings import (
    PHASE_KEY,
    RankInfo,
    Timings,
    parse_records,
    rank_file,
    rank_info,
    read_timings,
    step_table,
)
from mshpc.diagnose.watch_stream import RECORD, StreamReader
from mshpc.events import append_event

log = logging.getLogger(__name__)

BLAMED = ("compute", "data wait")  # the categories that are a rank's own work
RANK_CHUNK = 512  # ranks per slice of a rolling median over a whole run
FINAL_POLL_S = 0.05  # how often the end-of-run look re-reads the streams while it waits


def median_of_others(seconds: np.ndarray) -> np.ndarray:
    """(ranks, ...) -> for each rank, the median of the other ranks (of itself when alone).
    Leaving the rank out lets two ranks tell which of them is slow, and changes nothing at scale."""
    n = seconds.shape[0]
    if n == 1:
        return seconds
    lo, hi = (n - 2) // 2, (n - 1) // 2  # the middle positions among the n - 1 others
    # four order statistics by partition (O(n)), not a sort: a check at 12,288 ranks did two
    # argsorts per step and category
    part = np.partition(seconds, sorted({lo, lo + 1, hi, hi + 1}), axis=0)

    def others_at(j: int) -> np.ndarray:  # the j-th smallest among the other ranks: a rank at
        # or below it (in value) moves it one up when left out; NaN sorts last, as in a sort
        return np.where(seconds <= part[j], part[j + 1], part[j])

    low = others_at(lo)
    return low if lo == hi else (low + others_at(hi)) / 2  # an odd count of others: one middle


def relative_scores(seconds: np.ndarray, floor: np.ndarray | float) -> np.ndarray:
    """(ranks, ...) seconds -> the other ranks' median time over each rank's, both at least `floor`."""
    return np.maximum(median_of_others(seconds), floor) / np.maximum(seconds, floor)


def individual_scores(history: np.ndarray, window: int, floor: float) -> np.ndarray | None:
    """(steps, ranks) seconds, oldest first -> each rank's best (lowest) median over any `window`
    steps of its history, over its median of the last `window` (None with under two windows)."""
    if len(history) < 2 * window:
        return None
    best = np.empty(history.shape[1:])
    # a rank chunk at a time: the windows' median copies (steps x ranks x window) floats, which
    # for 12,288 ranks x 1,000 steps was 1 GB at once (and twice that inside nanmedian)
    for lo in range(0, history.shape[1], RANK_CHUNK):
        windows = np.lib.stride_tricks.sliding_window_view(history[:, lo:lo + RANK_CHUNK], window, axis=0)
        best[lo:lo + RANK_CHUNK] = np.nanmin(np.nanmedian(windows, axis=2), axis=0)  # (n, ranks, window) -> (ranks,)
    recent = np.nanmedian(history[-window:], axis=0)
    return np.maximum(best, floor) / np.maximum(recent, floor)


@dataclass(frozen=True)
class Straggler:
    """A rank the detector blames, as an event and for the supervisor (issue #7) to evict."""

    rank: int
    host: str
    dp: int
    tp: int
    pp: int
    since_step: int  # the step at which it was first flagged in this stretch
    step: int  # the latest step seen
    category: str  # "compute" or "data wait"
    phase: str  # the phase of that category with the largest excess over the other ranks' median
    relative_score: float  # rolling median; 0.87: 15% slower than the other ranks' median
    individual_score: float | None  # vs its own history; None while there is too little of it


class _Window:
    """The last `size` steps' (ranks,) relative scores of one category, as a ring, with how many
    of them each rank has under the threshold: a rolling median falls under the threshold only
    with half the window under it, so only those ranks' medians are computed (a median of every
    rank's window at every step was a third of a check's cost at 12,288 ranks)."""

    def __init__(self, size: int, n_ranks: int, threshold: float) -> None:
        self.rows = np.empty((size, n_ranks))
        self.threshold, self.filled, self._next = threshold, 0, 0
        self.below = np.zeros(n_ranks, np.int64)

    def push(self, scores: np.ndarray) -> None:
        if self.filled == len(self.rows):  # the oldest step leaves the window
            self.below -= self.rows[self._next] < self.threshold
        else:
            self.filled += 1
        self.rows[self._next] = scores
        self.below += scores < self.threshold
        self._next = (self._next + 1) % len(self.rows)

    def full(self) -> bool:
        return self.filled == len(self.rows)

    def candidates(self) -> np.ndarray:
        """Ranks whose rolling median may be under the threshold (an even window's median is
        the mean of its two middle scores: the lower one under is enough)."""
        return np.flatnonzero(2 * self.below >= self.filled)

    def median(self, ranks: np.ndarray) -> np.ndarray:
        return np.median(self.rows[:self.filled, ranks], axis=0)


class StragglerDetector:
    """Fed the steps of every rank in step order, one or a block at a time; tracks who is a
    straggler now."""

    def __init__(self, cfg: DiagnoseConfig, ranks: list[RankInfo]) -> None:
        self.cfg, self.ranks = cfg, ranks
        self._relative = {c: _Window(cfg.straggler_window_steps, len(ranks), cfg.straggler_threshold) for c in BLAMED}
        self._seconds: dict[str, collections.deque[np.ndarray]] = {c: collections.deque(maxlen=cfg.straggler_history_steps) for c in BLAMED}
        self.flagged: dict[int, Straggler] = {}  # by index in `ranks`
        self.last_step = -1
        self._floor = 0.0

    def update(self, step: int, step_s: np.ndarray, phases: dict[str, np.ndarray]) -> list[Straggler]:
        """One step: (ranks,) step seconds and {phase: (ranks,) seconds}; returns the ranks newly
        flagged at this step."""
        seconds = {cat: sum((v for p, v in phases.items() if category(p) == cat), np.zeros(len(self.ranks)))
                   for cat in BLAMED}
        return self.update_block(np.array([step]), step_s[:, None], {c: v[:, None] for c, v in seconds.items()},
                                 lambda col: phases)

    def update_block(self, steps: np.ndarray, step_s: np.ndarray, seconds: dict[str, np.ndarray],
                     phases: Callable[[int], dict[str, np.ndarray]]) -> list[Straggler]:
        """Consecutive steps at once: (steps,) numbers, (ranks, steps) step seconds and each
        blamed category's (ranks, steps) seconds; `phases(col)` ({phase: (ranks,) seconds} of
        column col) is asked only when a rank is newly flagged there, to name its phase. Returns
        the ranks newly flagged, in step order. The scores of the whole block are computed at once."""
        # (steps,); nanmedian only where needed: it costs 3.5x a median over 12,288 ranks
        floors = self.cfg.straggler_floor * (np.nanmedian(step_s, axis=0) if np.isnan(step_s).any()
                                             else np.median(step_s, axis=0))
        relative = {cat: relative_scores(seconds[cat], floors) for cat in BLAMED}  # (ranks, steps)
        flagged: list[Straggler] = []
        for col, step in enumerate(map(int, steps)):
            self.last_step, self._floor = step, float(floors[col])
            column = {cat: (relative[cat][:, col], seconds[cat][:, col]) for cat in BLAMED}
            flagged += self._step(step, column, functools.cache(functools.partial(phases, col)))
        return flagged

    def _step(self, step: int, column: dict[str, tuple[np.ndarray, np.ndarray]],
              phases: Callable[[], dict[str, np.ndarray]]) -> list[Straggler]:
        """One step's (relative scores, seconds) per category into the windows; the newly flagged."""
        flagged_now: dict[int, Straggler] = {}
        for cat in BLAMED:
            window = self._relative[cat]
            window.push(column[cat][0])
            self._seconds[cat].append(column[cat][1])
            if not window.full():
                continue
            candidates = window.candidates()
            rolling = window.median(candidates)
            for r, score in zip(map(int, candidates), map(float, rolling), strict=True):
                if score < self.cfg.straggler_threshold and r not in self.flagged and r not in flagged_now:
                    flagged_now[r] = self._flag(r, step, cat, score, phases(), self._floor)
            # Recovered only halfway back to 1 (hysteresis), so that a rank that hovers at the
            # threshold is one event, not one per crossing; a new slowdown is a new event.
            recovered = 1 - (1 - self.cfg.straggler_threshold) / 2
            mine = np.array([r for r, s in self.flagged.items() if s.category == cat], dtype=np.int64)
            for r, score in zip(map(int, mine), map(float, window.median(mine)), strict=True):
                if score >= recovered:
                    del self.flagged[r]
        self.flagged.update(flagged_now)
        return list(flagged_now.values())

    def _flag(self, r: int, step: int, cat: str, score: float, phases: dict[str, np.ndarray],
              floor: float) -> Straggler:
        excess = {p: v[r] - median_of_others(v)[r] for p, v in phases.items() if category(p) == cat}
        info = self.ranks[r]
        return Straggler(rank=info.rank, host=info.host, dp=info.coords.dp, tp=info.coords.tp,
                         pp=info.coords.pp, since_step=step, step=step, category=cat,
                         phase=max(excess, key=excess.__getitem__) if excess else cat,
                         relative_score=round(score, 4), individual_score=self._individual(r, cat, floor))

    def _individual(self, r: int, cat: str, floor: float) -> float | None:
        scores = individual_scores(np.stack(self._seconds[cat]), self.cfg.straggler_window_steps, floor)
        return None if scores is None else round(float(scores[r]), 4)

    def current(self) -> list[Straggler]:
        """Who is flagged now, slowest first, with the scores and step of the latest step."""
        out = []
        for index, s in self.flagged.items():
            rolling = float(self._relative[s.category].median(np.array([index]))[0])
            out.append(dataclasses.replace(s, step=self.last_step, relative_score=round(rolling, 4),
                                           individual_score=self._individual(index, s.category, self._floor)))
        return sorted(out, key=lambda s: s.relative_score)


def detect(timings: Timings, cfg: DiagnoseConfig) -> tuple[StragglerDetector, list[Straggler]]:
    """Run the detector over a whole run; (its final state, every flag in order). Steps that not
    every rank has recorded yet are left out."""
    detector = StragglerDetector(cfg, timings.ranks)
    complete = ~np.isnan(timings.step_s).any(axis=0)
    flags: list[Straggler] = []
    for col in np.flatnonzero(complete):
        phases = {p: v[:, col] for p, v in timings.phases.items()}
        flags += detector.update(int(timings.steps[col]), timings.step_s[:, col], phases)
    return detector, flags


def eviction_candidates(run_dir: Path, cfg: DiagnoseConfig | None = None) -> list[Straggler]:
    """The ranks that are stragglers at the latest step every rank has recorded, slowest first,
    each with its host and (dp, tp, pp): what the supervisor evicts. Reads timings/ (and the
    run's config.yaml for the thresholds, unless `cfg` is given); no process group needed."""
    timings = read_timings(run_dir)
    if timings is None:
        return []
    if cfg is None:
        saved = run_dir / "config.yaml"
        cfg = load_config(saved).diagnose if saved.exists() else DiagnoseConfig()
    return detect(timings, cfg)[0].current()


class StragglerWatch:
    """Rank 0's live detector, on its timings thread: every `straggler_check_interval_steps` it
    reads what the watch files (watch_stream.py, one per node) gained since the last look, each
    record once, and feeds the steps every rank has written; each newly flagged rank becomes a
    `straggler` event. Only then are phases read, one JSON line per rank, to name its phase."""

    def __init__(self, run_dir: Path, world_size: int, cfg: DiagnoseConfig, start_step: int) -> None:
        self.run_dir, self.world_size, self.cfg = run_dir, world_size, cfg
        self._stream = StreamReader(run_dir, world_size, start_step, cfg.watch_ranks_per_file)
        self._pending = np.zeros(0, RECORD)  # records of steps not every rank has written yet
        self._pending_rows = np.zeros(0, np.int64)
        self._detector: StragglerDetector | None = None
        self._next_step = start_step + 1  # earlier steps were judged by the process that trained them
        self._warned: set[int] = set()  # flagged ranks already warned of on the console

    def after_write(self, step: int) -> None:
        interval = self.cfg.straggler_check_interval_steps
        if interval and step % interval == 0:
            self.poll(step + interval)  # the others may be a step or two ahead of rank 0

    def poll(self, up_to_step: int | None = None) -> list[Straggler]:
        """Read (to `up_to_step`), detect, append events; returns the ranks newly flagged."""
        records, rows = self._stream.read_new(up_to_step)
        if len(self._pending):  # (a copy of every record read, when it is not needed, cost 5%)
            records, rows = np.concatenate([self._pending, records]), np.concatenate([self._pending_rows, rows])
        self._pending, self._pending_rows = records, rows
        heads = self._stream.heads
        if not self._stream.all_started():
            return []
        if self._detector is None:
            self._detector = StragglerDetector(self.cfg, [rank_info(h) for h in heads if h is not None])
        # Every rank writes its steps in order: the steps all have written end at the least latest.
        frontier = int(self._stream.last_steps().min())
        flagged = self._feed(frontier) if frontier >= self._next_step else []
        for s in flagged:
            append_event(self.run_dir, "straggler", evict_candidate=True, **s.__dict__)
        self._warn()
        return flagged

    def _warn(self) -> None:
        """One warning per flagged rank once its rolling score is below the floor (a flag is
        raised as the score crosses the threshold, a real straggler's falls on); a flag that
        never gets there is an event only: the noise of ranks that share a host."""
        assert self._detector is not None
        now = {s.rank: s for s in self._detector.current()}
        self._warned &= set(now)  # recovered: a new slowdown is warned of again
        for s in now.values():
            if s.rank not in self._warned and s.relative_score < self.cfg.straggler_warn_below:
                self._warned.add(s.rank)
                log.warning("straggler: rank %d on %s (dp=%d, tp=%d, pp=%d) %s relative score %.2f since step %d",
                            s.rank, s.host, s.dp, s.tp, s.pp, s.category, s.relative_score, s.since_step)

    def poll_until(self, step: int, timeout_s: float) -> list[Straggler]:
        """At the end of a run: poll until every rank's stream reaches `step` (the other ranks
        flush theirs as they close, moments apart from rank 0) or `timeout_s` passes, so that the
        last look judges the run's last steps instead of whatever the flush interval let through."""
        deadline = time.monotonic() + timeout_s
        flagged = self.poll(step)
        while self._next_step <= step and time.monotonic() < deadline:  # not every rank's `step` yet
            time.sleep(FINAL_POLL_S)
            flagged += self.poll(step)
        if self._next_step <= step:
            behind = self._stream.behind(step)
            log.warning("straggler watch: %d rank(s) never recorded step %d, its last %d step(s) not judged: "
                        "ranks %s", len(behind), step, step + 1 - self._next_step, _some(behind))
        return flagged

    def _feed(self, frontier: int) -> list[Straggler]:
        """Give the detector the steps from the next one to `frontier`, which every rank has;
        records of later steps wait for the next check."""
        assert self._detector is not None
        records, rows = self._pending, self._pending_rows
        steps = records["step"]
        later = steps > frontier
        self._pending, self._pending_rows = (records[later], rows[later]) if later.any() else (records[:0], rows[:0])
        n_steps = frontier + 1 - self._next_step
        keep = (steps >= self._next_step) & ~later
        if not keep.all():
            records, rows, steps = records[keep], rows[keep], steps[keep]
        at = rows * n_steps + (steps - self._next_step)  # where each record goes in a (ranks, steps) grid
        grids = {}
        for field in ("step_s", "compute", "data_wait", "line_offset"):
            grids[field] = np.full((self.world_size, n_steps), np.nan)
            grids[field].ravel()[at] = records[field]
        complete = np.flatnonzero(~np.isnan(grids["step_s"]).any(axis=0))  # a step some rank lacks is not judged
        steps, offsets = self._next_step + complete, grids["line_offset"][:, complete]
        seconds = {"compute": grids["compute"][:, complete], "data wait": grids["data_wait"][:, complete]}
        flagged = self._detector.update_block(steps, grids["step_s"][:, complete], seconds,
                                              lambda col: self._phases(int(steps[col]), offsets[:, col]))
        self._next_step = frontier + 1
        return flagged

    def _phases(self, step: int, offsets: np.ndarray) -> dict[str, np.ndarray]:
        """{phase: (ranks,) seconds} of one step, from each rank's JSON line at its offset."""
        lines = [[_line_at(rank_file(self.run_dir, r), int(o))] for r, o in enumerate(offsets)]
        rows, _, column = line_table(lines)
        return {p: v[:, 0] for p, v in step_arrays(rows, column, step, step, self.world_size)[2].items()}

    def close(self) -> None:
        self._stream.close()


def _some(ranks: list[int], most: int = 16) -> str:
    """The first `most` of a list of ranks, and how many more."""
    shown = ", ".join(map(str, ranks[:most]))
    return shown + (f" and {len(ranks) - most} more" if len(ranks) > most else "")


def _line_at(path: Path, offset: int) -> bytes:
    """The line of `path` that starts at byte `offset` (b"" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.readline().rstrip(b"\n")
    except OSError:
        return b""


def line_table(lines: list[list[bytes]]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Each rank's record lines -> (rank of each parsed line, its index among all lines, its
    columns: "step", "step_s" and "phases/<name>"). All lines parse as one table when they share
    their keys (the usual case); otherwise line by line, torn ones left out."""
    rows = np.repeat(np.arange(len(lines)), [len(x) for x in lines])
    flat = [line for x in lines for line in x]
    table = step_table(b"\n".join(flat) + b"\n") if flat else None
    if table is not None:
        keys, values = table
        return rows, np.arange(len(flat)), {key: values[:, i] for i, key in enumerate(keys)}
    found = []
    for i, line in enumerate(flat):
        records = parse_records([line.decode(errors="replace")])[1]
        if records and isinstance(records[0].get("phases"), dict) and "step" in records[0]:
            found.append((i, records[0]))
    index = np.array([i for i, _ in found], dtype=np.int64)
    names = sorted({p for _, r in found for p in r["phases"]})
    column = {"step": np.array([r["step"] for _, r in found], dtype=float),
              "step_s": np.array([r["step_s"] for _, r in found], dtype=float)}
    column.update({PHASE_KEY + p: np.array([r["phases"].get(p, 0.0) for _, r in found], dtype=float)
                   for p in names})
    return rows[index], index, column


def step_arrays(rows: np.ndarray, column: dict[str, np.ndarray], first: int, last: int, n_ranks: int
                ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """line_table's columns -> (steps first..last, step_s and {phase: seconds} as (ranks, steps)
    arrays, NaN where a rank lacks a step); lines of other steps are left out."""
    steps = np.arange(first, last + 1)
    cols = column["step"].astype(np.int64) - first
    keep = (cols >= 0) & (cols < len(steps))
    rows, cols = rows[keep], cols[keep]
    step_s = np.full((n_ranks, len(steps)), np.nan)
    step_s[rows, cols] = column["step_s"][keep]
    phases = {}
    for key, values in column.items():
        if key.startswith(PHASE_KEY):
            phases[key[len(PHASE_KEY):]] = grid = np.where(np.isnan(step_s), np.nan, 0.0)
            grid[rows, cols] = values[keep]
    return steps, step_s, phases

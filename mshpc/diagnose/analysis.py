"""What `mshpc diagnose` computes from a run directory: per-rank breakdowns, straggler scores,
each rank's slowest dependency in the 3D mesh, and the MFU trend. Reads files only."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mshpc.config import DiagnoseConfig, ModelConfig, ParallelConfig, load_config
from mshpc.diagnose.mfu import achieved_tflops
from mshpc.diagnose.stragglers import Straggler, detect, individual_scores, relative_scores
from mshpc.diagnose.timers import CATEGORIES
from mshpc.diagnose.timings import TIMINGS_DIR, RankInfo, Timings, read_timings
from mshpc.errors import MshpcError
from mshpc.events import read_events
from mshpc.mesh_shape import Coords, MeshShape
from mshpc.run_dir import METRICS_FILE, read_metrics

WARMUP_STEPS = 1  # the first step allocates, builds buckets and fills caches: not the run's pace


class DiagnoseError(MshpcError):
    """The folder is not a run directory mshpc can diagnose."""


@dataclass(frozen=True)
class Dependency:
    rank: int  # the peer this rank waits on most: the slowest one it shares a group with
    group: str  # "tp", "dp" or "pp"


@dataclass(frozen=True)
class RankSummary:
    info: RankInfo
    step_s: float  # medians per step, after warm-up
    categories: dict[str, float]  # seconds per step in each of timers.CATEGORIES
    relative_score: float  # median over steps of the relative compute score
    individual_score: float | None
    dependency: Dependency | None


@dataclass(frozen=True)
class Analysis:
    run_dir: Path
    run_name: str  # run.name
    model: ModelConfig  # the run's sections, as its config.yaml says
    parallel: ParallelConfig
    diagnose: DiagnoseConfig
    peak_tflops: float | None  # train.peak_tflops
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    timings: Timings | None
    ranks: list[RankSummary]  # slowest (lowest relative score) first
    phase_share: dict[str, float]  # phase -> fraction of the median rank's step time
    stragglers: list[Straggler]  # flagged at the last step, below diagnose.straggler_warn_below
    flags: list[Straggler]  # every flag the detector raised over the run
    earlier_layout_ranks: int = 0  # ranks whose timings are of an earlier layout only (left out)

    @property
    def steady_columns(self) -> np.ndarray:
        assert self.timings is not None
        return _steady(self.timings)


def _steady(t: Timings) -> np.ndarray:
    """The steps every rank recorded, after warm-up (all steps where that leaves none)."""
    complete = ~np.isnan(t.step_s).any(axis=0)
    keep = complete & (t.steps >= t.steps.min() + WARMUP_STEPS)
    for candidate in (keep, complete):
        if candidate.any():
            return np.flatnonzero(candidate)
    return np.arange(len(t.steps))


def tflops_series(a: Analysis) -> tuple[list[int], list[float]]:
    """(steps, achieved TFLOP/s per device) from metrics.jsonl."""
    steps, values = [], []
    for r in a.metrics:
        value = r.get("tflops")
        if value is None and r.get("tokens_per_s"):
            value = achieved_tflops(r["tokens_per_s"], a.model, a.parallel.world_size)
        if value is not None:
            steps.append(r["step"])
            values.append(value)
    return steps, values


def mfu_trend(a: Analysis) -> tuple[float, float] | None:
    """(median TFLOP/s of the first window after warm-up, of the last window)."""
    _, values = tflops_series(a)
    values = values[WARMUP_STEPS:]
    if len(values) < 2:
        return None
    window = max(1, min(a.diagnose.mfu_window_steps, len(values) // 3))
    return statistics.median(values[:window]), statistics.median(values[-window:])


def slowest_dependencies(shape: MeshShape, ranks: list[RankInfo], compute_s: np.ndarray) -> list[Dependency | None]:
    """For each rank, the peer with the most compute per step among its tp and dp groups and
    its pipeline neighbours: the one a synchronous step waits for."""
    by_coords = {r.coords: i for i, r in enumerate(ranks)}
    out: list[Dependency | None] = []
    for info in ranks:
        c, peers = info.coords, []
        peers += [(Coords(c.pp, c.dp, t), "tp") for t in range(shape.tp) if t != c.tp]
        peers += [(Coords(c.pp, d, c.tp), "dp") for d in range(shape.dp) if d != c.dp]
        peers += [(Coords(p, c.dp, c.tp), "pp") for p in (c.pp - 1, c.pp + 1) if 0 <= p < shape.pp]
        known = [(by_coords[p], group) for p, group in peers if p in by_coords]
        if not known:
            out.append(None)
            continue
        index, group = max(known, key=lambda k: compute_s[k[0]])
        out.append(Dependency(ranks[index].rank, group))
    return out


def _rank_summaries(t: Timings, *, diagnose: DiagnoseConfig, parallel: ParallelConfig) -> list[RankSummary]:
    cols = _steady(t)
    cats = {c: np.nanmedian(t.category(c)[:, cols], axis=1) for c in CATEGORIES}
    step_s = np.nanmedian(t.step_s[:, cols], axis=1)
    floors = diagnose.straggler_floor * np.nanmedian(t.step_s[:, cols], axis=0)
    compute = t.category("compute")[:, cols]
    scores = np.nanmedian(relative_scores(compute, floors), axis=1)
    individual = individual_scores(compute.T, diagnose.straggler_window_steps, float(np.median(floors)))
    p = parallel
    deps = slowest_dependencies(MeshShape(pp=p.pp, dp=p.dp, tp=p.tp), t.ranks, cats["compute"])
    out = [RankSummary(info, float(step_s[i]), {c: float(cats[c][i]) for c in CATEGORIES}, float(scores[i]),
                       None if individual is None else float(individual[i]), deps[i])
           for i, info in enumerate(t.ranks)]
    return sorted(out, key=lambda r: r.relative_score)


def analyse(run_dir: Path) -> Analysis:
    """Everything the report shows, from the files of `run_dir`."""
    if not (run_dir / "config.yaml").is_file():
        raise DiagnoseError(f"{run_dir} is not a run directory (no config.yaml; give runs/<run.name>)")
    cfg = load_config(run_dir / "config.yaml")
    p = cfg.parallel
    # the last layout's ranks only: a run resumed at another layout left other ranks' files too
    timings = read_timings(run_dir, MeshShape(pp=p.pp, dp=p.dp, tp=p.tp))
    files = len(list((run_dir / TIMINGS_DIR).glob("rank-*.jsonl")))
    ranks: list[RankSummary] = []
    share: dict[str, float] = {}
    stragglers: list[Straggler] = []
    flags: list[Straggler] = []
    if timings is not None:
        detector, flags = detect(timings, cfg.diagnose)
        # a flag above the floor is noise (events.jsonl keeps it); below it, by its rolling score
        # in its own category, the rank is slower than its peers there: never a faster one
        stragglers = [s for s in detector.current() if s.relative_score < cfg.diagnose.straggler_warn_below]
        ranks = _rank_summaries(timings, diagnose=cfg.diagnose, parallel=cfg.parallel)
        cols = _steady(timings)
        step = float(np.nanmedian(timings.step_s[:, cols]))
        share = {p: float(np.nanmedian(v[:, cols])) / step for p, v in timings.phases.items()}
    return Analysis(run_dir, cfg.run.name, cfg.model, cfg.parallel, cfg.diagnose, cfg.train.peak_tflops,
                    read_metrics(run_dir / METRICS_FILE), read_events(run_dir), timings, ranks,
                    dict(sorted(share.items(), key=lambda kv: -kv[1])), stragglers, flags,
                    files - (len(timings.ranks) if timings is not None else 0))

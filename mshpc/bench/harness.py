"""The benchmark harness: every script in benchmarks/ takes its rounds, its interval, its JSON
record and its local ranks from here. A claim is measured side by side in one run: contenders take
turns within each round (`turns`, `time_rounds`), a ratio's 90% interval comes from resampling
whole rounds in pairs (`paired_round_interval`), and each result is one JSON line (`record`,
`emit`) with `ratio` = ours / the baseline named in `metric`."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mshpc.launch.ports import free_port

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks run from one (configs/, data)
WORKER_TIMEOUT_S = 600  # a rank of a benchmark that runs longer has hung


def add_rounds(parser: argparse.ArgumentParser, default: int, help: str = "rounds; the contenders take turns in each") -> None:
    """The one `--rounds` option every benchmark with rounds takes."""
    parser.add_argument("--rounds", type=int, default=default, help=f"{help} (default {default})")


def turns(names: Sequence[str], rounds: int) -> Iterator[list[str]]:
    """The contenders' order in each round: as given, reversed every other round, so a drift or a
    noisy neighbour on the machine falls on all of them alike."""
    for r in range(rounds):
        yield list(names) if r % 2 == 0 else list(names)[::-1]


def paired_round_interval(top: list[list[float]], bottom: list[list[float]],
                          draws: int = 2000) -> tuple[float, float]:
    """5th and 95th percentiles of median(top's pooled samples) / median(bottom's) over `draws`
    resamplings of the round pairs (top[i], bottom[i]); each round holds one or more samples.
    Rounds, not steps, are resampled: the contenders of a round ran side by side, so a slow moment
    of a shared machine falls on both, and steps within a run are not independent draws."""
    rng = random.Random(0)
    pairs = list(zip(top, bottom, strict=True))
    ratios = []
    for _ in range(draws):
        drawn = rng.choices(pairs, k=len(pairs))
        ratios.append(statistics.median(s for t, _ in drawn for s in t)
                      / statistics.median(s for _, b in drawn for s in b))
    ratios.sort()
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def ratio(value: float, baseline: float) -> float:
    """value / baseline to 4 significant digits: 1.093 and 0.002743 alike."""
    return float(f"{value / baseline:.4g}")


def paired(ours: Sequence[float], base: Sequence[float], digits: int = 4) -> dict[str, Any]:
    """Two contenders' per-round samples, taken side by side: medians, their ratio with its 90%
    interval over resampled rounds, and the per-round ratios' median and range."""
    per_round = [a / b for a, b in zip(ours, base, strict=True)]
    low, high = paired_round_interval([[a] for a in ours], [[b] for b in base])
    return {"value": round(statistics.median(ours), digits), "baseline": round(statistics.median(base), digits),
            "ratio": ratio(statistics.median(ours), statistics.median(base)),
            "ratio_90pct": [float(f"{low:.4g}"), float(f"{high:.4g}")],
            "ratio_per_round": {"median": float(f"{statistics.median(per_round):.4g}"),
                                "min": float(f"{min(per_round):.4g}"), "max": float(f"{max(per_round):.4g}")},
            "rounds": len(ours)}


def time_rounds(steps: Mapping[str, tuple[Callable[[], None], Callable[[], None]]], rounds: int,
                per_round: int) -> dict[str, list[float]]:
    """Per contender, one sample per round: the mean of `per_round` consecutive steps, after an
    untimed lead-in step (so the first timed forward waits for a previous step's all-gathers, as in
    training; `finish` lands the last step's after the clock stops). Contenders take `turns`;
    round 0 is warm-up. Collective over the default group: every rank calls it alike."""
    from mshpc.parallel import comm

    names = list(steps)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r, order in enumerate(turns(names, rounds + 1)):
        for name in order:
            step, finish = steps[name]
            comm.barrier()  # not between lead-in and clock: it would wait for the all-gathers
            step()
            start = time.perf_counter()
            for _ in range(per_round):
                step()
            elapsed = time.perf_counter() - start
            finish()
            if r > 0:
                samples[name].append(elapsed / per_round)
    return samples


def load_average() -> float:
    """The 1-minute load average, one decimal: every measurement records it (the machine is shared)."""
    return round(os.getloadavg()[0], 1)


def record(bench: str, metric: str, value: float, unit: str, baseline: float | None = None, *,
           digits: int = 4, **context: Any) -> dict[str, Any]:
    """One result: `value` (ours) in `unit`; with a `baseline` measured in the same run, also the
    baseline and `ratio` = value / baseline (4 significant digits). Name the baseline in `metric`
    (`step_time_overlap_vs_torch_ddp`); `context` holds the shape, link, load, interval..."""
    line: dict[str, Any] = {"bench": bench, "metric": metric, "value": round(value, digits), "unit": unit}
    if baseline is not None:
        line["baseline"] = round(baseline, digits)
        line["ratio"] = ratio(value, baseline)
    return {**line, **context}


def emit(line: Mapping[str, Any]) -> None:
    """Print one result as a JSON line, at once (a long benchmark's lines are read as they come)."""
    print(json.dumps(line), flush=True)


def run_local_ranks(target: Callable[..., None], world: int, args: tuple[Any, ...],
                    timeout_s: float = WORKER_TIMEOUT_S) -> Any:
    """Start `world` processes of `target(rank, port, *args, out)` on this machine (spawned, so each
    imports torch afresh, as a rank does) and return the JSON value that one of them `out.put`s as
    text, rank 0 by convention. A rank that dies first (killed for memory, say) ends the benchmark
    with its exit code instead of a hang; so does no result within `timeout_s`."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, out)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                result = json.loads(out.get(timeout=5))
                break
            except queue.Empty:
                dead = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"rank {dead[0][0]} ended with exit code {dead[0][1]}") from None
                if time.monotonic() > deadline:
                    raise SystemExit(f"no result from the ranks within {timeout_s:g} s") from None
        for p in procs:
            p.join(timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return result

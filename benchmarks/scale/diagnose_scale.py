"""Straggler detection and `mshpc diagnose` at N = 8 ... 12,288 ranks (issue #20, part 3).

Per N (nodes of 8, the 175B layout of synthetic_run.py, one rank 30% slower from step 100):
- rank 0's cost per straggler check: the real `StragglerWatch` check after every rank's
  timings file and watch record grew by `interval` steps (the default check interval), median
  of `checks` checks, with the watch files of a node of 8 ranks (the default), beside the same
  check over a file per rank (the baseline); as a share of a 5 s step, per check and per step
  (the check runs every `interval` steps, on rank 0's timings thread, not the train loop's);
- `mshpc diagnose RUN_DIR` on N ranks x `steps` steps, in a child process: wall time and peak
  resident memory (the child's ru_maxrss).
Then the growth exponent of each against N (log-log slope). JSON lines on stdout.

    .venv/bin/python benchmarks/scale/diagnose_scale.py [--n 8 64 512 4096 12288] [--steps 1000]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from synthetic_run import (  # a sibling module: benchmarks/scale/ is first on the path
    NODE_SIZE,
    rank_lines,
    shape_for,
    write_run,
)

from mshpc.bench import harness
from mshpc.bench.harness import REPO
from mshpc.config import DiagnoseConfig
from mshpc.diagnose.stragglers import StragglerWatch
from mshpc.diagnose.timers import category
from mshpc.diagnose.timings import RankInfo, header, rank_file
from mshpc.diagnose.watch_stream import StreamWriter

STEP_S = 5.0  # the paper's step at 12,288 GPUs is of this order; the target is 1% of it


def emit(**fields: object) -> None:
    harness.emit({"bench": "scale_diagnose", **fields})


def slope(ns: list[int], values: list[float]) -> float:
    """The growth exponent: the least-squares slope of log(value) against log(N)."""
    return round(float(np.polyfit(np.log(ns), np.log(values), 1)[0]), 3)


def check_cost(work: Path, n: int, interval: int, checks: int, ranks_per_file: int) -> float:
    """Median CPU seconds of one StragglerWatch check (`after_write` at a multiple of the
    interval) once every rank wrote `interval` more steps (CPU, not wall: on this shared machine
    the wall time measures the other tenants)."""
    shutil.rmtree(work, ignore_errors=True)
    shape = shape_for(n)
    rng = np.random.default_rng(1)
    steps = interval * (checks + 1)
    common = rng.lognormal(0, 0.03, steps)
    lines, records, writers = [], [], []
    for rank in range(n):
        info = RankInfo(rank, f"node{rank // NODE_SIZE:04d}", shape.coords(rank))
        path = rank_file(work, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(header(info, "cuda", 0)) + "\n")
        writers.append(StreamWriter(work, rank, header(info, "cuda", 0), 0, ranks_per_file))
        writers[-1].close()  # its header is written; its records below, without 12,288 descriptors held
        lines.append(rank_lines(rank, steps, common, rng, rank == n // 2, 1, 1.3, 0.03))
        records.append(watch_records(lines[-1], path.stat().st_size))
    cfg = DiagnoseConfig(straggler_check_interval_steps=interval, watch_ranks_per_file=ranks_per_file)
    watch = StragglerWatch(work, n, cfg, start_step=0)
    costs = []
    for c in range(checks + 1):
        for rank in range(n):
            with rank_file(work, rank).open("a") as f:
                f.writelines(lines[rank][c * interval:(c + 1) * interval])
            for record in records[rank][c * interval:(c + 1) * interval]:
                writers[rank].add(*record)
            fd = os.open(writers[rank].path, os.O_WRONLY)
            for offset, data in writers[rank].take_encoded():  # what its flush writes
                os.pwrite(fd, data, offset)
            os.close(fd)
        start = time.process_time()
        watch.after_write((c + 1) * interval)
        if c:  # the first check also reads the headers and builds the detector
            costs.append(time.process_time() - start)
    watch.close()
    shutil.rmtree(work, ignore_errors=True)
    return statistics.median(costs)


def watch_records(lines: list[str], offset: int) -> list[tuple[int, float, float, float, int]]:
    """The watch records of one rank's step lines (what its timings thread adds)."""
    out = []
    for line in lines:
        r = json.loads(line)
        compute, data_wait = (sum(v for p, v in r["phases"].items() if category(p) == c) for c in ("compute", "data wait"))
        out.append((r["step"], r["step_s"], compute, data_wait, offset))
        offset += len(line)
    return out


def diagnose_cost(run_dir: Path) -> tuple[float, float, float]:
    """(wall s, peak RSS GiB, CPU s) of `mshpc diagnose run_dir` in a child process (CPU time
    says what the wall time would be on an idle core; this machine is shared)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "mshpc", "diagnose", str(run_dir)], env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"mshpc diagnose failed: {out.stderr.strip()}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, after.ru_maxrss / 2**20, cpu  # ru_maxrss: the largest child so far, this one last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8, 64, 512, 4096, 12288])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--interval", type=int, default=DiagnoseConfig().straggler_check_interval_steps)
    ap.add_argument("--checks", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mshpc-scale-diagnose"))
    ap.add_argument("--check-only", action="store_true", help="only the straggler check, not diagnose")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the check over a file per rank")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (report/ to look at)")
    args = ap.parse_args()
    per_check, walls, peaks = [], [], []
    for n in sorted(args.n):
        cost = check_cost(args.work / f"watch-{n}", n, args.interval, args.checks, NODE_SIZE)
        # the same check over a file per rank (what a check read before the per-node files)
        base = check_cost(args.work / f"watch-{n}", n, args.interval, args.checks, 1) if args.baseline else None
        per_check.append(cost)
        emit(metric="straggler_check_s_vs_file_per_rank", value=round(cost, 4), unit="s", N=n,
             interval_steps=args.interval, files=-(-n // NODE_SIZE),
             baseline=round(base, 4) if base else None, ratio=round(cost / base, 3) if base else None,
             share_of_5s_step_per_check=round(cost / STEP_S, 5),
             share_of_5s_step_per_step=round(cost / args.interval / STEP_S, 5))
        if args.check_only:
            continue
        run_dir = args.work / f"run-{n}"
        gen = time.perf_counter()
        write_run(run_dir, n, args.steps, slow_rank=n // 2 + 3)
        wall, peak, cpu = diagnose_cost(run_dir)
        walls.append(wall)
        peaks.append(peak)
        emit(metric="diagnose_wall_s", value=round(wall, 2), unit="s", N=n, steps=args.steps,
             peak_rss_gib=round(peak, 3), cpu_s=round(cpu, 1), files_written_s=round(time.perf_counter() - gen - wall, 1))
        if not args.keep or n != max(args.n):
            shutil.rmtree(run_dir, ignore_errors=True)
    if len(args.n) > 1:
        ns = sorted(args.n)
        emit(metric="growth_exponent", check=slope(ns, per_check),
             diagnose_wall=slope(ns, walls) if walls else None,
             unit="log-log slope", N=ns, n_log_n_at_top=round(1 + 1 / math.log(ns[-1]), 3))


if __name__ == "__main__":
    main()

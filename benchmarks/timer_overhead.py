"""Claim: the always-on phase timers and the timings thread cost under 1% of step time.

Two gloo ranks train the tiny model through the real train step; blocks of steps with the
timers on (phases, comm timing, the writer thread, rank 0's watches) alternate with blocks with
them off, in lock-step on both ranks and in alternating order, so that machine noise falls on
both alike. Prints the ratio of median step times (target <= 1.01), and, as a noise-free
cross-check, the measured cost of one phase span times the spans a step records.

    .venv/bin/python benchmarks/timer_overhead.py [--config configs/tiny.yaml] [--rounds 12] [--steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mshpc.bench import harness
from mshpc.bench.harness import REPO

WORLD = 2


def step_time(step: int, timed: bool, diag, loader, step_fn, cfg) -> float:
    """One step as the train loop runs it, with or without the diagnosis."""
    from mshpc.diagnose.timers import TIMERS, phase

    TIMERS.enabled = timed
    start = time.perf_counter()
    if timed:
        diag.begin_step(step)
    with phase("data"):
        batch = next(loader)
    loss, _ = step_fn(batch)
    loss.item()
    if timed:
        diag.end_step(step, cfg.global_batch * cfg.model.seq_len / (time.perf_counter() - start))
    return time.perf_counter() - start


def span_cost_s() -> float:
    """Seconds one phase span costs on this machine (enter + exit, CPU clock)."""
    from mshpc.diagnose.timers import PhaseTimers

    timers, n = PhaseTimers(), 20_000
    timers.configure(True, torch.device("cpu"))
    timers.begin_step(0)
    start = time.perf_counter()
    for _ in range(n):
        with timers.phase("forward"):
            pass
    return (time.perf_counter() - start) / n


def worker(rank: int, store: str, run_dir: str, args: argparse.Namespace, conn) -> None:
    from mshpc.config import load_config, resolve_world
    from mshpc.diagnose.collector import build_collector
    from mshpc.diagnose.timings import rank_file
    from mshpc.launch.rendezvous import DistInfo
    from mshpc.launch.runtime import Runtime
    from mshpc.mesh_shape import MeshShape
    from mshpc.parallel.mesh import build_mesh
    from mshpc.train import build_data, build_model_step

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # on a busy machine the watches see stragglers: not this claim's
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    cfg = resolve_world(load_config(args.config, [f"run.out_dir={run_dir}", "run.name=bench"]), WORLD)
    # rank 0's straggler watch reads both files once per block: as often as a real run would, or more
    diagnose = dataclasses.replace(cfg.diagnose, straggler_check_interval_steps=args.steps)
    cfg = dataclasses.replace(cfg, diagnose=diagnose)
    info = DistInfo(rank, WORLD, rank, WORLD, "localhost", "gloo", "env")
    rt = Runtime(device=torch.device("cpu"), autocast_dtype=None, peak_tflops=None)
    p = cfg.parallel
    mesh = build_mesh(MeshShape(pp=p.pp, dp=p.dp, tp=p.tp))
    _, step_fn = build_model_step(cfg, mesh, rt)  # the train loop's own step
    loader = build_data(cfg, info, mesh, rt, 0)
    diag = build_collector(Path(run_dir) / "bench", rank, "localhost", rt.device, 0, None, diagnose=cfg.diagnose,
                           model_cfg=cfg.model, parallel=cfg.parallel)
    times = {True: [], False: []}
    step = 0
    for _ in range(2):  # warm-up, both ways
        for timed in (True, False):
            step += 1
            step_time(step, timed, diag, loader, step_fn, cfg)
    for order in harness.turns((False, True), args.rounds):
        for timed in order:
            for _ in range(args.steps):
                step += 1
                times[timed].append(step_time(step, timed, diag, loader, step_fn, cfg))
    diag.close()
    loader.close()
    last = json.loads(rank_file(Path(run_dir) / "bench", rank).read_text().splitlines()[-1])
    dist.destroy_process_group()
    conn.send(json.dumps({"on": times[True], "off": times[False], "spans": last["spans"]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs/tiny.yaml"))
    harness.add_rounds(p, 12, "rounds; a block of steps with the timers and one without in each, in turns")
    p.add_argument("--steps", type=int, default=5, help="steps per block")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="timer-overhead-") as tmp:
        pipes = [ctx.Pipe(duplex=False) for _ in range(WORLD)]
        procs = [ctx.Process(target=worker, args=(r, f"{tmp}/store", tmp, args, pipes[r][1])) for r in range(WORLD)]
        for proc in procs:
            proc.start()
        results = [json.loads(recv.recv()) for recv, _ in pipes]
        for proc in procs:
            proc.join()
    on, off = statistics.median(results[0]["on"]), statistics.median(results[0]["off"])
    blocks = [[t[i:i + args.steps] for i in range(0, len(t), args.steps)] for t in (results[0]["on"], results[0]["off"])]
    low, high = harness.paired_round_interval(*blocks)  # a round's two blocks ran side by side
    harness.emit(harness.record("timer_overhead", "step_time_timers_on_vs_off", on, "s", off, digits=5,
                                ratio_90pct=[round(low, 4), round(high, 4)], steps_each=len(results[0]["on"]),
                                load_avg=harness.load_average()))
    cost = span_cost_s() * results[0]["spans"]
    harness.emit(harness.record("timer_overhead", "span_cost_x_spans_per_step_vs_step_time", cost, "s", off, digits=7,
                                spans_per_step=results[0]["spans"]) | {"ratio": round(1 + cost / off, 5)})

if __name__ == "__main__":
    main()

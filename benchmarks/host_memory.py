"""Claim: keeping freed host memory in the heap (mshpc/cpu_ranks/heap.py, applied at a CPU rank's start-up on
CPU) removes a CPU rank's per-step page faults and makes its step faster.

Compiled mshpc at the tiny shape on 2 CPU ranks, as a training run has it: one model per
process (compile_vs_ddp.py puts five in one process, where the others' allocations already keep
the heap large, so it cannot show this). Each round launches one pair of ranks with the setting
and one without (`GLIBC_TUNABLES` set, which the product takes as the user's own tuning and
leaves alone), in alternating order, so that a noisy neighbour slows both alike; each pair
warms up, then times its steps. Prints one JSON line: median seconds per step and minor page
faults per step of each, and the ratio with a 90% interval from resampling the rounds. About
3 minutes:

    .venv/bin/python benchmarks/host_memory.py [--rounds 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import time
from datetime import timedelta

from compile_vs_ddp import build_steps  # a sibling benchmark: Python puts benchmarks/ first on the path

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S, paired_round_interval

WARM_UP_STEPS = 10  # compiles, then lets the heap reach its steady size


def worker(rank: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.config import load_config
    from mshpc.cpu_ranks.heap import freed_host_memory_kept

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    cfg = load_config(REPO / "configs/tiny.yaml", ["parallel.dp=2"])
    step, finish = build_steps(cfg, rank, args.micro_batch, ("mshpc_compiled",))["mshpc_compiled"]
    for _ in range(WARM_UP_STEPS):
        step()
    seconds, faults = [], []
    for _ in range(args.steps):
        start, faulted = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        seconds.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    finish()
    if rank == 0:
        out.put(json.dumps({"seconds": seconds, "faults": faults, "kept": freed_host_memory_kept()}))
    dist.destroy_process_group()


def run_pair(keep: bool, args: argparse.Namespace) -> dict:
    env = {} if keep else {"GLIBC_TUNABLES": "glibc.malloc.check=0"}  # a no-op tunable: the user's
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # spawned children inherit it
    try:
        result = harness.run_local_ranks(worker, 2, (args,))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    assert result["kept"] == keep, "the setting did not follow the environment"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_rounds(parser, 4, "pairs of runs, with and without the setting, in alternating order")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per pair, after the warm-up")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step (tiny.yaml's)")
    args = parser.parse_args()
    load_start = harness.load_average()
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for order in harness.turns((True, False), args.rounds):
        for keep in order:
            runs[keep].append(run_pair(keep, args))
    step_s = {keep: statistics.median(s for run in rs for s in run["seconds"]) for keep, rs in runs.items()}
    faults = {keep: statistics.mean(f for run in rs for f in run["faults"]) for keep, rs in runs.items()}
    # ratio of step times, glibc's own / kept: above 1 means the setting made the step faster
    interval = paired_round_interval([run["seconds"] for run in runs[False]], [run["seconds"] for run in runs[True]])
    harness.emit({
        "bench": "host_memory", "metric": "step_s_glibc_default_vs_kept", "shape": "tiny", "dp": 2,
        "micro_batch_per_rank": args.micro_batch, "contender": "mshpc_compiled", "device": "cpu",
        "value": round(step_s[True], 4), "unit": "s/step", "baseline": round(step_s[False], 4),
        "ratio": round(step_s[False] / step_s[True], 3), "ratio_90pct": [round(v, 3) for v in interval],
        "minor_faults_per_step": round(faults[True], 1), "baseline_minor_faults_per_step": round(faults[False], 1),
        "rounds": args.rounds, "steps_per_round": args.steps,
        "load_avg": [load_start, harness.load_average()]})


if __name__ == "__main__":
    main()

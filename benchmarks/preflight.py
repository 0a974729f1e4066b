"""Claims: each preflight level keeps to its time budget here (quick < 60 s a node); and its
all-reduce bus bandwidth, measured through mshpc's collective wrapper (comm.py) with its
element check, matches a plain torch.distributed.all_reduce loop timed the way nccl-tests
times it: the same sizes, warm-up and iterations, time averaged over ranks, busbw = algbw x
2(n-1)/n. Both contenders take turns within each round; the median round counts.

    .venv/bin/python benchmarks/preflight.py [--ranks 2] [--levels quick,standard,extended]
        [--warmup 5] [--iters 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import REPO
from mshpc.bench.netns import run_ranks
from mshpc.launch.ports import free_port
from mshpc.preflight.tiers import TIERS

SIZES = tuple(64 * 1024 << (2 * i) for i in range(5))  # 64 KiB .. 16 MiB, x4
WORKER_TIMEOUT_S = 900


def tier_wall_time(level: str, ranks: int) -> dict:
    """One `mshpc preflight --level LEVEL` on `ranks` local ranks, as a user runs it."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "mshpc", "preflight", "--level", level, "--nproc", str(ranks)],
                         capture_output=True, text=True, cwd=REPO, timeout=WORKER_TIMEOUT_S)
    wall_s = time.perf_counter() - start
    if out.returncode not in (0, 3):
        raise SystemExit(f"preflight --level {level} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    budget = TIERS[level].budget_s
    return harness.record("preflight", f"wall_time_{level}_vs_budget", wall_s, "s", budget, digits=2, ranks=ranks,
                          verdict="fail" if out.returncode else "pass")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.preflight.busbw import busbw_gbps
    from mshpc.preflight.collectives import Group, build_op, measure

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.worker,
                            world_size=args.ranks, timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    n, world = args.ranks, Group("world", "world", tuple(range(args.ranks)), None)

    def mean_over_ranks(seconds: float) -> float:  # nccl-tests' default -a 1
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / n

    def plain(size: int) -> float:
        buf = torch.zeros(size // 4)
        for _ in range(args.warmup):
            dist.all_reduce(buf)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(buf)
        return (time.perf_counter() - start) / args.iters

    results = []
    for size in SIZES:
        ours, theirs = [], []
        for _ in range(args.rounds):
            op, actual = build_op("all_reduce", size, world, args.worker, torch.device("cpu"))
            seconds, wrong = measure(op, world, lambda: None, args.warmup, args.iters)
            assert wrong == 0, f"all_reduce of {size} bytes came back wrong on rank {args.worker}"
            ours.append(busbw_gbps("all_reduce", actual, mean_over_ranks(seconds), n))
            theirs.append(busbw_gbps("all_reduce", size, mean_over_ranks(plain(size)), n))
        results.append({"size_bytes": size, "ours": statistics.median(ours), "torch": statistics.median(theirs)})
    if args.worker == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


def busbw_lines(args: argparse.Namespace) -> list[dict]:
    port = free_port()
    cmd = [sys.executable, __file__, "--port", str(port), "--ranks", str(args.ranks), "--warmup", str(args.warmup),
           "--iters", str(args.iters), "--rounds", str(args.rounds)]
    done = run_ranks([([*cmd, "--worker", str(r)], {"GLOO_SOCKET_IFNAME": "lo"}) for r in range(args.ranks)],
                     WORKER_TIMEOUT_S)
    return [harness.record("preflight", "all_reduce_busbw_vs_torch_all_reduce_loop", r["ours"], "GB/s", r["torch"],
                           size_bytes=r["size_bytes"], ranks=args.ranks, warmup=args.warmup, iters=args.iters,
                           backend="gloo") for r in json.loads(done[0].stdout.strip().splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (the CPU has 2 cores in CI)")
    parser.add_argument("--levels", default="quick,standard,extended", help="levels to time, comma-separated")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per size (nccl-tests -w)")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per size (nccl-tests -n)")
    harness.add_rounds(parser, 3, "turns of the two contenders; the median counts")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args)
    for line in busbw_lines(args):
        harness.emit(line)
    for level in filter(None, args.levels.split(",")):
        harness.emit(tier_wall_time(level, args.ranks))


if __name__ == "__main__":
    main()

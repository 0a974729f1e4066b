"""Preflight's pairwise link schedule at N = 8 ... 12,288 ranks (1 ... 1,536 nodes of 8), issue #20.

Per N: the real `links.schedule` (rounds, pairs, the time to compute it), the real `my_peer`
lookup every rank does each round (its time per rank, all rounds), and the quick level's link
stage wall time = rounds x the time of one pair exchange, measured here: two gloo ranks on this
machine run the real `exchange_gbps` at the quick level's CPU size (warm-up, timed exchanges,
the check exchange), and the GPU figure uses the quick level's 64 MiB at a 200 Gb/s rail
(MegaScale's NICs) for comparison. Rounds run one after another, pairs in a round at once.

    .venv/bin/python benchmarks/scale/preflight_scale.py [--n 8 64 512 4096 12288]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from mshpc.bench import harness
from mshpc.config import PreflightConfig
from mshpc.preflight.links import exchange_gbps, my_peer, schedule
from mshpc.preflight.tiers import TIERS

NODE_SIZE = 8
RAIL_GBPS = 200 / 8  # GB/s: one 200 Gb/s NIC per GPU (MegaScale sec. 6)


def _pair_rank(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    q = TIERS["quick"]
    numel = q.pair_bytes["cpu"] // 4
    times = []
    for _ in range(3):
        start = time.perf_counter()
        exchange_gbps(rank, 1 - rank, numel, torch.device("cpu"), lambda: None, q.warmup["cpu"], q.iters["cpu"])
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(json.dumps(sorted(times)[1]))
    dist.destroy_process_group()


def pair_exchange_s() -> float:
    """Median wall time of one quick-level pair exchange between two gloo ranks here."""
    return float(harness.run_local_ranks(_pair_rank, 2, ()))


def emit(**fields: object) -> None:
    harness.emit({"bench": "scale_preflight", **fields})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8, 64, 512, 4096, 12288])
    args = ap.parse_args()
    cfg = PreflightConfig()
    pair_s = pair_exchange_s()
    q = TIERS["quick"]
    gpu_pair_s = (q.warmup["cuda"] + q.iters["cuda"] + 1) * q.pair_bytes["cuda"] / (RAIL_GBPS * 1e9)
    emit(metric="pair_exchange_s", value=round(pair_s, 4), unit="s", where="2 gloo ranks here, quick level, CPU",
         gpu_model_s=round(gpu_pair_s, 4))
    ns, peer_costs = sorted(args.n), []
    for n in ns:
        nodes = max(1, n // NODE_SIZE)
        start = time.perf_counter()
        rounds = schedule(nodes, cfg.pairwise_max_nodes, cfg.bisections)
        schedule_s = time.perf_counter() - start
        by_node = [tuple(range(i * NODE_SIZE, (i + 1) * NODE_SIZE)) for i in range(nodes)]
        start = time.perf_counter()
        for r in rounds:  # the last rank: the longest lookup
            my_peer(r, by_node, n - 1)
        peer_s = time.perf_counter() - start
        peer_costs.append(peer_s)
        emit(N=n, nodes=nodes, rounds=len(rounds), pairs=sum(map(len, rounds)), schedule_s=round(schedule_s, 5),
             my_peer_s_per_rank=round(peer_s, 5), quick_link_stage_s=round(len(rounds) * pair_s, 2),
             quick_link_stage_gpu_model_s=round(len(rounds) * gpu_pair_s, 2), unit="s")
    if len(ns) > 2:
        big = [i for i, n in enumerate(ns) if n // NODE_SIZE > cfg.pairwise_max_nodes]
        if len(big) > 1:
            x = np.log([ns[i] for i in big])
            emit(metric="growth_exponent", unit="log-log slope", N=[ns[i] for i in big],
                 my_peer=round(float(np.polyfit(x, np.log([peer_costs[i] for i in big]), 1)[0]), 3),
                 rounds=0.0, note="past pairwise_max_nodes the rounds are a constant (bisections)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""Claim: mshpc's start-up (rendezvous + every 3D process group) stays flat as ranks grow, where
the plain approach, every rank calling `new_group` for every group of the job, grows with the
number of groups, and with torch's old barrier after each group (TORCH_DIST_INIT_BARRIER=1, the
default before torch 2.3, what MegaScale sec. 3.5 removed) grows as groups x ranks.

At each rank count (local gloo ranks, mesh tp x pp = 2 x 2, dp the rest) three contenders take
turns within each round: mshpc (launch.rendezvous.init_distributed + parallel.mesh.build_mesh),
plain (init_process_group with the default TCPStore, then a new_group per group of the job from
every rank), and plain with the init barrier. Time runs from a common start, after every rank
has imported torch (the import, ~1 s of CPU a rank, dominates start-up on few cores and is the
same for all), to the last rank done with one all-reduce in each of its groups and in the world:
mshpc's gloo groups connect lazily (a pair on its first message), the plain ones eagerly (every
pair at creation), so a time stopped at creation would leave mshpc's connections out.

    .venv/bin/python benchmarks/init_groups.py [--ranks 8 16 32] [--rounds 3] [--tp 2] [--pp 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from mshpc.bench import harness
from mshpc.launch.ports import free_port  # no torch import at module level

CONTENDERS = ("mshpc", "plain", "plain_with_barriers")
TIMEOUT_S = 600


def _first_collectives(groups: list) -> None:  # type: ignore[type-arg]
    """One all-reduce in each of this rank's groups and in the world: a lazily connected gloo
    group pays its connections here, an eager one at its creation, so both are timed to here."""
    import torch
    import torch.distributed as dist

    x = torch.ones(1)
    for group in [*groups, None]:
        dist.all_reduce(x, group=group)


def _mshpc(rank: int, world: int, port: int, shape) -> float:
    from mshpc.launch.env import LaunchEnv
    from mshpc.launch.rendezvous import init_distributed
    from mshpc.parallel.mesh import build_mesh

    env = LaunchEnv(launcher="env", rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                    node="localhost", master_addr="127.0.0.1", master_port=port, slurm=None, test_faults=None)
    os.environ.pop("TORCH_GLOO_LAZY_INIT", None)  # a plain round in this process set torch's default,
    init_distributed(env, timeout_s=TIMEOUT_S)  # which connect_lazily would keep: gloo is lazy from here
    done_init = time.time()
    mesh = build_mesh(shape)
    _first_collectives(mesh.distinct_groups())
    return done_init


def _plain(rank: int, world: int, port: int, shape) -> float:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["TORCH_GLOO_LAZY_INIT"] = "0"  # torch's default; mshpc's rounds set it in this process
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    done_init = time.time()
    mine = []
    for name, groups in shape.all_groups().items():
        if shape.ep == 1 and name in ("ep", "edp"):
            continue  # a dense job makes no expert groups, as build_mesh does
        for ranks in groups:
            group = dist.new_group(list(ranks))  # every rank, every group, in the same order
            if rank in ranks:
                mine.append(group)
    _first_collectives(mine)
    return done_init


def worker(rank: int, world: int, shape, schedule: list[tuple[str, int]], barrier, conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    for contender, port in schedule:
        os.environ["TORCH_DIST_INIT_BARRIER"] = "1" if contender == "plain_with_barriers" else "0"
        barrier.wait()  # a common start, every rank with torch imported
        start = time.time()
        done_init = (_mshpc if contender == "mshpc" else _plain)(rank, world, port, shape)
        conn.send((start, done_init, time.time()))
        dist.barrier()  # nobody tears down a store another rank still reads
        dist.destroy_process_group()
    conn.close()



def measure(world: int, tp: int, pp: int, rounds: int) -> dict[str, dict]:
    """Each contender's median over rounds of init_s, groups_s (the slowest rank's group
    creation and first collectives) and total_s, its worst init_s, and its total_s per round
    (the contenders of a round ran one right after the other), at `world` ranks."""
    from mshpc.mesh_shape import MeshShape

    shape = MeshShape(pp=pp, dp=world // (tp * pp), tp=tp)
    schedule = [(c, free_port()) for _ in range(rounds) for c in CONTENDERS]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world)
    pipes, procs = [], []
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker, args=(rank, world, shape, schedule, barrier, send), daemon=True)
        proc.start()
        pipes.append(recv)
        procs.append(proc)
    samples: dict[str, list[tuple[float, float, float]]] = {c: [] for c in CONTENDERS}
    try:
        for contender, _ in schedule:
            times = [p.recv() for p in pipes]
            start = min(t[0] for t in times)
            samples[contender].append((max(t[1] for t in times) - start, max(t[2] for t in times) - start,
                                       max(t[2] - t[1] for t in times)))
    finally:
        for proc in procs:
            proc.join(TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    groups = sum(len(g) for g in shape.all_groups().values())
    return {c: {"init_s": statistics.median(s[0] for s in samples[c]), "worst_init_s": max(s[0] for s in samples[c]),
                "total_s": statistics.median(s[1] for s in samples[c]),
                "groups_s": statistics.median(s[2] for s in samples[c]), "groups": groups,
                "total_s_by_round": [s[1] for s in samples[c]]} for c in CONTENDERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    harness.add_rounds(parser, 3, "rounds; the contenders take turns in each")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()
    totals: dict[str, dict[int, float]] = {c: {} for c in CONTENDERS}
    groups_s: dict[str, dict[int, float]] = {c: {} for c in CONTENDERS}
    for world in args.ranks:
        r = measure(world, args.tp, args.pp, args.rounds)
        rounds = args.rounds
        context = {"ranks": world, "tp": args.tp, "pp": args.pp, "dp": world // (args.tp * args.pp),
                   "groups_in_job": r["plain"]["groups"], "new_group_calls_per_rank": {"mshpc": 5, "plain": r["plain"]["groups"]},
                   "init_s": {c: round(r[c]["init_s"], 3) for c in CONTENDERS},
                   "worst_init_s": {c: round(r[c]["worst_init_s"], 3) for c in CONTENDERS},
                   "groups_s": {c: round(r[c]["groups_s"], 3) for c in CONTENDERS}, "rounds": rounds}
        for baseline in ("plain", "plain_with_barriers"):
            low, high = harness.paired_round_interval([[t] for t in r["mshpc"]["total_s_by_round"]],
                                                      [[t] for t in r[baseline]["total_s_by_round"]])
            harness.emit(harness.record("init_groups", f"init_and_3d_groups_vs_{baseline}_{world}_ranks",
                                        r["mshpc"]["total_s"], "s", r[baseline]["total_s"], digits=3,
                                        ratio_90pct=[round(low, 3), round(high, 3)], **context,
                                        load_avg=harness.load_average()))
        for c in CONTENDERS:
            totals[c][world] = r[c]["total_s"]
            groups_s[c][world] = r[c]["groups_s"]
    lo, hi = min(args.ranks), max(args.ranks)
    for what, table in (("total", totals), ("groups", groups_s)):
        harness.emit({"bench": "init_groups", "metric": f"{what}_growth_{lo}_to_{hi}_ranks", "unit": "x",
                      **{c: round(table[c][hi] / table[c][lo], 2) for c in CONTENDERS}})


if __name__ == "__main__":
    main()

"""Claim: the ~5 s that `init_process_group` took at 32 local ranks is the resolver's timeout, not
CPU or store traffic. torch's TCPStore formats every socket's peer address with `getnameinfo`
(no NI_NUMERICHOST: a reverse DNS query) when a client connects and when rank 0's store accepts,
on the store's one event-loop thread; a query whose reply is lost waits the resolver's timeout
(resolv.conf's default 5 s, then again), so a connect takes 0.01 s, 5 s or 10 s and nothing in
between, and one lost reply on rank 0 stalls every rank behind it.

N real ranks (spawned, torch imported before a common start) connect one TCPStore each, R rounds,
once with the machine's resolver settings and once with RES_OPTIONS="timeout:1 attempts:1" (glibc
reads it at start): if the stalls are the resolver's, they shrink from 5 s steps to 1 s steps.

    .venv/bin/python benchmarks/store_connect.py [--ranks 32] [--rounds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from datetime import timedelta

from mshpc.bench import harness
from mshpc.launch.ports import free_port  # no torch import at module level

RESOLVERS = {"machine": None, "timeout_1s": "timeout:1 attempts:1"}


def worker(rank: int, world: int, ports: list[int], barrier, conn) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    for port in ports:
        barrier.wait()  # a common start, torch imported everywhere
        start, cpu = time.time(), time.process_time()
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120),
                              wait_for_workers=False)
        conn.send((time.time() - start, time.process_time() - cpu))
        store.add("done", 1)
        while store.add("done", 0) < world:  # rank 0's server lives until every rank has connected
            time.sleep(0.01)
        barrier.wait()
        del store


def measure(world: int, rounds: int, res_options: str | None) -> list[list[tuple[float, float]]]:
    """Each round's (connect wall s, connect CPU s) of every rank."""
    if res_options is not None:
        os.environ["RES_OPTIONS"] = res_options  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world)
    ports = [free_port() for _ in range(rounds)]
    pipes, procs = [], []
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker, args=(rank, world, ports, barrier, send), daemon=True)
        proc.start()
        pipes.append(recv)
        procs.append(proc)
    try:
        return [[p.recv() for p in pipes] for _ in ports]
    finally:
        os.environ.pop("RES_OPTIONS", None)
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=32)
    harness.add_rounds(parser, 4, "store start-ups per resolver setting")
    args = parser.parse_args()
    for name, res_options in RESOLVERS.items():
        for i, got in enumerate(measure(args.ranks, args.rounds, res_options)):
            walls = sorted(w for w, _ in got)
            harness.emit(harness.record(
                "store_connect", "tcpstore_connect_s", walls[-1], "s", digits=3, resolver=name,
                res_options=res_options, ranks=args.ranks, round=i, median_s=round(walls[len(walls) // 2], 3),
                ranks_over_0_9_s=sum(w > 0.9 for w in walls), cpu_s_max=round(max(c for _, c in got), 4),
                walls_s=[round(w, 2) for w in walls], load_avg=harness.load_average()))


if __name__ == "__main__":
    main()

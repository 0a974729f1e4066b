"""Rendezvous and every 3D process group at growing N (issue #20, part 3): store operations and
bytes per rank and in total, and wall time, measured with real ranks on this machine and
extrapolated to 2,048 and 12,288 with the fitted exponent.

Each rank is a real process running mshpc's own start-up: `launch.rendezvous.init_distributed`
(a real TCPStore on rank 0), `parallel.mesh.build_mesh` for tp=8, pp=N/8 (at most 8), dp the
rest (or the fixed `--tp`/`--pp` given), then one all-reduce in each of its groups and in the
world (a lazily connected gloo pair connects on its first message, so the first collective is
where connections are paid). The store the process group uses is counted by a thin `dist.Store`
subclass that forwards every call to the real TCPStore (the instrumentation: no call is answered
by it), by operation. Modes: `lazy` (mshpc's default
since init_distributed calls `connect_lazily`: a group's creation publishes one address, a pair
connects on first use) and `eager` (TORCH_GLOO_LAZY_INIT=0, torch's default: every member reads
every other member's address and connects at creation). Time runs from a common start after
torch is imported.

    .venv/bin/python benchmarks/scale/rendezvous_scale.py [--n 8 16 32] [--modes lazy eager] [--tp 2 --pp 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from mshpc.bench import harness
from mshpc.launch.ports import free_port

TIMEOUT_S = 600
PAPER = {"naive_2048_s": 1047, "megascale_2048_s": 5, "megascale_over_10000_s": 30}  # MegaScale sec. 3.5


def counting_store(inner):  # type: ignore[no-untyped-def]
    """A dist.Store that forwards each call to `inner` and counts it (ops and key+value bytes)."""
    import torch.distributed as dist

    class CountingStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}
            self.nbytes = 0

        def _count(self, op: str, nbytes: int) -> None:
            self.ops[op] = self.ops.get(op, 0) + 1
            self.nbytes += nbytes

        def set(self, key, value):  # type: ignore[no-untyped-def]
            self._count("set", len(key) + len(value))
            return inner.set(key, value)

        def get(self, key):  # type: ignore[no-untyped-def]
            value = inner.get(key)
            self._count("get", len(key) + len(value))
            return value

        def add(self, key, amount):  # type: ignore[no-untyped-def]
            self._count("add", len(key) + 8)
            return inner.add(key, amount)

        def compare_set(self, key, expected, desired):  # type: ignore[no-untyped-def]
            self._count("compare_set", len(key) + len(expected) + len(desired))
            return inner.compare_set(key, expected, desired)

        def wait(self, keys, timeout=None):  # type: ignore[no-untyped-def]
            self._count("wait", sum(map(len, keys)))
            return inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

        def check(self, keys):  # type: ignore[no-untyped-def]
            self._count("check", sum(map(len, keys)))
            return inner.check(keys)

        def delete_key(self, key):  # type: ignore[no-untyped-def]
            self._count("delete_key", len(key))
            return inner.delete_key(key)

        def num_keys(self):  # type: ignore[no-untyped-def]
            self._count("num_keys", 0)
            return inner.num_keys()

        def set_timeout(self, timeout):  # type: ignore[no-untyped-def]
            return inner.set_timeout(timeout)

    return CountingStore()


def layout(world: int, tp: int | None, pp: int | None):  # type: ignore[no-untyped-def]
    """The mesh measured: the issue's tp=8, pp=N/8 (at most 8), or a fixed tp x pp."""
    from mshpc.mesh_shape import MeshShape

    if tp is None or pp is None:
        tp, pp = 8, max(1, min(8, world // 8))
    return MeshShape(pp=pp, dp=world // (tp * pp), tp=tp)


def worker(rank: int, world: int, port: int, lazy: bool, shape, barrier, conn) -> None:  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist

    import mshpc.launch.rendezvous as rdv
    from mshpc.launch.env import LaunchEnv
    from mshpc.parallel.mesh import build_mesh

    torch.set_num_threads(1)
    counted = []
    real_connect = rdv.connect_store

    def connect_and_count(*args, **kwargs):  # type: ignore[no-untyped-def]
        counted.append(counting_store(real_connect(*args, **kwargs)))
        return counted[0]

    rdv.connect_store = connect_and_count
    if not lazy:  # torch's default, what mshpc did before connect_lazily
        os.environ[rdv.GLOO_LAZY_INIT] = "0"
        rdv.connect_lazily = lambda: None
    env = LaunchEnv(launcher="env", rank=rank, world_size=world, local_rank=rank % 8, local_world_size=8,
                    node=f"node{rank // 8}", master_addr="127.0.0.1", master_port=port, slurm=None, test_faults=None)
    barrier.wait()
    start, cpu = time.time(), time.process_time()
    rdv.init_distributed(env, timeout_s=TIMEOUT_S)
    init_done = time.time()
    mesh = build_mesh(shape)
    groups_done = time.time()
    x = torch.ones(1)
    for group in (mesh.tp, mesh.dp, mesh.pp, mesh.mp, mesh.embed, None):
        dist.all_reduce(x, group=group)
    first_done, cpu = time.time(), time.process_time() - cpu
    store = counted[0]
    conn.send({"cpu_s": cpu, "start": start, "init": init_done, "groups": groups_done, "first": first_done,
               "ops": sum(store.ops.values()), "by_op": store.ops, "bytes": store.nbytes})
    dist.barrier()
    dist.destroy_process_group()


def _merge(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out


def run(world: int, lazy: bool, tp: int | None = None, pp: int | None = None) -> dict:
    """One start-up of `world` real ranks; the slowest rank's times from the common start, and
    the store operations counted on every rank."""
    shape = layout(world, tp, pp)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world)
    port = free_port()
    pipes, procs = [], []
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker, args=(rank, world, port, lazy, shape, barrier, send), daemon=True)
        proc.start()
        pipes.append(recv)
        procs.append(proc)
    try:
        got = [p.recv() for p in pipes]
    finally:
        for proc in procs:
            proc.join(TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    start = min(g["start"] for g in got)
    ops = [g["ops"] for g in got]
    return {"layout": {"tp": shape.tp, "pp": shape.pp, "dp": shape.dp},
            "init_s": max(g["init"] for g in got) - start, "groups_s": max(g["groups"] for g in got) - start,
            "total_s": max(g["first"] for g in got) - start, "cpu_s_per_rank_median": statistics.median(
                g["cpu_s"] for g in got), "ops_per_rank_mean": statistics.mean(ops),
            "ops_per_rank_max": max(ops), "ops_total": sum(ops), "bytes_per_rank_mean": statistics.mean(
                g["bytes"] for g in got), "bytes_total": sum(g["bytes"] for g in got),
            "ops_total_by_op": _merge([g["by_op"] for g in got])}


def store_ops_per_s(clients: int = 8, ops: int = 2000) -> float:
    """Operations per second one real TCPStore serves to `clients` threads, each its own client
    doing set + get of small keys (what rendezvous does): the store's capacity, which bounds a
    start-up of `ops per rank x N` operations however many cores the ranks have."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, clients + 1, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    stores = [dist.TCPStore("127.0.0.1", port, clients + 1, is_master=False, timeout=timedelta(seconds=60))
              for _ in range(clients)]

    def work(i: int) -> None:
        for k in range(ops // 2):
            stores[i].set(f"k{i}/{k}", b"x" * 64)
            stores[i].get(f"k{i}/{k}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate = clients * ops / (time.perf_counter() - start)
    del master
    return rate


def slope(ns: list[int], values: list[float]) -> float:
    return float(np.polyfit(np.log(ns), np.log(values), 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--store-only", action="store_true", help="only the TCPStore's ops/s")
    ap.add_argument("--modes", nargs="+", default=["lazy", "eager"], choices=["eager", "lazy"])
    ap.add_argument("--tp", type=int, help="a fixed layout (with --pp); default: tp=8, pp=N/8 up to 8")
    ap.add_argument("--pp", type=int)
    args = ap.parse_args()
    ns = sorted(args.n)
    rate = store_ops_per_s()
    harness.emit(harness.record("scale_rendezvous", "tcpstore_ops_per_s", round(rate), "ops/s", digits=0, clients=8,
                                load_avg=harness.load_average()))
    for mode in [] if args.store_only else args.modes:
        rows = []
        for n in ns:
            r = run(n, mode == "lazy", args.tp, args.pp)
            rows.append(r)
            harness.emit({"bench": "scale_rendezvous", "mode": mode, "N": n, "unit": "s / store ops / bytes",
                          **{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}})
        ops_exp = slope(ns, [r["ops_per_rank_mean"] for r in rows])
        wall_exp = slope(ns, [r["total_s"] for r in rows])
        at = {m: rows[-1]["total_s"] * (m / ns[-1]) ** wall_exp for m in (2048, 12288)}
        # the store's share: every rank's operations, extrapolated with their own exponent, served
        # one after another by the one store
        store_s = {m: rows[-1]["ops_total"] * (m / ns[-1]) ** (1 + ops_exp) / rate for m in (2048, 12288)}
        # a rank on its own core: its own start-up CPU (measured, the median rank at the largest N)
        # plus the store's queue; the wall time measured here is N ranks sharing 2 cores instead
        cpu = rows[-1]["cpu_s_per_rank_median"]
        harness.emit({"bench": "scale_rendezvous", "mode": mode, "metric": "growth_exponent",
                      "unit": "log-log slope", "N": ns, "ops_per_rank": round(ops_exp, 3),
                      "wall_2_cores": round(wall_exp, 3), "extrapolated_wall_2_cores_s_2048": round(at[2048], 1),
                      "store_bound_s_2048": round(store_s[2048], 2), "store_bound_s_12288": round(store_s[12288], 2),
                      "cpu_s_per_rank": round(cpu, 3), "modelled_s_2048": round(cpu + store_s[2048], 2),
                      "modelled_s_12288": round(cpu + store_s[12288], 2), "paper": PAPER})


if __name__ == "__main__":
    main()

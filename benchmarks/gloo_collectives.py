"""What ZeRO-2's communication costs on CPU ranks: on gloo, its reduce-scatter plus all-gather
of the gradients against DDP's one all-reduce of the same bytes, in wall time and in CPU time
(at gpt-125m on 2 cores, the communication's CPU is taken from the GEMMs); and an all-gather
done as one gloo all-to-all of the input sent to every rank, against comm.all_gather's
point-to-point sends (2026-12-05: gloo's own all-gather, which copies through flat buffers on
its worker thread, took 148 ms of CPU per 200 MiB in 25 MiB buckets, the all-to-all 102-121 ms,
point-to-point sends 68 ms); and the same two collectives on buckets in shared memory
(mshpc/cpu_ranks/shared_buckets.py: the peers' rows read in place, one byte per peer through gloo).

2 ranks on loopback, `--total-mb` of fp32 gradients in `--bucket-mb` buckets, every bucket's
collective issued async and then waited, as the engines do. Six contenders take turns within
each round: all_reduce (DDP's), comm.reduce_scatter, comm.all_gather, the all-to-all
all-gather, and shared_buckets's reduce-scatter and all-gather. Per contender: median wall ms and
median CPU ms of rank 0's process (all threads: gloo's work runs on its own), one JSON line
each, then the three ratios.

    PYTHONPATH=. .venv/bin/python benchmarks/gloo_collectives.py [--total-mb 64] [--bucket-mb 1]
        [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import WORKER_TIMEOUT_S

REPEATS = 3  # calls of a contender per round


def contenders(total_mb: float, bucket_mb: float) -> dict[str, Callable[[], None]]:
    import torch
    import torch.distributed as dist

    from mshpc.cpu_ranks import shared_buckets
    from mshpc.parallel import comm

    numel = int(bucket_mb * 2**20) // 4 // 2 * 2  # even: two equal shards
    grads = [torch.randn(numel) for _ in range(max(1, round(total_mb / bucket_mb)))]
    shards = [torch.randn(numel // 2) for _ in grads]
    params = [torch.empty(numel) for _ in grads]
    # the ZeRO engine's buckets in shared memory: buffer 2i holds bucket i's parameters, 2i + 1
    # its gradients. The repeated all-gathers of one round may rewrite a row a peer is still
    # copying, with the same bytes: the engine orders those (shared_buckets.py), a benchmark need not
    shared = shared_buckets.map_buffers([(numel, torch.float32)] * 2 * len(grads), None)
    assert shared is not None, "the two ranks could not share memory in /dev/shm"
    for i, g in enumerate(grads):
        shared.local[2 * i + 1].copy_(g)
    me = dist.get_rank()

    def waited(issue: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            for work in [issue(i) for i in range(len(grads))]:
                work.wait()  # type: ignore[attr-defined]
        return run

    return {
        "all_reduce": waited(lambda i: dist.all_reduce(grads[i], async_op=True)),
        "reduce_scatter": waited(lambda i: comm.reduce_scatter(shards[i], grads[i], async_op=True)),
        "all_gather": waited(lambda i: comm.all_gather(params[i], shards[i], async_op=True)),
        "all_gather_by_all_to_all": waited(
            lambda i: dist.all_to_all_single(params[i], shards[i].repeat(2), async_op=True)),
        "shared_reduce_scatter": waited(
            lambda i: shared_buckets.reduce_scatter(shared, 2 * i + 1, shared.local[2 * i + 1].view(2, -1)[me])),
        "shared_all_gather": waited(lambda i: shared_buckets.all_gather(shared, 2 * i, shards[i])),
    }


def worker(rank: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.cpu_ranks import gloo_p2p

    if args.message_mb:
        gloo_p2p.GLOO_MESSAGE_BYTES = int(args.message_mb * 2**20)
    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    runs = contenders(args.total_mb, args.bucket_mb)
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, run in runs.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(REPEATS):
                run()
            if r:
                wall[name].append((time.perf_counter() - start) / REPEATS)
                cpu[name].append((time.process_time() - start_cpu) / REPEATS)
    if rank == 0:
        out.put(json.dumps({"wall": wall, "cpu": cpu}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mb", type=float, default=64.0, help="MiB of fp32 gradients")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    harness.add_rounds(parser, 6)
    parser.add_argument("--message-mb", type=float, default=0.0,
                        help="gloo_p2p.GLOO_MESSAGE_BYTES in MiB, the pieces comm cuts gloo ops into (0: comm's own)")
    args = parser.parse_args()
    result = harness.run_local_ranks(worker, 2, (args,))
    wall = {name: statistics.median(v) * 1e3 for name, v in result["wall"].items()}
    cpu = {name: statistics.median(v) * 1e3 for name, v in result["cpu"].items()}
    context = {"total_mb": args.total_mb, "bucket_mb": args.bucket_mb, "ranks": 2, "backend": "gloo",
               "rounds": args.rounds, "message_mb": args.message_mb or None}
    for name in wall:
        harness.emit(harness.record("gloo_collectives", f"{name}_ms", wall[name], "ms", digits=2,
                                    cpu_ms=round(cpu[name], 2), **context))
    pairs = [("all_gather_by_all_to_all", "all_gather"), ("reduce_scatter+all_gather", "all_reduce"),
             ("shared_reduce_scatter+shared_all_gather", "all_reduce")]
    for ours, baseline in pairs:
        mine = sum(cpu[n] for n in ours.split("+"))
        theirs = cpu[baseline]
        mine_wall = sum(wall[n] for n in ours.split("+"))
        harness.emit(harness.record("gloo_collectives", f"cpu_{ours}_vs_{baseline}", mine, "ms", theirs, digits=2,
                                    wall_ratio=round(mine_wall / wall[baseline], 3), **context))


if __name__ == "__main__":
    main()

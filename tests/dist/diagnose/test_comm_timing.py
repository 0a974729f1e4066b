"""Every collective of comm.py is timed as "comm.<op>" by its one door, on real gloo ranks: the
blocking ones in the call, the async ones in the wait on their handle."""

import time

import torch

from mshpc.diagnose.timers import TIMERS
from mshpc.parallel import comm
from support.rank_runner import run_ranks


def timed_collectives(rank: int, world: int) -> dict:
    TIMERS.configure(True, torch.device("cpu"))
    TIMERS.begin_step(1)
    comm.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(0.3)  # rank 0 waits for rank 1 inside the async all-gather's wait()
    gathered = torch.empty(world * 8)
    work = comm.all_gather(gathered, torch.full((8,), float(rank)), async_op=True)
    kinds = type(work).__name__
    work.wait()
    comm.barrier()
    _, phases = TIMERS.end_step().resolve()
    return {"phases": phases, "handle": kinds,
            "gathered": gathered.view(world, 8)[:, 0].tolist()}


def test_collectives_are_timed_in_one_place():
    results = run_ranks(timed_collectives, 2)
    for r in results:
        assert {"comm.all_reduce", "comm.all_gather", "comm.barrier"} <= set(r["phases"])
        assert r["handle"] == "Timed" and r["gathered"] == [0.0, 1.0]
    # the wait for the late rank lands in rank 0's all-gather, not in rank 1's
    assert results[0]["phases"]["comm.all_gather"] > 0.2 > results[1]["phases"]["comm.all_gather"]

"""The multi-rank test helper: a failing or hung rank fails its test quickly, named by rank."""

import time

import pytest
import torch
import torch.distributed as dist

from support.rank_runner import RankError, run_ranks


def fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(600)  # rank 0 is stuck where no closed socket will wake it
    return rank


def rank_1_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
    return rank


def test_a_failing_rank_is_named_and_its_peers_are_released():
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(fail_on_rank_1, 2, timeout_s=120, grace_s=1)
    message = str(err.value)
    assert "rank 1: Traceback" in message and "rank one is broken" in message
    assert "rank 0: killed after another rank failed" in message
    assert time.monotonic() - start < 30  # the grace, not the 120 s timeout


def test_a_hung_rank_times_out_with_its_stack():
    with pytest.raises(RankError) as err:
        # the timeout counts from when both ranks joined, so it need not hold torch's import
        run_ranks(rank_1_hangs, 2, timeout_s=5)
    message = str(err.value)
    assert "rank 1: timed out after 5 s" in message
    assert "rank_1_hangs" in message  # the stack dump says where it hung

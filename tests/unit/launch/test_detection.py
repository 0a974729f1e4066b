"""Which rank the last line names when several fail: the root cause, whichever exited first."""

import time

from mshpc.config import load_config
from mshpc.launch.detection import ECHO_WAIT_S, detect
from mshpc.launch.monitor import RankState

CFG = load_config(None, []).supervisor
ECHO = "preparing the dataset failed on 1 other rank(s); see their error"
CAUSE = "data.path=/nowhere does not exist (make it with mshpc prepare, or leave data.path unset)"


def failed(rank: int, error: str, message: str, ago_s: float) -> RankState:
    """A rank that said "failed" `ago_s` seconds ago (its process already gone, code 2)."""
    t = time.time() - ago_s
    return RankState(rank, host=f"slot{rank}", outcome={"type": "failed", "t": t, "error": error, "message": message,
                     "user_error": True, "loss_diverged": False, "phase": "setup", "step": -1},
                     exit_code=2, exited_at=t)


def training(rank: int) -> RankState:
    return RankState(rank, host=f"slot{rank}", last_beat_at=time.monotonic(), phase="setup")


def test_an_echo_that_exits_first_waits_for_the_rank_it_echoes():
    states = {0: training(0), 1: failed(1, "MshpcError", ECHO, ago_s=1.0)}
    assert detect(states, CFG, time.monotonic()) is None  # rank 0 is still to tell its own error
    states[0] = failed(0, "DataError", CAUSE, ago_s=0.6)
    det = detect(states, CFG, time.monotonic())
    assert det is not None and det.rank == 0 and det.kind == "user_error"
    assert det.detail == f"rank 0 exited with code 2: DataError: {CAUSE}"


def test_the_cause_is_named_even_when_it_ended_later_than_its_echo():
    states = {0: failed(0, "DataError", CAUSE, ago_s=1.0), 1: failed(1, "MshpcError", ECHO, ago_s=3.0)}
    det = detect(states, CFG, time.monotonic())
    assert det is not None and det.rank == 0 and "DataError" in det.detail


def test_an_echo_alone_is_named_once_the_wait_is_over():
    # the rank it echoes never tells (say it hangs): the echo is all there is, after a bounded wait
    states = {0: training(0), 1: failed(1, "MshpcError", ECHO, ago_s=ECHO_WAIT_S + 0.5)}
    det = detect(states, CFG, time.monotonic())
    assert det is not None and det.rank == 1 and "other rank(s)" in det.detail


def test_the_launchers_words_count_when_the_rank_said_nothing():
    # no heartbeat message, only what the local launcher read from the rank's stderr
    echo = RankState(1, exit_code=2, exited_at=time.time() - 1.0,
                     exit_detail=f"rank 1 exited with code 2: MshpcError: {ECHO}")
    states = {0: training(0), 1: echo}
    assert detect(states, CFG, time.monotonic()) is None

"""Which rank the last line names when several fail: the root cause, whichever exited first."""

import time

from mshpc.config import load_config
from mshpc.launch.detection import ECHO_WAIT_S, detect, settles_in
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


def killed(rank: int, ago_s: float) -> RankState:
    """A rank killed by SIGKILL `ago_s` seconds ago, as the supervisor saw it: no word from it."""
    t = time.time() - ago_s
    return RankState(rank, host=f"slot{rank}", exit_code=-9, exited_at=t, closed_at=t)


PEER_LOST = "[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41234: Connection reset by peer"


def test_a_peer_lost_error_waits_for_the_silent_end_it_echoes():
    # rank 1 killed; rank 0's collective failed first by its own clock, the supervisor saw rank 1's
    # end later (a loaded machine): the killed rank is named, not the survivor
    states = {0: failed(0, "DistBackendError", PEER_LOST, ago_s=1.0), 1: training(1)}
    assert detect(states, CFG, time.monotonic()) is None
    states[1] = killed(1, ago_s=0.6)
    det = detect(states, CFG, time.monotonic())
    assert det is not None and det.rank == 1 and det.kind == "crash" and det.exit_code == 137
    assert det.detail == "rank 1 was killed by SIGKILL"


def test_a_failure_still_settling_says_when_it_is_acted_on():
    # the supervisor wakes then rather than at its next poll (0.2 s), which every crash paid
    states = {0: training(0), 1: training(1)}
    assert settles_in(states, 0.5) is None
    states[1] = failed(1, "RuntimeError", "boom", ago_s=0.1)
    wait = settles_in(states, 0.5)
    assert wait is not None and 0.3 < wait <= 0.4 and detect(states, CFG, time.monotonic(), 0.5) is None
    states[1] = failed(1, "RuntimeError", "boom", ago_s=0.6)
    assert settles_in(states, 0.5) == 0.0
    det = detect(states, CFG, time.monotonic(), 0.5)
    assert det is not None and det.rank == 1

"""The supervisor's repeat check (issue #43, finding 6): the same failure from the same checkpoint
is the same whichever rank reports it first, so a deterministic divergence stops after one retry
instead of using up every restart."""

import time

from mshpc.config import SupervisorConfig
from mshpc.launch.detection import detect
from mshpc.launch.monitor import RankState
from mshpc.launch.recovery import PastFailure, classify

CFG = SupervisorConfig()


def diverged(first: int, message: str = "loss nan at step 5 (NaN/Inf, or above supervisor.loss_limit=None)"):
    """Both ranks report the all-reduced NaN loss; rank `first` a moment before the other."""
    now = time.time()
    states = {}
    for r in range(2):
        t = now - (2.0 if r == first else 1.5)
        states[r] = RankState(r, host=f"n{r}", closed_at=t, outcome={
            "type": "failed", "t": t, "error": "LossDiverged", "message": message, "user_error": False,
            "loss_diverged": True, "phase": "step", "step": 4, "start_step": 4})
    return detect(states, CFG, time.monotonic()), states


def test_the_same_divergence_reported_first_by_another_rank_is_the_same_failure():
    (det0, s0), (det1, s1) = diverged(first=0), diverged(first=1)
    assert (det0.rank, det1.rank) == (0, 1) and det0.detail != det1.detail  # the rank ids differ
    assert PastFailure.of(det0, s0, resumed_from=4) == PastFailure.of(det1, s1, resumed_from=4)
    assert classify(det1, s1, [], {}, same_as_before=True).cls == "user_error"
    # another checkpoint, another step or other words: a new failure, retried
    assert PastFailure.of(det0, s0, resumed_from=2) != PastFailure.of(det1, s1, resumed_from=4)
    det2, s2 = diverged(first=1, message="loss inf at step 5 (NaN/Inf, or above supervisor.loss_limit=None)")
    assert PastFailure.of(det2, s2, resumed_from=4) != PastFailure.of(det0, s0, resumed_from=4)

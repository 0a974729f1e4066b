"""Recovery in place, the supervisor's side without processes: whom a failure replaces, when it
cannot be done in place and why, and what the ranks are told; and, over a real Monitor and a real
Heartbeat on a socket, that a rank's "lost" and the supervisor's rejoin travel both ways."""

import json
import time

import pytest

from mshpc.config import load_config
from mshpc.launch.detection import detect
from mshpc.launch.env import SupervisorLink
from mshpc.launch.hang_report import Missing
from mshpc.launch.heartbeat import Heartbeat
from mshpc.launch.in_place import Generation, plan
from mshpc.launch.monitor import Monitor, RankState
from mshpc.launch.node_relay import addressee
from mshpc.mesh_shape import MeshShape
from mshpc.save_schedule import SaveSchedule

CFG = load_config(None, []).supervisor
SHAPE = MeshShape(pp=1, dp=4, tp=1)


def _training(rank: int) -> RankState:
    return RankState(rank, host=f"slot{rank}", pid=100 + rank, last_beat_at=time.monotonic(), phase="step",
                     step=5, start_step=0)


def _killed(rank: int, ago_s: float = 1.0) -> RankState:
    s = _training(rank)
    s.exit_code, s.exited_at, s.closed_at = -9, time.time() - ago_s, time.time() - ago_s
    return s


def _lost(rank: int, ago_s: float = 0.9, error: str = "RuntimeError", message: str = "Connection closed by peer") -> RankState:
    s = _training(rank)
    s.lost = {"type": "lost", "t": time.time() - ago_s, "error": error, "message": message, "phase": "step",
              "step": 5, "generation": 0}
    return s


def test_a_killed_rank_is_replaced_and_not_a_survivor_that_raised_before_its_end_was_seen():
    # the survivor's "lost" came first (its collective failed at once); the dead rank is the cause
    states = {0: _lost(0, ago_s=1.0), 1: _killed(1, ago_s=0.8), 2: _lost(2), 3: _lost(3)}
    det = detect(states, CFG, time.monotonic())
    assert det is not None and det.rank == 1 and det.detail == "rank 1 was killed by SIGKILL"
    chosen, why = plan(det, states, [], SHAPE)
    assert why == "" and chosen is not None
    assert chosen.replaced == (1,) and chosen.survivors == (0, 2, 3) and chosen.store_rank == 0
    assert chosen.keepers == {1: 2}  # the ring over nodes: rank 1's snapshot is on the next node


def test_a_rank_that_failed_on_its_own_and_waits_is_the_one_replaced():
    states = {r: _training(r) for r in range(4)}
    states[2] = _lost(2, error="RuntimeError", message="injected fault at rank 2 step 5")
    det = detect(states, CFG, time.monotonic())
    assert det is not None and det.rank == 2 and det.detail == "rank 2 failed: RuntimeError: injected fault at rank 2 step 5"
    chosen, _ = plan(det, states, [], SHAPE)
    assert chosen is not None and chosen.replaced == (2,)


def test_a_hang_replaces_its_silent_ranks_and_not_a_hang_of_live_ranks():
    states = {r: _training(r) for r in range(4)}
    states[3].last_beat_at = time.monotonic() - 100  # frozen
    det = detect(states, CFG, time.monotonic() - 100)
    assert det is not None and det.kind == "hang"
    chosen, _ = plan(det, states, [Missing(3, "silent for 100.0 s (process state T (stopped))")], SHAPE)
    assert chosen is not None and chosen.replaced == (3,)
    alive = [Missing(3, "missing from all_reduce #4 on group world (entered 3)")]
    assert plan(det, states, alive, SHAPE) == (None, "a hang with every rank alive: no rank to replace")


@pytest.mark.parametrize(("change", "why"), [
    (lambda s: s.update({2: _killed(2)}), "rank 1 and its buddy rank 2 were both lost"),
    (lambda s: setattr(s[3], "start_step", None), "the failure came while the ranks were starting (before their first snapshot)"),
])
def test_when_in_place_cannot_help_it_says_why(change, why):
    states = {0: _training(0), 1: _killed(1), 2: _training(2), 3: _training(3)}
    change(states)
    det = detect(states, CFG, time.monotonic())
    assert det is not None and plan(det, states, [], SHAPE) == (None, why)


def test_a_loss_or_a_user_error_is_not_recovered_in_place():
    states = {r: _training(r) for r in range(4)}
    states[0].outcome = {"type": "failed", "t": time.time() - 1, "error": "LossDiverged", "message": "loss nan at step 6",
                         "user_error": True, "loss_diverged": True, "phase": "step", "step": 5}
    det = detect(states, CFG, time.monotonic())
    assert det is not None and det.kind == "loss"
    assert plan(det, states, [], SHAPE) == (None, "a loss is no lost or hung rank")


def test_a_generation_tells_survivors_and_replacements_the_same_rendezvous():
    gen = Generation(number=2, starts=3, port=4567, store_rank=1)
    abort, rejoin = [json.loads(line) for line in gen.rejoin(0).splitlines()]
    assert abort == {"type": "abort", "rank": 0}
    assert rejoin == {"type": "rejoin", "rank": 0, "generation": 2, "attempt": 3, "port": 4567, "store_rank": 1}
    env = gen.env(3, "slot7")
    assert (env["MASTER_PORT"], env["MSHPC_STORE_RANK"], env["MSHPC_GENERATION"], env["MSHPC_ATTEMPT"]) == ("4567", "1", "2", "3")
    assert (env["MSHPC_NODE"], env["MSHPC_REPLACEMENT"], env["MSHPC_NODE_RELAY_START"]) == ("slot7", "1", "0")


def test_a_relay_passes_a_rank_its_own_word_and_every_rank_a_dump_request():
    assert addressee(b'{"type": "dump"}\n') == "all"
    assert addressee(b'{"type": "rejoin", "rank": 5, "generation": 1}\n') == 5
    assert addressee(b'{"type": "abort", "rank": 2}\n') == 2
    assert addressee(b'{"type": "abort", "rank": "2"}\n') is None and addressee(b"[1]") is None


def test_lost_and_rejoin_travel_between_a_real_heartbeat_and_monitor():
    monitor = Monitor(1, "tok", "127.0.0.1")
    link = SupervisorLink("127.0.0.1", monitor.port, "tok", attempt=0)
    beat = Heartbeat(link, {"rank": 0, "host": "h", "coords": "(dp=0, tp=0, pp=0)"}, 0.05,
                     SaveSchedule(interval_steps=0, last_step=0))
    aborted = []
    beat.on_abort = lambda: aborted.append(True)
    try:
        with beat:
            beat.phase("step", 3)
            beat.lost(RuntimeError("Connection closed by peer"))
            deadline = time.monotonic() + 10
            while monitor.ranks[0].lost is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert monitor.ranks[0].lost["error"] == "RuntimeError" and monitor.ranks[0].lost["step"] == 3
            monitor.renew([0], generation=1)
            beat.lost(RuntimeError("late"))  # an old generation's word arriving after the renewal
            beat.restart()
            beat.phase("data", 7)  # "started": after the late "lost" on the same connection
            while monitor.ranks[0].start_step != 7 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert monitor.ranks[0].lost is None and monitor.ranks[0].rejoin_at is None
            assert monitor.send({0: Generation(1, 1, 4242, 0).rejoin(0)}) == []
            assert monitor.send({5: Generation(1, 1, 4242, 0).rejoin(5)}) == [5]  # no such connection
            word = beat.await_rejoin(10)
            assert word is not None and word["port"] == 4242 and beat.generation == 1 and aborted == [True]
    finally:
        monitor.close()

"""The supervisor's parts on their own: timeouts, detection, blame and eviction, the hang
report's lag analysis, fault specs, and a heartbeat talking to a monitor over a real socket."""

import dataclasses
import time

import pytest

from mshpc.config import SupervisorConfig, load_config
from mshpc.errors import ConfigError
from mshpc.faults import bind, parse_faults
from mshpc.launch.detection import detect
from mshpc.launch.env import SupervisorLink
from mshpc.launch.hang_report import lagging
from mshpc.launch.heartbeat import Heartbeat
from mshpc.launch.monitor import Monitor, RankState
from mshpc.launch.recovery import NodePool, classify
from mshpc.launch.supervisor import CHECK_SHARE, MAX_PAUSE_S, check_pause
from mshpc.launch.timeouts import phase_timeout
from mshpc.loss_check import LossDiverged, check_loss
from mshpc.save_schedule import SaveSchedule

CFG = SupervisorConfig(timeout_k=5, timeout_floor_s=10, checkpoint_timeout_s=100, setup_timeout_s=300)
NO_SAVES = SaveSchedule(interval_steps=0, last_step=0)


def test_timeouts_follow_the_median_above_the_floor():
    assert phase_timeout(CFG, "step", []).seconds == 10  # nothing observed yet: the floor
    assert phase_timeout(CFG, "step", [1.0, 1.5]).seconds == 10  # 5 x 1.5 is below the floor
    assert phase_timeout(CFG, "step", [1.0, 4.0]).seconds == 20  # the slowest rank's median counts
    assert phase_timeout(CFG, "checkpoint", [4.0]).seconds == 100  # a long save is not a hang
    assert phase_timeout(CFG, "eval", [4.0]).seconds == 100  # nor a long validation
    assert phase_timeout(CFG, "compile", [4.0]).seconds == 100  # nor train.compile's first step
    assert phase_timeout(CFG, "setup", [99.0]).seconds == 300


def test_the_pause_after_a_check_keeps_checks_to_their_share_and_never_outlasts_a_poll():
    # 12,288 ranks: a 10 ms check is followed by 90 ms of the monitor's own work
    assert check_pause(0.010) == pytest.approx(0.010 * (1 / CHECK_SHARE - 1))
    assert check_pause(0.0) == 0.0 and check_pause(-1e-9) == 0.0  # a clock's rounding
    # paced by wall time, a pass of 0.8 s paused the loop 7.2 s (a SIGKILL was once seen 7.4 s late)
    assert check_pause(0.8) == MAX_PAUSE_S <= 0.2


def states(**by_rank):
    return {r: RankState(r, host=f"n{r}", **by_rank.get(f"r{r}", {})) for r in range(2)}


def test_the_first_rank_to_fail_is_the_one_named():
    now = time.time()
    s = states(r0={"closed_at": now - 1.0, "outcome": {"type": "failed", "t": now - 1.0, "error": "RuntimeError",
                                                         "message": "Connection closed by peer"}},
               r1={"closed_at": now - 2.0, "exit_code": -9, "exited_at": now - 2.0})
    det = detect(s, CFG, time.monotonic())
    assert (det.kind, det.rank, det.detail, det.exit_code) == ("crash", 1, "rank 1 was killed by SIGKILL", 137)
    verdict = classify(det, s, [], {}, same_as_before=False)
    assert (verdict.cls, verdict.blame) == ("node_fault", ("n1",))


def test_a_phase_past_its_timeout_is_a_hang():
    s = states(r0={"last_beat_at": time.monotonic(), "phase": "step", "step": 4, "phase_s": 11.0},
               r1={"last_beat_at": time.monotonic(), "phase": "step", "step": 4, "phase_s": 3.0})
    det = detect(s, CFG, time.monotonic())
    assert (det.kind, det.rank, det.timeout_s) == ("hang", 0, 10)
    s[0].phase_s = 9.0
    assert detect(s, CFG, time.monotonic()) is None


def test_a_rank_silent_past_the_heartbeat_timeout_is_frozen_before_any_phase_timeout():
    cfg = SupervisorConfig(timeout_floor_s=10, heartbeat_interval_s=0.5, heartbeat_timeout_s=2)
    now = time.monotonic()
    s = states(r0={"last_beat_at": now - 0.3, "phase": "step", "step": 4, "phase_s": 2.4},
               r1={"last_beat_at": now - 2.5, "phase": "step", "step": 4, "phase_s": 0.1})
    det = detect(s, cfg, now)
    assert (det.kind, det.rank, det.timeout_s, det.step) == ("hang", 1, 2, 4)
    assert det.detail.startswith("rank 1 frozen: no heartbeat for 2.") and det.time_to_detect_s > 2
    assert detect(s, dataclasses.replace(cfg, heartbeat_timeout_s=0), now) is None  # off: the floor alone
    s[1].last_beat_at = now - 1.9
    assert detect(s, cfg, now) is None
    # silence in set-up or a long phase is left to that phase's timeout: a resume or a save in
    # h5py holds the GIL, and the beats with it
    for phase in ("setup", "checkpoint", "eval", "compile"):
        s[1].last_beat_at, s[1].phase = now - 9.0, phase
        assert detect(s, cfg, now) is None, phase


def test_a_heartbeat_timeout_shorter_than_three_beats_is_refused():
    with pytest.raises(ConfigError, match=r"^supervisor.heartbeat_timeout_s=1 must be at least 3 x "
                                          r"supervisor.heartbeat_interval_s=0.5 \(or 0: off\)$"):
        load_config(None, ["supervisor.heartbeat_interval_s=0.5", "supervisor.heartbeat_timeout_s=1"])
    assert load_config(None, ["supervisor.heartbeat_interval_s=0.5", "supervisor.heartbeat_timeout_s=0"])


def test_lagging_ranks_are_those_missing_from_a_groups_latest_collective():
    s = {r: RankState(r, counts={"world": 7, "[0, 2]": 3}) for r in range(4)}
    s[2].counts = {"world": 6, "[0, 2]": 3}
    s[3].counts = {"world": 7}
    s[0].last = [40, "world", "all_reduce", 8]
    assert lagging(s) == {2: "missing from all_reduce #7 on group world (entered 6)"}


def test_a_node_blamed_twice_is_evicted_and_a_spare_takes_its_place():
    pool = NodePool(["a", "b", "c", "d"], needed=3, evict_after=2)
    assert pool.blame("b") == 1 and not pool.should_evict("b", now=False)
    assert pool.blame("b") == 2 and pool.should_evict("b", now=False)
    assert pool.evict("b") == "d" and pool.active == ["a", "d", "c"] and pool.spares == []
    assert pool.evict("c") is None and pool.active == ["a", "d"]


def test_fault_specs_bind_to_a_rank_or_a_node_and_an_attempt(tmp_path):
    faults = parse_faults("kill:rank=1:step=3:attempt=0;stop:node=slot2:step=5")
    assert bind(faults, 1, "slot1", 0, tmp_path, tmp_path)[0].kind == "kill"
    assert bind(faults, 1, "slot1", 1, tmp_path, tmp_path) == ()  # a one-shot fault stays in attempt 0
    (stop,) = bind(faults, 3, "slot2", 4, tmp_path, tmp_path)
    assert (stop.kind, stop.rank, stop.step) == ("stop", 3, 5)
    with pytest.raises(ConfigError, match="KIND:rank=R:step=S or KIND:node=NAME:step=S"):
        parse_faults("kill:step=3")


def test_heartbeats_reach_the_monitor_and_a_dump_returns_stacks():
    monitor = Monitor(1, "tok")
    link = SupervisorLink("127.0.0.1", monitor.port, "tok", 0)
    try:
        with Heartbeat(link, {"rank": 0, "host": "h", "coords": "(dp=0, tp=0, pp=0)"}, 0.05, NO_SAVES) as beat:
            for step in range(4):
                beat.phase("step", step)
                time.sleep(0.01)
            deadline = time.monotonic() + 10
            while monitor.ranks[0].step != 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            state = monitor.ranks[0]
            assert (state.host, state.phase, state.step, state.start_step) == ("h", "step", 3, 0)
            assert state.medians["step"] > 0
            monitor.request_dumps(10)
            assert "test_heartbeats_reach_the_monitor" in state.dump["stacks"]
            with pytest.raises(LossDiverged, match="loss nan at step 5"):
                check_loss(float("nan"), 4, None)
        # the exit message travels like the beats: the monitor's thread records it a moment later
        deadline = time.monotonic() + 10
        while monitor.ranks[0].outcome is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert monitor.ranks[0].outcome["how"] == "ok"
    finally:
        monitor.close()


def test_leaving_a_long_phase_is_told_at_once_not_at_the_next_beat():
    monitor = Monitor(1, "tok")
    link = SupervisorLink("127.0.0.1", monitor.port, "tok", 0)

    def seen(phase: str, step: int) -> bool:
        deadline = time.monotonic() + 10
        while (monitor.ranks[0].phase, monitor.ranks[0].step) != (phase, step) and time.monotonic() < deadline:
            time.sleep(0.01)
        return (monitor.ranks[0].phase, monitor.ranks[0].step) == (phase, step)

    try:  # one beat as the thread starts, the next in 600 s: what comes sooner, phase() sent
        with Heartbeat(link, {"rank": 0, "host": "h", "coords": "(dp=0, tp=0, pp=0)"}, 600.0,
                       SaveSchedule(interval_steps=1, last_step=9)) as beat:
            assert seen("setup", -1)  # the first beat
            beat.phase("step", 0)
            assert seen("step", 0)  # set-up left
            beat.phase("checkpoint", 0)
            beat.phase("data", 1)
            assert seen("data", 1)  # the save left
            beat.phase("step", 1)
            time.sleep(0.2)
            assert (monitor.ranks[0].phase, monitor.ranks[0].step) == ("data", 1)  # a plain change waits for its beat
    finally:
        monitor.close()


def test_the_checkpoint_phase_begins_only_on_steps_that_save():
    beat = Heartbeat(None, {}, 1.0, SaveSchedule(interval_steps=2, last_step=5))
    beat.phase("step", 0)
    beat.phase("checkpoint", 0)  # step 1 saves nothing: still the step phase
    assert beat._current[:2] == ("step", 0)
    beat.phase("checkpoint", 1)  # step 2 saves
    assert beat._current[:2] == ("checkpoint", 1)
    beat.phase("checkpoint", 4)  # the last step always saves
    assert beat._current[:2] == ("checkpoint", 4)


def test_a_stranger_without_the_token_is_not_heard():
    monitor = Monitor(1, "tok")
    try:
        with Heartbeat(SupervisorLink("127.0.0.1", monitor.port, "old", 0), {"rank": 0, "host": "h"}, 0.05, NO_SAVES):
            time.sleep(0.3)
        assert monitor.ranks[0].host is None and monitor.ranks[0].outcome is None
    finally:
        monitor.close()


def test_a_diverged_loss_reaches_the_monitor_with_the_start_step():
    monitor = Monitor(1, "tok")
    try:
        with pytest.raises(LossDiverged):
            with Heartbeat(SupervisorLink("127.0.0.1", monitor.port, "tok", 1), {"rank": 0, "host": "h"}, 600.0,
                           NO_SAVES) as beat:
                beat.phase("data", 4)
                beat.phase("step", 4)
                check_loss(float("nan"), 4, None)
        deadline = time.monotonic() + 10
        while monitor.ranks[0].outcome is None and time.monotonic() < deadline:
            time.sleep(0.02)
        outcome = monitor.ranks[0].outcome
        assert (outcome["type"], outcome["loss_diverged"], outcome["step"]) == ("failed", True, 4)
        assert monitor.ranks[0].start_step == 4  # told at once, with no periodic beat in 600 s
    finally:
        monitor.close()

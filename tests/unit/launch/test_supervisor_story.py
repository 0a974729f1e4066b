"""The supervisor's story (events.jsonl) is told from what the ranks say, whatever the beat
timing: a real Supervisor, Monitor and Heartbeat over real sockets, the ranks played by threads
of this process (the launcher's part) and a heartbeat interval far longer than the attempts."""

import json
import threading
import time

from mshpc.config import load_config
from mshpc.events import EVENTS_FILE
from mshpc.launch.env import SupervisorLink
from mshpc.launch.heartbeat import Heartbeat
from mshpc.launch.monitor import RankState
from mshpc.launch.recovery import NodePool
from mshpc.launch.supervisor import Supervisor
from mshpc.run_dir import run_path
from mshpc.save_schedule import SaveSchedule

BEAT_S = 600.0  # no periodic beat comes while an attempt runs: only the first, sent before any step
STEPS, SCHEDULE = 8, SaveSchedule(interval_steps=2, last_step=8)
FAIL_AT = 5  # attempt 0 fails in step 5 (0-based), after the save of step 4


def train(link: SupervisorLink) -> None:
    """Rank 0's side of one attempt, as the train loop calls its heartbeat; attempt 0 fails."""
    start = 0 if link.attempt == 0 else 4  # the restart resumes from the checkpoint of step 4
    with Heartbeat(link, {"rank": 0, "host": "h"}, BEAT_S, SCHEDULE) as beat:
        for step in range(start, STEPS):
            beat.phase("data", step)
            beat.phase("step", step)
            if link.attempt == 0 and step == FAIL_AT:
                raise RuntimeError(f"injected fault at step {step}")
            beat.phase("checkpoint", step)


class ThreadRank:
    """One attempt's only rank, as a thread; tells the supervisor how it ended, as a launcher does."""

    def __init__(self, link: SupervisorLink) -> None:
        self.code: int | None = None
        self.ended_wall: float | None = None
        self.thread = threading.Thread(target=self._run, args=(link,), daemon=True)
        self.thread.start()

    def _run(self, link: SupervisorLink) -> None:
        try:
            train(link)
            self.code = 0
        except RuntimeError:
            self.code = 1
        self.ended_wall = time.time()

    def update(self, states: dict[int, RankState]) -> None:
        if self.ended_wall is not None and states[0].exited_at is None:
            states[0].exit_code, states[0].exited_at = self.code, self.ended_wall

    def stop(self, grace_s: float) -> list[int]:
        self.thread.join(grace_s)
        return []


def start(attempt: int, hosts: list[str], env: dict[str, str]) -> ThreadRank:
    host, port = env["MSHPC_SUPERVISOR"].rsplit(":", 1)
    return ThreadRank(SupervisorLink(host, int(port), env["MSHPC_SUPERVISOR_TOKEN"], attempt))


def test_resumed_comes_before_recovered_whatever_the_beat_interval(tmp_path):
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.name=story", f"supervisor.heartbeat_interval_s={BEAT_S}",
                             "supervisor.heartbeat_timeout_s=0"])
    supervisor = Supervisor(1, NodePool(["h"], 1, cfg.supervisor.evict_after), start, "127.0.0.1", supervisor=cfg.supervisor, spare_nodes=cfg.train.spare_nodes,
                            run_dir=run_path(cfg.run), checkpoints=run_path(cfg.run) / "checkpoints")
    assert supervisor.run() == 0
    evs = [json.loads(line) for line in (tmp_path / "story" / EVENTS_FILE).read_text().splitlines()]
    kinds = [e["kind"] for e in evs]
    story = ["attempt_start", "resumed", "failure_detected", "restart", "attempt_start", "resumed", "recovered", "run_end"]
    seen = iter(kinds)
    assert all(k in seen for k in story), f"events out of order: {kinds}"
    assert [(e["attempt"], e["from_step"]) for e in evs if e["kind"] == "resumed"] == [(0, 0), (1, 4)]
    recovered = next(e for e in evs if e["kind"] == "recovered")
    assert (recovered["attempt"], recovered["resumed_from"]) == (1, 4)

"""A stop signal to the supervisor: ranks still in set-up are stopped at once (nothing to
checkpoint yet); training ranks are asked for a checkpoint at their next step boundary, and a
second signal stops them at once. A real Supervisor and Heartbeat; the rank is a thread that
never gets to a step boundary."""

import json
import signal
import threading
import time

import pytest

from mshpc.config import load_config
from mshpc.events import EVENTS_FILE
from mshpc.launch.env import SupervisorLink
from mshpc.launch.heartbeat import Heartbeat
from mshpc.launch.monitor import RankState
from mshpc.launch.recovery import NodePool
from mshpc.launch.requeue import JobStopped
from mshpc.launch.supervisor import Supervisor
from mshpc.run_dir import run_path
from mshpc.save_schedule import SaveSchedule


class StuckRank:
    """One attempt's only rank: in set-up, or training (it said "started") in a step that does not end."""

    def __init__(self, link: SupervisorLink, training: bool) -> None:
        self.requests, self.ended_wall = 0, None
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(link, training), daemon=True)
        self.thread.start()

    def _run(self, link: SupervisorLink, training: bool) -> None:
        with Heartbeat(link, {"rank": 0, "host": "h"}, 600.0, SaveSchedule(0, 8)) as beat:
            if training:
                beat.phase("data", 0)  # the loop began: rank 0 tells its start step at once
            self._stopped.wait(60)

    def update(self, states: dict[int, RankState]) -> None:
        if self.ended_wall is not None and states[0].exited_at is None:
            states[0].exit_code, states[0].exited_at = -signal.SIGTERM, self.ended_wall

    def request_stop(self) -> None:
        self.requests += 1  # heard, but the step it is in does not end

    def stop(self, grace_s: float) -> list[int]:
        self._stopped.set()
        self.thread.join(grace_s)
        self.ended_wall = self.ended_wall or time.time()
        return []


def run_signalled(tmp_path, training: bool, signal_at_s: list[float]) -> tuple[Supervisor, list[StuckRank], list[dict]]:
    """Run a supervisor whose rank is stuck, sending it SIGTERM (as its handler would) at those times."""
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.name=stop", "supervisor.heartbeat_interval_s=600",
                             "supervisor.heartbeat_timeout_s=0"])
    ranks: list[StuckRank] = []

    def start(attempt: int, hosts: list[str], env: dict[str, str]) -> StuckRank:
        host, port = env["MSHPC_SUPERVISOR"].rsplit(":", 1)
        ranks.append(StuckRank(SupervisorLink(host, int(port), env["MSHPC_SUPERVISOR_TOKEN"], attempt), training))
        return ranks[-1]

    supervisor = Supervisor(1, NodePool(["h"], 1, cfg.supervisor.evict_after), start, "127.0.0.1", supervisor=cfg.supervisor, spare_nodes=cfg.train.spare_nodes,
                            run_dir=run_path(cfg.run), checkpoints=run_path(cfg.run) / "checkpoints")
    for at in signal_at_s:
        threading.Timer(at, supervisor.request_stop, args=(signal.SIGTERM,)).start()
    with pytest.raises(JobStopped) as stopped:
        supervisor.run()
    assert stopped.value.code == 128 + signal.SIGTERM
    evs = [json.loads(line) for line in (tmp_path / "stop" / EVENTS_FILE).read_text().splitlines()]
    end = evs[-1]
    assert (end["kind"], end["outcome"], end["exit_code"]) == ("run_end", "stopped", 143)
    return supervisor, ranks, evs


def test_sigterm_in_set_up_stops_the_ranks_at_once(tmp_path, capsys):
    _, ranks, evs = run_signalled(tmp_path, training=False, signal_at_s=[1.0])
    assert [e["how"] for e in evs if e["kind"] == "stop_requested"] == ["at once"]
    assert len(ranks) == 1 and ranks[0].requests == 0  # no restart, and no checkpoint asked of a rank in set-up
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mshpc: stopped by SIGTERM; latest checkpoint: none (the same command resumes from it)")


def test_a_second_sigterm_stops_training_ranks_at_once(tmp_path):
    _, ranks, evs = run_signalled(tmp_path, training=True, signal_at_s=[1.0, 2.5])
    assert [e["how"] for e in evs if e["kind"] == "stop_requested"] == ["a checkpoint at the next step", "at once"]
    assert len(ranks) == 1 and ranks[0].requests == 1

"""How a supervised run ends: which steps its effective time counts, and which failures end it
at once (a user error, or the environment's: a full disk) with exit code 2 and the rank's line."""

import json
import threading
import time

from mshpc.config import load_config
from mshpc.errors import MshpcError
from mshpc.events import EVENTS_FILE
from mshpc.launch.env import SupervisorLink
from mshpc.launch.heartbeat import Heartbeat
from mshpc.launch.monitor import RankState
from mshpc.launch.recovery import NodePool
from mshpc.launch.supervisor import USER_ERROR_EXIT, Supervisor, useful_step_seconds
from mshpc.run_dir import run_path
from mshpc.save_schedule import SaveSchedule


def write_metrics(path, steps, step_time_s=1.0):
    path.write_text("".join(json.dumps({"step": s, "step_time_s": step_time_s}) + "\n" for s in steps))


def test_only_the_steps_this_run_trained_count(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, range(1, 9))  # an earlier run's steps 1-8, one second each
    assert useful_step_seconds(metrics, None) == 0.0  # this run trained none: it failed in set-up
    assert useful_step_seconds(metrics, 4) == 4.0  # resumed at step 4: steps 5-8
    assert useful_step_seconds(metrics, 0) == 8.0
    write_metrics(metrics, [2, 4, 6, 8])  # run.log_interval_steps=2: a record stands for 2 steps
    assert useful_step_seconds(metrics, 3) == 5.0  # steps 4-8


class RunEnvironmentError(MshpcError):
    """As the ranks name a full disk where the run writes (the class name is what travels)."""


class FailingRank:
    """One attempt's only rank, a thread: it fails in set-up with a full disk, as a launcher tells."""

    def __init__(self, link: SupervisorLink) -> None:
        self.ended_wall: float | None = None
        self.thread = threading.Thread(target=self._run, args=(link,), daemon=True)
        self.thread.start()

    def _run(self, link: SupervisorLink) -> None:
        try:
            with Heartbeat(link, {"rank": 0, "host": "h"}, 600.0, SaveSchedule(0, 8)):
                raise RunEnvironmentError("runs/x/metrics.jsonl: no space left on device (0 B free)")
        except RunEnvironmentError:
            self.ended_wall = time.time()

    def update(self, states: dict[int, RankState]) -> None:
        if self.ended_wall is not None and states[0].exited_at is None:
            states[0].exit_code, states[0].exited_at = USER_ERROR_EXIT, self.ended_wall

    def request_stop(self) -> None:
        pass

    def stop(self, grace_s: float) -> list[int]:
        self.thread.join(grace_s)
        return []


def start(attempt: int, hosts: list[str], env: dict[str, str]) -> FailingRank:
    host, port = env["MSHPC_SUPERVISOR"].rsplit(":", 1)
    return FailingRank(SupervisorLink(host, int(port), env["MSHPC_SUPERVISOR_TOKEN"], attempt))


def test_a_full_disk_is_not_retried_and_its_line_comes_last(tmp_path, capsys):
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.name=env", "supervisor.max_restarts=2"])
    supervisor = Supervisor(1, NodePool(["h", "spare"], 1, 1), start, "127.0.0.1", supervisor=cfg.supervisor, spare_nodes=cfg.train.spare_nodes,
                            run_dir=run_path(cfg.run), checkpoints=run_path(cfg.run) / "checkpoints")
    assert supervisor.run() == USER_ERROR_EXIT
    evs = [json.loads(line) for line in (tmp_path / "env" / EVENTS_FILE).read_text().splitlines()]
    kinds = [e["kind"] for e in evs]
    assert kinds.count("attempt_start") == 1 and "restart" not in kinds and "evicted" not in kinds
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mshpc: rank 0 exited with code 2: RunEnvironmentError: runs/x/metrics.jsonl: no space left on device (0 B free)")

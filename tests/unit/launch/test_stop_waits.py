"""What a restart after a frozen rank waits for: neither its stacks (it cannot send them) nor the
SIGKILL grace (it can act on SIGTERM once continued). Found by benchmarks/chaos.py, where these
two waits made the recovery from a SIGSTOP 2.3x a fresh start-up."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from mshpc.launch.env import SupervisorLink
from mshpc.launch.heartbeat import Heartbeat
from mshpc.launch.local import LocalRanks, stop_all
from mshpc.launch.monitor import Monitor
from mshpc.save_schedule import SaveSchedule


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_stopped_process_ends_on_sigterm_without_waiting_for_the_kill():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while _state(proc.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(proc.pid) == "T"
    began = time.monotonic()
    killed = stop_all([proc], grace_s=5.0)
    assert killed == [] and proc.returncode == -signal.SIGTERM
    assert time.monotonic() - began < 2.5  # the grace was 5 s: it was not waited out


def test_a_local_ranks_exit_wakes_the_supervisors_loop_at_once():
    # the supervisor waits on its monitor's event: a stopped or finished run's exits, which only
    # the launcher sees, were found at its next poll (0.2 s) instead
    wake = threading.Event()
    ranks = LocalRanks(["--help"], [{}], wake=wake)
    try:
        assert wake.wait(60)
        assert ranks.ranks[0].exited_at is not None and ranks.ranks[0].proc.returncode == 0
    finally:
        ranks.stop()


def _say(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def test_dumps_are_awaited_only_from_ranks_that_still_beat():
    monitor = Monitor(2, "tok")
    frozen = socket.create_connection(("127.0.0.1", monitor.port))
    link = SupervisorLink("127.0.0.1", monitor.port, "tok", 0)
    try:
        # rank 1 says hello and beats once, then falls silent as a SIGSTOPped process does
        _say(frozen, {"type": "hello", "token": "tok", "rank": 1, "host": "h1"})
        _say(frozen, {"type": "beat", "phase": "step", "step": 3, "phase_s": 0.0, "medians": {}, "counts": {},
                      "last": None})
        with Heartbeat(link, {"rank": 0, "host": "h0"}, 0.05, SaveSchedule(interval_steps=0, last_step=0)):
            deadline = time.monotonic() + 10
            while monitor.ranks[1].last_beat_at is None or monitor.ranks[0].last_beat_at is None:
                assert time.monotonic() < deadline, "both ranks should be heard"
                time.sleep(0.02)
            time.sleep(0.5)  # rank 1 is now silent for longer than the 0.3 s below
            began = time.monotonic()
            monitor.request_dumps(5.0, silent_after_s=0.3)
            took = time.monotonic() - began
            assert monitor.ranks[0].dump is not None and monitor.ranks[1].dump is None
            assert took < 2.5, f"waited {took:.1f} s for a rank that cannot answer"
    finally:
        frozen.close()
        monitor.close()

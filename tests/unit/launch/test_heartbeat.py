"""A rank whose supervisor is gone stops itself: a stop request at once (the train loop's watcher
checkpoints at the next step boundary), and an exit after the grace if it cannot get there."""

import signal
import socket
import subprocess
import sys
import threading
import time

from mshpc.launch.env import SupervisorLink
from mshpc.launch.heartbeat import ORPHAN_EXIT, Heartbeat
from mshpc.launch.requeue import STOP_REQUEST_SIGNAL
from mshpc.save_schedule import SaveSchedule

NO_SAVES = SaveSchedule(interval_steps=0, last_step=100)


def hello_then_close(server: socket.socket, hello_at: list[float] | None = None) -> None:
    """The supervisor's side: take the hello (noting when in `hello_at`), then go away."""
    conn, _ = server.accept()
    conn.makefile("rb").readline()
    if hello_at is not None:
        hello_at.append(time.monotonic())
    conn.close()
    server.close()


def test_a_closed_supervisor_connection_asks_this_process_to_stop():
    server = socket.create_server(("127.0.0.1", 0))
    link = SupervisorLink("127.0.0.1", server.getsockname()[1], "tok", 0)
    got = []
    previous = signal.signal(STOP_REQUEST_SIGNAL, lambda signum, frame: got.append(signum))
    try:
        threading.Thread(target=hello_then_close, args=(server,), daemon=True).start()
        with Heartbeat(link, {"rank": 0, "host": "h"}, 0.05, NO_SAVES, orphan_grace_s=30.0):
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
        assert got == [STOP_REQUEST_SIGNAL]  # and leaving the block ended the grace: no exit came
    finally:
        signal.signal(STOP_REQUEST_SIGNAL, previous)


# a rank whose main thread never reaches a step boundary (blocked in a collective, say)
BLOCKED_RANK = """
import signal, sys, time
from mshpc.launch.env import SupervisorLink
from mshpc.launch.heartbeat import Heartbeat
from mshpc.save_schedule import SaveSchedule
signal.signal(signal.SIGHUP, lambda s, f: None)  # the watcher's flag, which nobody polls here
link = SupervisorLink("127.0.0.1", int(sys.argv[1]), "tok", 0)
with Heartbeat(link, {"rank": 0, "host": "h"}, 0.05, SaveSchedule(0, 100), orphan_grace_s=0.5):
    time.sleep(60)
"""


def test_a_rank_that_cannot_reach_a_step_boundary_exits_after_the_grace():
    server = socket.create_server(("127.0.0.1", 0))
    hello_at: list[float] = []
    threading.Thread(target=hello_then_close, args=(server, hello_at), daemon=True).start()
    out = subprocess.run([sys.executable, "-c", BLOCKED_RANK, str(server.getsockname()[1])],
                         capture_output=True, text=True, timeout=90)
    # timed from the hello, not the start: Python and torch's import took 20 s at load 16 here;
    # a rank that ignored the grace would sit out its 60 s sleep
    assert out.returncode == ORPHAN_EXIT and time.monotonic() - hello_at[0] < 20
    assert "is gone (its heartbeat connection closed)" in out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("did not stop within 0.5 s: exiting without a checkpoint")
    assert "Traceback" not in out.stderr

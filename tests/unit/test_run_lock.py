"""The run directory's lock (mshpc/run_lock.py), held by real processes: a second holder is
refused with a line naming the first, a dead holder's lock is taken over with a line saying so,
and the lock goes when its holder's `with` ends or its process dies."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from mshpc.run_lock import (
    LOCK_ENV,
    LOCK_FILE,
    Holder,
    RunLockError,
    _check_previous,  # the no-flock rule, tested without a file system that lacks flock
    acquire_run_lock,
    check_run_lock,
    hold_run_lock,
    read_holder,
)

# A holder in its own process: takes the lock, says its PID, then waits to be told to go.
_HOLD = """
import sys
from pathlib import Path
from mshpc.run_lock import hold_run_lock
with hold_run_lock(Path(sys.argv[1])) as holder:
    print(holder.pid, flush=True)
    sys.stdin.readline()
"""


class OtherHolder:
    """A process that holds run_dir's lock until `release` or `kill`."""

    def __init__(self, run_dir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the holder exited with {self.proc.wait()}"
        self.pid = int(line)

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def other(tmp_path):
    holders = []

    def start(run_dir: Path) -> OtherHolder:
        holders.append(OtherHolder(run_dir))
        return holders[-1]

    yield start
    for h in holders:
        if h.proc.poll() is None:
            h.kill()


def test_a_second_holder_is_refused_with_a_line_naming_the_first(tmp_path, other):
    run_dir = tmp_path / "runs" / "tiny"
    first = other(run_dir)
    with pytest.raises(RunLockError) as refused:
        acquire_run_lock(run_dir)
    line = str(refused.value)
    assert "\n" not in line
    assert f"pid {first.pid} on {socket.gethostname()}" in line and str(run_dir / LOCK_FILE) in line
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # the refused one wrote nothing
    assert read_holder(run_dir / LOCK_FILE).pid == first.pid  # and took nothing from the first


def test_the_lock_is_released_when_the_with_ends_and_the_variable_restored(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv(LOCK_ENV, raising=False)
    run_dir = tmp_path / "tiny"
    with hold_run_lock(run_dir) as holder:
        assert os.environ[LOCK_ENV] == holder.token == f"{socket.gethostname()}:{os.getpid()}:{holder.nonce}"
        assert read_holder(run_dir / LOCK_FILE) == holder
        with pytest.raises(RunLockError, match=f"pid {os.getpid()} on"):
            acquire_run_lock(run_dir)  # even this process cannot take it twice
    assert LOCK_ENV not in os.environ and read_holder(run_dir / LOCK_FILE) is None
    with pytest.raises(ValueError), hold_run_lock(run_dir):
        raise ValueError("the body failed")
    with caplog.at_level(logging.WARNING), hold_run_lock(run_dir):
        pass
    assert "stale" not in caplog.text  # released cleanly: nothing to take over


def test_a_lock_released_by_its_process_is_free(tmp_path, other):
    run_dir = tmp_path / "tiny"
    other(run_dir).release()
    lock = acquire_run_lock(run_dir)
    lock.release()


def test_the_lock_of_a_killed_holder_is_taken_over_with_a_line(tmp_path, other, caplog):
    run_dir = tmp_path / "tiny"
    gone = other(run_dir)
    gone.kill()  # the kernel drops its flock; the file still names it
    assert read_holder(run_dir / LOCK_FILE).pid == gone.pid
    with caplog.at_level(logging.WARNING), hold_run_lock(run_dir) as holder:
        assert read_holder(run_dir / LOCK_FILE) == holder
    assert f"taking over the stale lock of pid {gone.pid} on {socket.gethostname()}" in caplog.text


def test_a_lock_file_naming_a_dead_pid_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = Holder(socket.gethostname(), int(done.stdout), "earlier", None, "abc")
    (run_dir / LOCK_FILE).write_text(json.dumps(asdict(dead)))
    with caplog.at_level(logging.WARNING), hold_run_lock(run_dir):
        pass
    assert f"taking over the stale lock of pid {dead.pid}" in caplog.text


def test_a_live_holder_is_refused_even_where_its_flock_is_not_seen(tmp_path, other):
    """A file system whose flock does not hold (the holder's flock not visible here): the file
    names a live process on this host, so it is not taken over."""
    run_dir = tmp_path / "tiny"
    alive = other(tmp_path / "elsewhere")  # holds another folder's lock, so not this flock
    named = read_holder(tmp_path / "elsewhere" / LOCK_FILE)
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps(asdict(named)))
    with pytest.raises(RunLockError, match=f"pid {alive.pid} on .* alive though its flock was free"):
        acquire_run_lock(run_dir)


def test_ranks_check_that_their_starter_holds_the_lock(tmp_path, other):
    run_dir = tmp_path / "tiny"
    with hold_run_lock(run_dir) as holder:
        assert check_run_lock(run_dir, holder.token) == holder
        with pytest.raises(RunLockError, match="not the run that started this process"):
            check_run_lock(run_dir, "otherhost:1:0123456789ab")
    with pytest.raises(RunLockError, match="does not hold"):
        check_run_lock(run_dir, holder.token)  # released: a rank of a finished run must not write
    gone = other(run_dir)
    token = read_holder(run_dir / LOCK_FILE).token
    gone.kill()
    with pytest.raises(RunLockError, match=f"pid {gone.pid} on .* is gone"):
        check_run_lock(run_dir, token)  # its supervisor died: this rank is an orphan


def test_a_holder_on_another_host_is_taken_over_only_when_flock_vouches(tmp_path, caplog):
    """Where the file system cannot flock, a remote holder's liveness cannot be seen: refused,
    saying how to go on; where flock works and was free, the remote holder is gone."""
    path = tmp_path / LOCK_FILE
    remote = Holder("node-elsewhere", 4242, "earlier", None, "abc")
    with pytest.raises(RunLockError, match="pid 4242 on node-elsewhere .* remove the lock file if that run is gone"):
        _check_previous(tmp_path, path, remote, flocked=False)
    with caplog.at_level(logging.WARNING):
        _check_previous(tmp_path, path, remote, flocked=True)
    assert "taking over the stale lock of pid 4242 on node-elsewhere" in caplog.text

"""The fork server (mshpc/launch/fork_server.py) through its launcher's side (forked.py): real
servers importing torch, real forked ranks of `mshpc train` that wait in their rendezvous."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from support.cli_runner import REPO, train_args

from mshpc.launch.fork_protocol import read_request
from mshpc.launch.fork_server import unsafe_to_fork
from mshpc.launch.forked import ForkServer
from mshpc.launch.local import LocalRanks
from mshpc.launch.ports import free_port


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command's name: state, ppid, pgrp, session..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def _waiting_rank_env() -> dict[str, str]:
    """Rank 1 of 2 whose rendezvous store never answers: it waits there until ended."""
    return {"MSHPC_BOOTSTRAP": "env", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def _until(check, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_ranks_are_forked_by_one_server_in_sessions_of_their_own_and_their_ends_reported(tmp_path):
    server = ForkServer(train_args(tmp_path, tmp_path / "cache"), {})
    try:
        first, second = server.fork(_waiting_rank_env()), server.fork(_waiting_rank_env())
        _until(lambda: first.pid is not None and second.pid is not None)
        for proc in (first, second):
            state, ppid, _, session = _stat(proc.pid)[:4]
            assert int(ppid) == server.proc.pid and int(session) == proc.pid and proc.poll() is None
        first.kill()
        assert first.wait(30) == -signal.SIGKILL and alive(second.pid)
        # a replacement comes from the same server, as a first rank did
        third = server.fork(_waiting_rank_env())
        _until(lambda: third.pid is not None)
        assert int(_stat(third.pid)[1]) == server.proc.pid
        for proc in (second, third):
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
    finally:
        server.close()
    assert server.proc.returncode == 0  # its socket closed, it ended on its own


def test_a_rank_exit_code_and_stderr_come_back_as_a_child_process_would_give_them(tmp_path):
    server = ForkServer(["train", str(tmp_path / "missing.yaml")], {})
    try:
        proc = server.fork({})
        assert proc.wait(60) == 2  # a user error
        said = proc.stderr.read().decode()
        assert "missing.yaml" in said and said.count("\n") <= 2, said
    finally:
        server.close()


def test_a_server_that_cannot_import_ends_every_rank_with_its_words(tmp_path):
    broken = tmp_path / "site" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    ranks = LocalRanks(["--help"], [{"PYTHONPATH": str(tmp_path / "site")}] * 2)
    try:
        _until(ranks.all_exited)
        failure = ranks.first_failure()
        assert failure is not None and failure.describe().endswith("ImportError: this torch is broken")
    finally:
        ranks.stop()


def test_a_stop_while_the_server_imports_ends_it_rather_than_waiting(tmp_path):
    ranks = LocalRanks(train_args(tmp_path, tmp_path / "cache"), [_waiting_rank_env()] * 2)
    ranks.stop(grace_s=30)  # a grace no rank needs: none was forked
    assert ranks.server.proc.returncode == -signal.SIGKILL
    assert [r.proc.returncode for r in ranks.ranks] == [-signal.SIGKILL] * 2


# a launcher that forks a waiting rank, prints its PID, then waits to be killed
LAUNCHER = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from support.cli_runner import train_args
from mshpc.launch.forked import ForkServer
server = ForkServer(train_args(Path({tmp!r}), Path({tmp!r}) / "cache"), {env!r})
rank = server.fork({{}})
while rank.pid is None:
    time.sleep(0.01)
print(rank.pid, server.proc.pid, flush=True)
time.sleep(120)
"""


def test_a_forked_rank_dies_with_its_launcher_killed_by_sigkill(tmp_path):
    code = LAUNCHER.format(tests=str(REPO / "tests"), tmp=str(tmp_path), env=_waiting_rank_env())
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                                cwd=REPO)
    rank, server = map(int, launcher.stdout.readline().split())
    try:
        assert alive(rank) and alive(server)
        launcher.kill()  # no handler, no finally: the server's death signal, then the rank's
        launcher.wait()
        _until(lambda: not alive(rank) and not alive(server), timeout_s=10)
    finally:
        for pid in (rank, server):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_fork_request_is_an_object_of_strings_only():
    assert read_request(b'{"fork": 3, "env": {"RANK": "3"}}').env == {"RANK": "3"}
    for bad in (b'{"fork": 3, "env": {"RANK": 3}}', b'{"fork": "3", "env": {}}', b'{"env": {}}', b"[]"):
        with pytest.raises(ValueError):
            read_request(bad)


def test_a_server_with_a_second_thread_refuses_to_fork():
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert "Python threads after the imports" in unsafe_to_fork()
    finally:
        release.set()
        other.join()


def test_a_stop_signal_to_the_server_leaves_it_and_its_ranks_running(tmp_path):
    # scancel and the time limit signal every process of a job step: a rank stops after a
    # checkpoint, which the server's end (and with it its ranks' death signal) would cut short
    server = ForkServer(train_args(tmp_path, tmp_path / "cache"), {})
    try:
        rank = server.fork(_waiting_rank_env())
        _until(lambda: rank.pid is not None)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
            os.kill(server.proc.pid, signum)
        time.sleep(0.5)
        assert server.proc.poll() is None and rank.poll() is None and alive(rank.pid)
        # the rank has a fresh process's dispositions: SIGTERM is not ignored there
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(30) == -signal.SIGTERM
    finally:
        server.close()
    assert server.proc.returncode == 0

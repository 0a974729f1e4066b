"""The launcher's side of the fork server (mshpc/launch/fork_server.py): start it, ask it for a
rank, and hold each forked rank as a `ForkedProcess`, which answers as much of subprocess.Popen as
the local launcher uses (poll, wait, send_signal, kill, returncode, stderr).

The server, not the launcher, is a forked rank's parent: it reports each exit on its socket, and
the launcher signals a rank by its PID until that report has come (the server reaps a child only
to report it, so the PID is not free before).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

from mshpc.launch.fork_protocol import FD_ENV, MESSAGE_MAX_BYTES
from mshpc.launch.orphan_guard import die_with_parent

CLOSE_WAIT_S = 5.0  # how long the server gets to end once its socket is closed


class ForkedProcess:
    """A rank forked by the server; `pid` is None until the server has forked it."""

    def __init__(self, stderr: IO[bytes]) -> None:
        self.stderr = stderr
        self.pid: int | None = None
        self.returncode: int | None = None
        self._pending: list[int] = []  # signals sent before the fork: delivered right after it
        self._lock = threading.Lock()
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            if self.pid is None:
                self._pending.append(signum)
                return
            _signal(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def forked(self, pid: int) -> None:
        with self._lock:
            self.pid = pid
            for signum in self._pending:
                _signal(pid, signum)

    def ended(self, code: int) -> None:
        with self._lock:
            self.returncode = code
        self._ended.set()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # it ended; its report is on its way


class ForkServer:
    """`python -m mshpc.launch.fork_server ARGV` with `env` on top of ours; `fork` asks it for a rank."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # its own session, and it dies with the thread that starts it, as a rank Popen'd here would
        self.proc = subprocess.Popen([sys.executable, "-m", "mshpc.launch.fork_server", *argv],
                                     env={**os.environ, **env, FD_ENV: str(theirs.fileno())},
                                     pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=die_with_parent())
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._asked: dict[int, ForkedProcess] = {}  # by request number, until forked
        self._forked: dict[int, ForkedProcess] = {}  # by PID, until ended
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def fork(self, env: Mapping[str, str]) -> ForkedProcess:
        """A new rank with `env` on top of the server's variables; its stderr is a pipe to us."""
        read_end, write_end = os.pipe()
        proc = ForkedProcess(os.fdopen(read_end, "rb"))
        with self._lock:  # not held while sending: the reader needs it to take the server's answers
            number = next(self._numbers)
            self._asked[number] = proc
        try:
            socket.send_fds(self.sock, [json.dumps({"fork": number, "env": dict(env)}).encode()], [write_end])
        except OSError:
            with self._lock:
                self._asked.pop(number, None)
            proc.ended(-signal.SIGKILL)  # the server is gone: so is every rank it forked
        finally:
            os.close(write_end)
        return proc

    def unforked(self) -> bool:
        """Whether a rank was asked for and not forked yet (the server still imports)."""
        with self._lock:
            return bool(self._asked)

    def _read(self) -> None:
        try:
            while data := self.sock.recv(MESSAGE_MAX_BYTES):
                message = json.loads(data)
                with self._lock:
                    if "forked" in message:
                        proc = self._asked.pop(message["forked"])
                        self._forked[message["pid"]] = proc
                        proc.forked(message["pid"])
                    else:
                        self._forked.pop(message["exit"]).ended(message["code"])
        except ConnectionResetError:
            pass  # it ended with requests unread
        finally:
            self._lost()

    def _lost(self) -> None:
        """The server ended: a rank never forked ends with its code, and one forked ends as
        its parent's death ends it (SIGKILL, sent here too in case it is still on its way)."""
        try:
            code = self.proc.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:  # its socket failed, not it: of no use without one
            self.proc.kill()
            code = self.proc.wait()
        with self._lock:
            asked, forked = list(self._asked.values()), list(self._forked.values())
            self._asked.clear()
            self._forked.clear()
        for proc in forked:
            proc.kill()
            proc.ended(-signal.SIGKILL)
        for proc in asked:
            proc.ended(code or 1)

    def close(self) -> None:
        """End the server: its socket closed, it exits; killed if it does not (still importing)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=0 if self.unforked() else CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=CLOSE_WAIT_S)
        self.sock.close()

"""The supervisor's side of the heartbeats: a TCP server it owns and the table of what each
rank last said (mshpc/launch/heartbeat.py is the other side).

Only JSON lines are read; a connection whose first line does not carry this attempt's token is
dropped, so a straggling rank of an earlier attempt cannot speak for the current one.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankState:
    """What the supervisor knows of one rank. `last_beat_at` is the supervisor's time.monotonic();
    the times a rank ended at (`closed_at`, `exited_at`, an outcome's "t") are wall clock times,
    comparable across the ranks' hosts."""

    rank: int
    host: str | None = None
    pid: int | None = None
    coords: str | None = None
    last_beat_at: float | None = None
    phase: str = "setup"
    step: int = -1
    start_step: int | None = None  # the step the rank resumed from: its "started" message, or its last words
    phase_s: float = 0.0  # seconds in `phase` when the last beat was sent
    medians: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    last: list[Any] | None = None  # the last collective entered: [seq, group, op, bytes]
    closed_at: float | None = None  # the connection ended (the process exited or was killed)
    outcome: dict[str, Any] | None = None  # its "failed" or "exit" message (with "t": when)
    dump: dict[str, Any] | None = None
    exit_code: int | None = None  # when the launcher knows it (local ranks)
    exited_at: float | None = None
    exit_detail: str | None = None  # the launcher's own words on how it ended, when it has them

    def stuck_s(self, now: float, started_at: float) -> float:
        """How long the rank has been in its current phase, as far as the supervisor can tell."""
        if self.last_beat_at is None:
            return now - started_at
        return self.phase_s + (now - self.last_beat_at)

    def silent_s(self, now: float, started_at: float) -> float:
        return now - (self.last_beat_at if self.last_beat_at is not None else started_at)

    @property
    def ended(self) -> bool:
        return self.outcome is not None or self.closed_at is not None or self.exited_at is not None


class Monitor:
    """Accepts the ranks' heartbeat connections for one attempt and keeps `ranks` current."""

    def __init__(self, world: int, token: str, bind_host: str = "127.0.0.1") -> None:
        self.token, self.world = token, world
        self.ranks = {r: RankState(r) for r in range(world)}
        self.changed = threading.Event()  # set on every message that may need a decision
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._server = socket.create_server((bind_host, 0))
        self.port = self._server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="mshpc-monitor", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        rank = None
        try:
            for line in conn.makefile("rb"):
                message = json.loads(line)
                if rank is None:
                    rank = self._hello(conn, message)
                    if rank is None:
                        return
                else:
                    self._update(self.ranks[rank], message)
        except (OSError, ValueError):
            pass
        finally:
            conn.close()
            if rank is not None:
                with self._lock:
                    self.ranks[rank].closed_at = time.time()
                self.changed.set()

    def _hello(self, conn: socket.socket, hello: dict[str, Any]) -> int | None:
        rank = hello.get("rank")
        if hello.get("type") != "hello" or hello.get("token") != self.token or rank not in self.ranks:
            return None
        with self._lock:
            state = self.ranks[rank]
            state.host, state.pid, state.coords = hello.get("host"), hello.get("pid"), hello.get("coords")
            state.last_beat_at = time.monotonic()
            self._conns[rank] = conn
        return rank

    def _update(self, state: RankState, message: dict[str, Any]) -> None:
        now = time.monotonic()
        with self._lock:
            kind = message.get("type")
            if kind == "beat":
                state.last_beat_at, state.phase, state.step = now, message["phase"], message["step"]
                state.phase_s, state.medians = message["phase_s"], message["medians"]
                state.counts, state.last = message["counts"], message["last"]
            elif kind == "started":
                state.start_step = message["start_step"]
            elif kind in ("failed", "exit"):
                state.outcome = message
                if message.get("start_step") is not None:
                    state.start_step = message["start_step"]
            elif kind == "dump":
                state.dump = message
        if kind != "beat":
            self.changed.set()

    def request_dumps(self, timeout_s: float) -> None:
        """Ask every connected rank for its stacks and flight recorder; wait up to `timeout_s`."""
        with self._lock:
            asked = dict(self._conns)
        for rank, conn in list(asked.items()):
            try:
                conn.sendall(b'{"type": "dump"}\n')
            except OSError:
                asked.pop(rank, None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(self.ranks[r].dump is None and self.ranks[r].closed_at is None for r in asked):
            time.sleep(0.05)

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            for conn in self._conns.values():
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

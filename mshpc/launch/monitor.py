"""The supervisor's side of the heartbeats: a TCP server it owns and the table of what each
rank last said (mshpc/launch/heartbeat.py is the other side).

Only JSON lines are read, and each must have the shape its type promises (`FIELDS`); nothing a
peer sends can raise in the monitor. A connection whose first line is not a hello carrying this
attempt's token, within `HELLO_TIMEOUT_S`, is dropped: a straggling rank of an earlier attempt
cannot speak for the current one, and a port scanner or an idle peer holds nothing for long.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # a rank says hello as soon as it connects; anyone slower is not one
HELLO_MAX_BYTES = 64 * 1024  # a hello is a few hundred bytes
MESSAGE_MAX_BYTES = 256 * 2**20  # a dump (every stack, the whole flight recorder) is the largest
_RECV_BYTES = 64 * 1024
_ACCEPT_RETRY_S = 0.05  # after a failed accept (out of descriptors): idle peers are dropped soon


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


# ---------------------------------------------------------------- what a rank may say


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _dict_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and check(x) for k, x in v.items())


def _record(v: Any) -> bool:
    """A flight recorder entry: [seq, group, op, bytes]."""
    return (isinstance(v, list) and len(v) == 4 and _int(v[0]) and _str(v[1]) and _str(v[2])
            and _int(v[3]))


def _records(v: Any) -> bool:
    return isinstance(v, list) and all(_record(r) for r in v)


# Every field the supervisor reads, by message type, with its check; a missing field is None.
FIELDS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "hello": {"token": _str, "rank": _int, "host": _optional(_str), "pid": _optional(_int),
              "coords": _optional(_str)},
    "beat": {"phase": _str, "step": _int, "phase_s": _num, "medians": _dict_of(_num),
             "counts": _dict_of(_int), "last": _optional(_record)},
    "started": {"start_step": _int},
    "failed": {"t": _num, "error": _str, "message": _str, "user_error": _bool, "loss_diverged": _bool,
               "phase": _str, "step": _int, "start_step": _optional(_int)},
    "exit": {"how": _str, "code": _optional(_int), "start_step": _optional(_int)},
    "dump": {"stacks": _str, "records": _records, "counts": _dict_of(_int)},
}


def parse_message(line: bytes) -> dict[str, Any] | None:
    """The message on `line` if it is a JSON object of a known type with every field in shape."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        return None
    if not isinstance(message, dict):
        return None
    kind = message.get("type")
    fields = FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None or not all(check(message.get(key)) for key, check in fields.items()):
        return None
    return message


class _Lines:
    """Newline-ended lines read from a socket, each at most `limit` bytes long."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn, self._buf, self._scanned = conn, bytearray(), 0

    def next(self, limit: int, deadline: float | None = None) -> bytes | None:
        """The next line; None once the peer closed, the line outgrew `limit` or `deadline`
        (time.monotonic) passed. A socket error (a reset) raises OSError."""
        while (end := self._buf.find(b"\n", self._scanned)) < 0:
            self._scanned = len(self._buf)
            if len(self._buf) > limit:
                return None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._conn.settimeout(left)  # the whole line's deadline, not each recv's: a trickle ends too
            chunk = self._conn.recv(_RECV_BYTES)
            if not chunk:
                return None
            self._buf += chunk
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        self._scanned = 0
        return line if end <= limit else None


# ---------------------------------------------------------------- the server


class Monitor:
    """Accepts the ranks' heartbeat connections for one attempt and keeps `ranks` current."""

    def __init__(self, world: int, token: str, bind_host: str = "127.0.0.1",
                 hello_timeout_s: float = HELLO_TIMEOUT_S) -> None:
        self.token, self.world, self.hello_timeout_s = token, world, hello_timeout_s
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
                if self._closed:
                    return
                time.sleep(_ACCEPT_RETRY_S)  # out of descriptors, or a peer gone before accept
                continue
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        rank = None
        lines = _Lines(conn)
        try:
            hello = lines.next(HELLO_MAX_BYTES, time.monotonic() + self.hello_timeout_s)
            rank = self._hello(conn, parse_message(hello) if hello is not None else None)
            if rank is None:
                return
            ignored = 0
            while (line := lines.next(MESSAGE_MAX_BYTES)) is not None:
                message = parse_message(line)
                if message is None:
                    ignored += 1
                    if ignored == 1:  # a rank's bug, not a reason to stop listening to it
                        log.warning("supervisor: ignored a malformed heartbeat message from rank %d", rank)
                    continue
                self._update(self.ranks[rank], message)
        except OSError:
            pass  # the peer reset the connection
        finally:
            conn.close()
            if rank is not None:
                with self._lock:
                    self.ranks[rank].closed_at = time.time()
                self.changed.set()

    def _hello(self, conn: socket.socket, hello: dict[str, Any] | None) -> int | None:
        if hello is None or hello["type"] != "hello" or hello["token"] != self.token:
            return None
        rank = hello["rank"]
        if rank not in self.ranks:
            return None
        conn.settimeout(None)  # a rank may be quiet for long between beats (heartbeat_interval_s)
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

    def request_dumps(self, timeout_s: float, silent_after_s: float = float("inf")) -> None:
        """Ask every connected rank for its stacks and flight recorder; wait up to `timeout_s` for
        those that still beat. A rank silent for `silent_after_s` (frozen, or its heartbeat
        thread starved) cannot answer: waiting for it would only delay the restart."""
        with self._lock:
            asked = dict(self._conns)
        for rank, conn in list(asked.items()):
            try:
                conn.sendall(b'{"type": "dump"}\n')
            except OSError:
                asked.pop(rank, None)
        start = time.monotonic()
        awaited = [r for r in asked if self.ranks[r].silent_s(start, start) < silent_after_s]
        while time.monotonic() < start + timeout_s and any(
                self.ranks[r].dump is None and self.ranks[r].closed_at is None for r in awaited):
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

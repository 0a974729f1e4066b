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
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mshpc.launch.server_limits import ensure_descriptors, listen_backlog

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # a rank says hello as soon as it connects; anyone slower is not one
HELLO_MAX_BYTES = 64 * 1024  # a hello is a few hundred bytes
MESSAGE_MAX_BYTES = 256 * 2**20  # a dump (every stack, the whole flight recorder) is the largest
_RECV_BYTES = 64 * 1024
_ACCEPT_RETRY_S = 0.05  # after a failed accept (out of descriptors): idle peers are dropped soon
_CLOSE_WAIT_S = 5.0  # for the loop to close every connection


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


class _Peer:
    """One connection, as the event loop sees it: the bytes read but not yet a whole line, and
    the rank its hello named (None until then, when `hello_by` is its deadline)."""

    def __init__(self, conn: socket.socket, hello_by: float) -> None:
        self.conn, self.hello_by = conn, hello_by
        self.buf, self.scanned = bytearray(), 0
        self.rank: int | None = None
        self.ignored = 0

    def next_line(self) -> bytes | None:
        """The next whole line; None until one has arrived. _LineTooLong once the pending line
        outgrew its limit (a hello's, then a message's)."""
        limit = HELLO_MAX_BYTES if self.rank is None else MESSAGE_MAX_BYTES
        end = self.buf.find(b"\n", self.scanned)
        if end < 0:
            self.scanned = len(self.buf)  # a 256 MB dump arrives in many reads: scan each byte once
            if len(self.buf) > limit:
                raise _LineTooLong
            return None
        line = bytes(self.buf[:end])
        del self.buf[: end + 1]
        self.scanned = 0
        if end > limit:
            raise _LineTooLong
        return line


class _LineTooLong(Exception):
    """A peer's line is past its limit: the connection is dropped."""


# ---------------------------------------------------------------- the server


class Monitor:
    """Accepts the ranks' heartbeat connections for one attempt and keeps `ranks` current. One
    thread serves every connection from one event loop: a thread per rank does not start fast
    enough when thousands connect at once (491 of 512 registered after 60 s, issue #20)."""

    def __init__(self, world: int, token: str, bind_host: str = "127.0.0.1",
                 hello_timeout_s: float = HELLO_TIMEOUT_S) -> None:
        self.token, self.world, self.hello_timeout_s = token, world, hello_timeout_s
        self.ranks = {r: RankState(r) for r in range(world)}
        self.changed = threading.Event()  # set on every message that may need a decision
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        ensure_descriptors(world)
        self._server = socket.create_server((bind_host, 0), backlog=listen_backlog(world))
        self._server.setblocking(False)
        self.port = self._server.getsockname()[1]
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()  # close() interrupts the loop's select
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._greeting: dict[socket.socket, _Peer] = {}  # no hello yet, oldest (first deadline) first
        self._accept_paused_until: float | None = None
        self._thread = threading.Thread(target=self._serve, name="mshpc-monitor", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the event loop

    def _serve(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select(self._select_timeout()):
                    if key.fileobj is self._server:
                        self._accept()
                    elif isinstance(key.data, _Peer):
                        self._receive(key.data)
                self._expire_hellos()
                self._resume_accept()
        finally:
            self._teardown()

    def _select_timeout(self) -> float | None:
        """Until the first hello deadline or the end of an accept pause; forever without either."""
        first = next(iter(self._greeting.values()), None)  # deadlines come in accept order
        deadlines = [] if first is None else [first.hello_by]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accept(self) -> None:
        """Every connection waiting in the backlog, so that thousands connecting at once are
        taken in one pass rather than one per select."""
        while True:
            try:
                conn, _ = self._server.accept()
            except BlockingIOError:
                return
            except OSError:  # out of descriptors: pause, idle peers are dropped at their hello deadline
                self._selector.unregister(self._server)
                self._accept_paused_until = time.monotonic() + _ACCEPT_RETRY_S
                return
            conn.setblocking(False)
            peer = _Peer(conn, time.monotonic() + self.hello_timeout_s)
            self._greeting[conn] = peer
            self._selector.register(conn, selectors.EVENT_READ, peer)

    def _resume_accept(self) -> None:
        if self._accept_paused_until is not None and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self._server, selectors.EVENT_READ)

    def _expire_hellos(self) -> None:
        """Drop the connections whose hello is late: the whole hello's deadline, so that a trickle
        of bytes ends too."""
        now = time.monotonic()
        while self._greeting:
            peer = next(iter(self._greeting.values()))
            if peer.hello_by > now:
                return
            self._drop(peer)

    def _receive(self, peer: _Peer) -> None:
        try:
            chunk = peer.conn.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:  # the peer reset the connection
            chunk = b""
        if not chunk:
            self._drop(peer)
            return
        peer.buf += chunk
        try:
            while (line := peer.next_line()) is not None:
                if not self._take(peer, line):
                    self._drop(peer)
                    return
        except _LineTooLong:
            self._drop(peer)

    def _take(self, peer: _Peer, line: bytes) -> bool:
        """One line from `peer`: its hello, or a message of its rank. False when the connection
        is to be dropped (no valid hello)."""
        message = parse_message(line)
        if peer.rank is None:
            peer.rank = self._hello(peer.conn, message)
            self._greeting.pop(peer.conn, None)
            return peer.rank is not None
        if message is None:
            peer.ignored += 1
            if peer.ignored == 1:  # a rank's bug, not a reason to stop listening to it
                log.warning("supervisor: ignored a malformed heartbeat message from rank %d", peer.rank)
            return True
        self._update(self.ranks[peer.rank], message)
        return True

    def _drop(self, peer: _Peer) -> None:
        self._greeting.pop(peer.conn, None)
        self._selector.unregister(peer.conn)
        peer.conn.close()
        if peer.rank is not None:
            with self._lock:
                self.ranks[peer.rank].closed_at = time.time()
                if self._conns.get(peer.rank) is peer.conn:
                    del self._conns[peer.rank]
            self.changed.set()

    def _teardown(self) -> None:
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, _Peer):
                self._drop(key.data)
        self._selector.close()
        for sock in (self._server, self._wake_r, self._wake_w):
            sock.close()

    # ---------------------------------------------------------------- what the ranks said

    def _hello(self, conn: socket.socket, hello: dict[str, Any] | None) -> int | None:
        if hello is None or hello["type"] != "hello" or hello["token"] != self.token:
            return None
        rank = hello["rank"]
        if rank not in self.ranks:
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

    def request_dumps(self, timeout_s: float, silent_after_s: float = float("inf")) -> None:
        """Ask every connected rank for its stacks and flight recorder; wait up to `timeout_s` for
        those that still beat. A rank silent for `silent_after_s` (frozen, or its heartbeat
        thread starved) cannot answer: waiting for it would only delay the restart."""
        with self._lock:
            asked = dict(self._conns)
        for rank, conn in list(asked.items()):
            try:  # non-blocking: a rank whose socket buffer is full reads nothing and will not answer
                conn.sendall(b'{"type": "dump"}\n')
            except OSError:
                asked.pop(rank, None)
        start = time.monotonic()
        awaited = [r for r in asked if self.ranks[r].silent_s(start, start) < silent_after_s]
        while time.monotonic() < start + timeout_s and any(
                self.ranks[r].dump is None and self.ranks[r].closed_at is None for r in awaited):
            time.sleep(0.05)

    def close(self) -> None:
        """Stop serving; every rank's connection is closed (a rank then knows its supervisor is gone)."""
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the loop has already ended
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=_CLOSE_WAIT_S)

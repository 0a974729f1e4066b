"""The supervisor's side of the heartbeats: a TCP server it owns and the table of what each
rank last said (mshpc/launch/heartbeat.py and mshpc/launch/node_relay.py are the other side).

Two kinds of connection. A node's relay (the usual one) says a "node" hello, then speaks for
every rank of its node: their messages in "rank" envelopes, their beats batched in one "beats"
message per interval, a rank's end as "closed"; its own end ends every rank it spoke for (the
node is gone). A rank without a relay speaks for itself (hello, then its messages), as before.

Only JSON lines are read, and each must have the shape its type promises (`FIELDS`,
`BEAT_ENTRY`); nothing a peer sends can raise in the monitor. A connection whose first line is
not a hello carrying this attempt's token, within `HELLO_TIMEOUT_S`, is dropped: a straggling
rank of an earlier attempt cannot speak for the current one, and a port scanner or an idle peer
holds nothing for long. A relay of another protocol version is dropped with one warning.
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
from mshpc.phases import SETUP

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # a rank says hello as soon as it connects; anyone slower is not one
HELLO_MAX_BYTES = 64 * 1024  # a hello is a few hundred bytes
MESSAGE_MAX_BYTES = 256 * 2**20  # a dump (every stack, the whole flight recorder) is the largest
_RECV_BYTES = 64 * 1024
_ACCEPT_RETRY_S = 0.05  # after a failed accept (out of descriptors): idle peers are dropped soon
_CLOSE_WAIT_S = 5.0  # for the loop to close every connection
NODE_PROTOCOL = 1  # the relay's "node" hello carries it; a relay of another version is dropped


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
    phase: str = SETUP
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
    lost: dict[str, Any] | None = None  # its "lost" message: its loop raised, and it waits (recovery in place)
    # recovery in place: when (monotonic) it was told to rejoin, or replaced; until its "started",
    # its beats count as the set-up of the new generation from then, whatever phase they name
    rejoin_at: float | None = None
    generation: int = 0  # the generation of the attempt this rank is in (recoveries in place)

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
    "lost": {"t": _num, "error": _str, "message": _str, "phase": _str, "step": _int, "generation": _int},
    "dump": {"stacks": _str, "records": _records, "counts": _dict_of(_int)},
    # a node's relay (mshpc/launch/node_relay.py): its hello, then for the ranks of its node
    "node": {"token": _str, "v": _int, "host": _str, "pid": _optional(_int)},
    "rank": {"rank": _int, "msg": lambda v: isinstance(v, dict)},  # one rank's message, checked in turn
    "beats": {"beats": lambda v: isinstance(v, list)},  # entries: BEAT_ENTRY, each checked
    "closed": {"rank": _int, "t": _num},  # the rank's connection to its relay ended (wall time)
}
RANK_KINDS = ("hello", "started", "failed", "exit", "dump", "lost")  # what a "rank" envelope may carry
_RANK_SAYS = ("beat", *RANK_KINDS[1:])  # what a rank's own connection may carry after its hello
# One rank's beat in a "beats" batch: a beat's fields, its rank, and how long ago the relay got it
BEAT_ENTRY = {**FIELDS["beat"], "rank": _int, "age_s": _num}


def valid(message: Any, kinds: tuple[str, ...] | None = None) -> dict[str, Any] | None:
    """`message` if it is an object of a known type (one of `kinds` when given) with every field in shape."""
    if not isinstance(message, dict):
        return None
    kind = message.get("type")
    fields = FIELDS.get(kind) if isinstance(kind, str) and (kinds is None or kind in kinds) else None
    if fields is None or not all(check(message.get(key)) for key, check in fields.items()):
        return None
    return message


def parse_message(line: bytes) -> dict[str, Any] | None:
    """The message on `line` if it is a JSON object of a known type with every field in shape."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        return None
    return valid(message)


_NUMBER = (int, float)  # exact types, as JSON gives them: a bool is no number here either


def beat_entry(entry: Any) -> bool:
    """Whether `entry` passes BEAT_ENTRY, written out: the monitor checks 12,288 of these a
    second at full scale, and the generic checks (a call per field and value) were half its CPU
    (tests/unit/launch/test_monitor_nodes.py holds the two to the same answers)."""
    if type(entry) is not dict:
        return False
    get = entry.get
    medians, counts, last = get("medians"), get("counts"), get("last")
    return (type(get("rank")) is int and type(get("step")) is int and type(get("phase")) is str
            and type(get("phase_s")) in _NUMBER and type(get("age_s")) in _NUMBER
            and type(medians) is dict and all(type(k) is str and type(v) in _NUMBER for k, v in medians.items())
            and type(counts) is dict and all(type(k) is str and type(v) is int for k, v in counts.items())
            and (last is None or _record(last)))


class _Peer:
    """One connection, as the event loop sees it: the bytes read but not yet a whole line, and
    who its hello named: a rank, or a node (`host`) with the ranks it has spoken for (neither
    until then, when `hello_by` is its deadline)."""

    def __init__(self, conn: socket.socket, hello_by: float) -> None:
        self.conn, self.hello_by = conn, hello_by
        self.buf, self.scanned = bytearray(), 0
        self.rank: int | None = None
        self.host: str | None = None  # a node relay's
        self.node_ranks: set[int] = set()
        self.ignored = 0

    @property
    def greeted(self) -> bool:
        return self.rank is not None or self.host is not None

    def next_line(self) -> bytes | None:
        """The next whole line; None until one has arrived. _LineTooLong once the pending line
        outgrew its limit (a hello's, then a message's)."""
        limit = MESSAGE_MAX_BYTES if self.greeted else HELLO_MAX_BYTES
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
        self._replaced: set[int] = set()  # ranks whose replacement has not said hello yet
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
        """One line from `peer`: its hello, or a message of its rank or node. False when the
        connection is to be dropped (no valid hello)."""
        message = parse_message(line)
        if not peer.greeted:
            self._greeting.pop(peer.conn, None)
            if message is not None and message["type"] == "node":
                return self._node_hello(peer, message)
            peer.rank = self._hello(peer.conn, message)
            return peer.rank is not None
        if peer.host is not None:
            if message is None or not self._node_message(peer, message):
                self._ignored(peer)
            return True
        assert peer.rank is not None
        if message is None or message["type"] not in _RANK_SAYS:
            self._ignored(peer)
            return True
        self._update(self.ranks[peer.rank], message)
        return True

    def _ignored(self, peer: _Peer) -> None:
        peer.ignored += 1
        if peer.ignored == 1:  # a peer's bug, not a reason to stop listening to it
            who = f"node {peer.host}" if peer.host is not None else f"rank {peer.rank}"
            log.warning("supervisor: ignored a malformed heartbeat message from %s", who)

    def _node_hello(self, peer: _Peer, hello: dict[str, Any]) -> bool:
        if hello["token"] != self.token:
            return False
        if hello["v"] != NODE_PROTOCOL:
            log.warning("supervisor: dropped the relay of %s: node protocol %d, this supervisor speaks %d",
                        hello["host"], hello["v"], NODE_PROTOCOL)
            return False
        peer.host = hello["host"]
        return True

    def _node_message(self, peer: _Peer, message: dict[str, Any]) -> bool:
        """A node relay's message for its ranks; False when it is not in shape (nothing is taken
        from a batch with a bad entry: a relay's bug shows at once, not as one silent rank)."""
        kind = message["type"]
        if kind == "beats":
            entries = message["beats"]
            if not all(beat_entry(e) and e["rank"] in peer.node_ranks for e in entries):
                return False
            now = time.monotonic()
            with self._lock:
                for e in entries:  # when the rank beat, not when its relay passed it on
                    self._beat(self.ranks[e["rank"]], e, now - max(0.0, e["age_s"]))
            return True
        rank = message.get("rank")
        if kind == "closed" and rank in peer.node_ranks:
            self._rank_closed(rank, peer.conn, message["t"])
            return True
        inner = valid(message.get("msg"), RANK_KINDS) if kind == "rank" else None
        if inner is None:
            return False
        if inner["type"] == "hello":
            if inner["rank"] != rank or self._hello(peer.conn, inner) is None:
                return False
            peer.node_ranks.add(rank)
            return True
        if rank not in peer.node_ranks:
            return False
        self._update(self.ranks[rank], inner)
        return True

    def _drop(self, peer: _Peer) -> None:
        """Close `peer`; the ranks it spoke for end with it (a node's relay gone: the node is)."""
        self._greeting.pop(peer.conn, None)
        self._selector.unregister(peer.conn)
        peer.conn.close()
        now = time.time()
        for rank in peer.node_ranks if peer.host is not None else () if peer.rank is None else (peer.rank,):
            self._rank_closed(rank, peer.conn, now)

    def _rank_closed(self, rank: int, conn: socket.socket, at: float) -> None:
        with self._lock:
            if rank in self._replaced or self._conns.get(rank) not in (conn, None):
                return  # the connection of a rank replaced in place: its end is not the replacement's
            state = self.ranks[rank]
            if state.closed_at is None:
                state.closed_at = at
            if self._conns.get(rank) is conn:
                del self._conns[rank]
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
            self._replaced.discard(rank)
            state = self.ranks[rank]
            state.host, state.pid, state.coords = hello.get("host"), hello.get("pid"), hello.get("coords")
            state.last_beat_at = time.monotonic()
            self._conns[rank] = conn
        return rank

    @staticmethod
    def _beat(state: RankState, message: dict[str, Any], at: float) -> None:
        state.last_beat_at, state.phase, state.step = at, message["phase"], message["step"]
        state.phase_s, state.medians = message["phase_s"], message["medians"]
        state.counts, state.last = message["counts"], message["last"]
        if state.rejoin_at is not None:  # a beat of the old generation's phase is no hang of the new
            state.phase, state.phase_s = "setup", max(0.0, at - state.rejoin_at)

    def _update(self, state: RankState, message: dict[str, Any]) -> None:
        now = time.monotonic()
        with self._lock:
            kind = message.get("type")
            if kind == "beat":
                self._beat(state, message, now)
            elif kind == "started":
                state.start_step, state.rejoin_at = message["start_step"], None
            elif kind in ("failed", "exit"):
                state.outcome = message
                if message.get("start_step") is not None:
                    state.start_step = message["start_step"]
            elif kind == "dump":
                state.dump = message
            elif kind == "lost" and message["generation"] >= state.generation:  # not an earlier one's, late
                state.lost = message
        if kind != "beat":
            self.changed.set()

    # ---------------------------------------------------------------- recovery in place

    def replace(self, rank: int, generation: int) -> None:
        """Forget `rank`: a replacement takes its place in `generation`; the old process's
        connection ending, or its relay's, no longer counts against it."""
        now = time.monotonic()
        with self._lock:
            self.ranks[rank] = RankState(rank, last_beat_at=now, rejoin_at=now, generation=generation)
            self._conns.pop(rank, None)
            self._replaced.add(rank)

    def renew(self, ranks: list[int], generation: int) -> None:
        """Ranks that live on into `generation`: what they said of the last one is done, and they
        are in the new one's set-up from now on."""
        now = time.monotonic()
        with self._lock:
            for rank in ranks:
                state = self.ranks[rank]
                state.generation = generation
                state.outcome = state.lost = state.dump = state.start_step = None
                state.last_beat_at, state.rejoin_at, state.phase, state.phase_s = now, now, "setup", 0.0

    def send(self, lines: dict[int, str]) -> list[int]:
        """Each rank its message lines (JSON, newline-terminated), through its node's relay, which
        passes them to that rank: one write per connection, a node's ranks share theirs. Returns
        the ranks none reached (no connection, or one that is full or gone: such a rank times out
        and is stopped)."""
        by_conn: dict[socket.socket, list[str]] = {}
        missed = []
        with self._lock:
            for rank, text in lines.items():
                conn = self._conns.get(rank)
                if conn is None:
                    missed.append(rank)
                else:
                    by_conn.setdefault(conn, []).append(text)
        for conn, texts in by_conn.items():
            try:  # non-blocking: a full socket buffer drops them
                conn.sendall("".join(texts).encode())
            except OSError:
                missed += [r for r, text in lines.items() if text in texts]
        return missed

    def request_dumps(self, timeout_s: float, silent_after_s: float = float("inf")) -> None:
        """Ask every connected rank for its stacks and flight recorder; wait up to `timeout_s` for
        those that still beat. A rank silent for `silent_after_s` (frozen, or its heartbeat
        thread starved) cannot answer: waiting for it would only delay the restart."""
        with self._lock:
            asked = dict(self._conns)
        failed: set[socket.socket] = set()
        for conn in set(asked.values()):  # a node's relay passes the request on to each of its ranks
            try:  # non-blocking: a peer whose socket buffer is full reads nothing and will not answer
                conn.sendall(b'{"type": "dump"}\n')
            except OSError:
                failed.add(conn)
        asked = {r: c for r, c in asked.items() if c not in failed}
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

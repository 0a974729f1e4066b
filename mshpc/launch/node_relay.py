"""The node's relay: every rank of a node reports to it over a Unix socket, and it holds the one
connection of the node to the supervisor, as MegaScale's executors report per node (issue #20).

A rank speaks to its relay exactly as it would to the supervisor (mshpc/launch/heartbeat.py:
hello with the token, beats, "started", dumps on request, "failed"/"exit"). The relay passes on
at once what needs a decision (hellos, "started", last words, dumps, and a rank's connection
ending, as "closed" with the wall time), and batches the beats: one "beats" message per interval
with the latest beat of every rank that beat since the last one, each with its age, so the
supervisor dates a beat when the rank sent it and a silent rank stays exactly as silent. A
supervisor's dump request goes to every rank of the node. When the supervisor's connection ends
the relay closes every rank's connection (they stop, as they do when their own connection to the
supervisor ends) and exits; it also exits once every rank that connected is gone.

Why a process of its own, started by the node's lowest local rank in a new session, rather than
a thread of that rank: a thread dies with its rank's crash (and every other rank of the node
would look dead), and freezes with a SIGSTOP or a hang that holds the GIL (all 8 ranks would look
silent, and the hang report would name the whole node for one frozen rank). As a process it
outlives any one rank, so detection stays per rank; only the node itself failing (or the relay)
ends them all, which is what the node-down verdict means anyway. It ignores the stop signals
(Slurm signals every process of a step; the ranks' last words must still go through), and ends
when its ranks have all gone or the supervisor's connection ends; SIGKILL of the step ends it too.

    python -m mshpc.launch.node_relay --node NAME --interval-s S   (supervisor link from the environment)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from mshpc.launch.env import SupervisorLink, supervisor_link
from mshpc.launch.monitor import (
    HELLO_MAX_BYTES,
    HELLO_TIMEOUT_S,
    MESSAGE_MAX_BYTES,
    NODE_PROTOCOL,
    parse_message,
)
from mshpc.socket_peer import is_same_user, peer_uid

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # to the supervisor, as a rank's own connection allows
MAX_CONNECTIONS = 1024  # a node's ranks (8 or 16 GPUs, 100+ CPU ranks), with room for stale ones
# partial lines of every connection together: a few ranks' dumps at once, well below the memory
# a node has (a rank's own line may be MESSAGE_MAX_BYTES, a dump's bound)
TOTAL_BUFFER_BYTES = 2 * MESSAGE_MAX_BYTES


def socket_name(token: str, node: str) -> str:
    """The relay's Unix socket, in the abstract namespace (no file to leave behind, no stale one
    from an earlier attempt: the attempt's token is in the name)."""
    return "\0mshpc-relay-" + hashlib.sha1(f"{token}/{node}".encode()).hexdigest()[:32]


# ---------------------------------------------------------------- the node-level protocol (the monitor's FIELDS)


def node_hello(token: str, host: str, pid: int | None) -> dict[str, Any]:
    return {"type": "node", "v": NODE_PROTOCOL, "token": token, "host": host, "pid": pid}


def rank_envelope(rank: int, message: dict[str, Any]) -> dict[str, Any]:
    return {"type": "rank", "rank": rank, "msg": message}


def beat_entry(rank: int, beat: dict[str, Any], age_s: float) -> dict[str, Any]:
    entry = {k: v for k, v in beat.items() if k != "type"}
    entry.update(rank=rank, age_s=age_s)
    return entry


def beats_message(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "beats", "beats": entries}


def closed_message(rank: int, t: float) -> dict[str, Any]:
    return {"type": "closed", "rank": rank, "t": t}


def line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


# ---------------------------------------------------------------- the relay


class Relay:
    def __init__(self, link: SupervisorLink, node: str, interval_s: float) -> None:
        self.link, self.node, self.interval_s = link, node, interval_s
        self._ranks: dict[int, asyncio.Transport] = {}
        self._pending: dict[int, tuple[float, dict[str, Any]]] = {}  # rank -> (received at, its latest beat)
        self._seen = 0
        self._done = asyncio.Event()
        self._up: asyncio.StreamWriter | None = None
        self.connections: set[RankConnection] = set()
        self.buffered = 0  # bytes of partial lines held for every connection together

    async def run(self) -> int:
        """0 when done (or another relay serves the node), 1 when the supervisor is out of reach."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(socket_name(self.link.token, self.node))
        except OSError:  # another rank's relay took the name first
            listener.close()
            return 0
        try:
            reader, up = await asyncio.wait_for(
                asyncio.open_connection(self.link.host, self.link.port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:  # the ranks fall back to their own connections
            log.error("node relay on %s: cannot reach the supervisor at %s:%d (%s)", self.node, self.link.host,
                      self.link.port, exc)
            listener.close()
            return 1
        up.write(line(node_hello(self.link.token, self.node, os.getpid())))
        listener.listen(socket.SOMAXCONN)
        self._up = up  # last: a relay that has its link also listens (a rank connecting now is queued)
        server = await asyncio.get_running_loop().create_unix_server(lambda: RankConnection(self), sock=listener)
        tasks = [asyncio.ensure_future(c) for c in (self._from_supervisor(reader), self._flush_beats())]
        await self._done.wait()
        self._flush()
        for task in tasks:
            task.cancel()
        server.close()
        for connection in list(self.connections):
            connection.drop()
        with contextlib.suppress(OSError):
            await up.drain()
        up.close()
        return 0

    def _send(self, message: dict[str, Any]) -> None:
        if self._up is not None and not self._up.is_closing():
            self._up.write(line(message))

    def hello(self, message: dict[str, Any], transport: asyncio.Transport) -> int | None:
        """A connection's first line: the rank it speaks for, or None (not a rank of this attempt)."""
        if message["type"] != "hello" or not same_token(message["token"], self.link.token):
            return None
        rank: int = message["rank"]
        self._ranks[rank] = transport
        self._seen += 1
        self._send(rank_envelope(rank, message))
        return rank

    def rank_says(self, rank: int, message: dict[str, Any]) -> None:
        if message["type"] == "beat":
            self._pending[rank] = (time.monotonic(), message)
        else:  # what needs a decision goes now, after the rank's pending beat
            self._flush(rank)
            self._send(rank_envelope(rank, message))

    def rank_gone(self, rank: int, transport: asyncio.Transport) -> None:
        self._flush(rank)
        self._send(closed_message(rank, time.time()))
        if self._ranks.get(rank) is transport:
            del self._ranks[rank]
        if not self._ranks and self._seen:
            self._done.set()  # every rank that came is gone

    def _flush(self, only: int | None = None) -> None:
        """One "beats" message with the pending beats (of rank `only`, when given)."""
        ranks = list(self._pending) if only is None else [only] if only in self._pending else []
        if not ranks:
            return
        now = time.monotonic()
        entries = []
        for rank in ranks:
            at, beat = self._pending.pop(rank)
            entries.append(beat_entry(rank, beat, now - at))
        self._send(beats_message(entries))

    async def _flush_beats(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._flush()

    async def _from_supervisor(self, reader: asyncio.StreamReader) -> None:
        """Dump requests go to every rank, a rank's abort or rejoin to that rank; the end of the
        connection ends the relay."""
        try:
            while raw := await reader.readline():
                to = addressee(raw)
                for rank, transport in self._ranks.items():
                    if to == "all" or to == rank:
                        transport.write(raw)
        except (OSError, ValueError):
            pass
        self._done.set()


class RankConnection(asyncio.Protocol):
    """One connection to the relay's socket, whose name every user of the node can see. Before a
    byte is read its peer must be this user (SO_PEERCRED); then its hello, with the attempt's
    token, must come within HELLO_TIMEOUT_S and HELLO_MAX_BYTES. A rank's line may be as long as
    a dump (MESSAGE_MAX_BYTES), and all connections together hold at most TOTAL_BUFFER_BYTES of
    partial lines and MAX_CONNECTIONS connections: past any of these the connection is dropped,
    so no peer can grow the relay until the OOM killer ends it and its healthy node is blamed."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.rank: int | None = None
        self.buf = bytearray()
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if not is_same_user(sock):
            log.warning("node relay on %s: refused a connection from uid %d (not this job's user)",
                        self.relay.node, peer_uid(sock))
            transport.abort()
            return
        if len(self.relay.connections) >= MAX_CONNECTIONS:
            log.warning("node relay on %s: refused a connection past %d", self.relay.node, MAX_CONNECTIONS)
            transport.abort()
            return
        self.relay.connections.add(self)
        self._deadline = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self._late)

    def _late(self) -> None:
        if self.rank is None:
            self.drop()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.relay.buffered += len(data)
        while (end := self.buf.find(b"\n")) >= 0:
            raw = bytes(self.buf[:end])
            del self.buf[: end + 1]
            self.relay.buffered -= end + 1
            if not self._take(raw):
                self.drop()
                return
        limit = MESSAGE_MAX_BYTES if self.rank is not None else HELLO_MAX_BYTES
        if len(self.buf) > limit or self.relay.buffered > TOTAL_BUFFER_BYTES:
            self.drop()

    def _take(self, raw: bytes) -> bool:
        """One line; False when the connection is to be dropped (no valid hello first)."""
        message = parse_message(raw)
        if self.rank is None:
            assert self.transport is not None
            self.rank = self.relay.hello(message, self.transport) if message is not None else None
            return self.rank is not None
        if message is not None:  # the monitor would ignore a malformed one too
            self.relay.rank_says(self.rank, message)
        return True

    def drop(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self not in self.relay.connections:
            return  # refused in connection_made
        self.relay.connections.discard(self)
        self.relay.buffered -= len(self.buf)
        self.buf.clear()
        if self._deadline is not None:
            self._deadline.cancel()
        if self.rank is not None and self.transport is not None:
            self.relay.rank_gone(self.rank, self.transport)


def same_token(given: str, token: str) -> bool:
    """Whether a peer's `given` token is the attempt's, in constant time (any text a peer sends:
    compared as bytes, lone surrogates included)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass"))


def supervisor_message(raw: bytes) -> dict[str, Any] | None:
    """The supervisor's line `raw` as a mapping, or None when it is not one (never raises)."""
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def is_dump_request(raw: bytes) -> bool:
    """Whether the line `raw` is the supervisor's request for stacks and records."""
    message = supervisor_message(raw)
    return message is not None and message.get("type") == "dump"


def addressee(raw: bytes) -> int | str | None:
    """Whom a supervisor's line is for: "all" (a dump request), a rank (recovery in place: abort,
    rejoin), or None."""
    message = supervisor_message(raw)
    if message is None:
        return None
    if message.get("type") == "dump":
        return "all"
    rank = message.get("rank")
    return rank if message.get("type") in ("abort", "rejoin") and type(rank) is int else None


def start_relay(node: str, interval_s: float) -> subprocess.Popen[bytes]:
    """The relay of `node`, as a process of its own in its own session (a signal to the rank's
    process group, or the rank's death, does not reach it). Its stderr is not the rank's: a pipe
    held open by the relay would keep the launcher reading a dead rank's output."""
    return subprocess.Popen([sys.executable, "-m", "mshpc.launch.node_relay", "--node", node,
                             "--interval-s", str(interval_s)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


# What Slurm and the launchers send to ask ranks to stop: under Slurm every process of the step
# gets them (its cgroup is signalled), the relay too. It must outlive its ranks to pass on their
# last words (a checkpoint then "exit stopped"), and it ends when they have all gone.
IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mshpc.launch.node_relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--node", required=True, help="the node's name, as its ranks give it")
    parser.add_argument("--interval-s", type=float, required=True, help="how often the batched beats go")
    args = parser.parse_args(argv)
    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    link = supervisor_link()
    if link is None:
        print("mshpc node relay: MSHPC_SUPERVISOR is not set: no supervisor to relay to", file=sys.stderr)
        return 2
    return asyncio.run(Relay(link, args.node, args.interval_s).run())


if __name__ == "__main__":
    sys.exit(main())

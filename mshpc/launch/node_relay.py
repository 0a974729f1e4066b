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
from mshpc.launch.monitor import MESSAGE_MAX_BYTES, NODE_PROTOCOL, parse_message

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # to the supervisor, as a rank's own connection allows


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
        self._ranks: dict[int, asyncio.StreamWriter] = {}
        self._pending: dict[int, tuple[float, dict[str, Any]]] = {}  # rank -> (received at, its latest beat)
        self._seen = 0
        self._done = asyncio.Event()
        self._up: asyncio.StreamWriter | None = None

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
        self._up = up
        up.write(line(node_hello(self.link.token, self.node, os.getpid())))
        listener.listen(socket.SOMAXCONN)
        server = await asyncio.start_unix_server(self._serve_rank, sock=listener, limit=MESSAGE_MAX_BYTES)
        tasks = [asyncio.ensure_future(c) for c in (self._from_supervisor(reader), self._flush_beats())]
        await self._done.wait()
        self._flush()
        for task in tasks:
            task.cancel()
        server.close()
        for writer in list(self._ranks.values()):
            writer.close()
        with contextlib.suppress(OSError):
            await up.drain()
        up.close()
        return 0

    def _send(self, message: dict[str, Any]) -> None:
        if self._up is not None and not self._up.is_closing():
            self._up.write(line(message))

    async def _serve_rank(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank: int | None = None
        try:
            while raw := await reader.readline():
                message = parse_message(raw)
                if message is None:
                    continue  # the monitor would ignore it too
                if rank is None:
                    if message["type"] != "hello" or message["token"] != self.link.token:
                        return  # not a rank of this attempt
                    rank = message["rank"]
                    self._ranks[rank] = writer
                    self._seen += 1
                    self._send(rank_envelope(rank, message))
                elif message["type"] == "beat":
                    self._pending[rank] = (time.monotonic(), message)
                else:  # what needs a decision goes now, after the rank's pending beat
                    self._flush(rank)
                    self._send(rank_envelope(rank, message))
        except (OSError, ValueError, asyncio.LimitOverrunError):
            pass  # the rank's connection broke, or it sent a line past any message's size
        finally:
            writer.close()
            if rank is not None:
                self._flush(rank)
                self._send(closed_message(rank, time.time()))
                self._ranks.pop(rank, None)
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
        """Dump requests go to every rank; the end of the connection ends the relay."""
        try:
            while raw := await reader.readline():
                if _is_dump_request(raw):
                    for writer in self._ranks.values():
                        writer.write(raw)
        except (OSError, ValueError):
            pass
        self._done.set()


def _is_dump_request(raw: bytes) -> bool:
    try:
        message = json.loads(raw)
    except ValueError:
        return False
    return isinstance(message, dict) and message.get("type") == "dump"


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

"""The rank's side of supervision: a side thread that reports (rank, host, step, phase, time)
to the supervisor over a TCP socket the supervisor owns, never through a collective.

The train loop only calls `phase(name, step)`: a tuple assignment and a deque append, and once,
when the loop leaves its setup, one message with the step it resumed from (the supervisor's story
must not wait for a beat to carry it); leaving set-up or a long phase (a save, validation, the
compiled first step), a beat at once (a rank frozen just after must not look still in it). The
thread does the rest every `heartbeat_interval_s`: per-phase median durations (the supervisor's
timeouts are calibrated from them), the flight recorder's per-group counts and last record, and
on request a dump of every thread's Python stack (faulthandler) and the whole flight recorder.
Messages are JSON lines; nothing received is executed. The connection goes to the node's relay
(mshpc/launch/node_relay.py) over a Unix socket when there is one (the node's lowest local rank
starts it), which batches the node's beats into one connection to the supervisor; a rank that
cannot reach its relay within `RELAY_WAIT_S` connects to the supervisor itself. When the
supervisor's end of the connection closes while the rank trains (the supervisor was killed, or
its node lost), nobody will stop or restart the rank: it stops itself, after a checkpoint at the
next step boundary if that comes within the stop grace, else at once.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import logging
import os
import select
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from mshpc.config import ParallelConfig, SupervisorConfig
from mshpc.errors import MshpcError
from mshpc.launch.env import SupervisorLink
from mshpc.launch.node_relay import socket_name, start_relay, supervisor_message
from mshpc.launch.requeue import STOP_REQUEST_SIGNAL
from mshpc.loss_check import LossDiverged
from mshpc.mesh_shape import MeshShape
from mshpc.parallel.comm import RECORDER
from mshpc.phases import CHECKPOINT, COMPILE, DATA, EVAL, LONG, SETUP, STEP
from mshpc.save_schedule import SaveSchedule
from mshpc.socket_peer import is_same_user, peer_uid

log = logging.getLogger(__name__)

PHASES = (SETUP, DATA, STEP, COMPILE, EVAL, CHECKPOINT)  # what the loop reports (mshpc/phases.py)
MIN_SAMPLES = 3  # a phase's median means something after this many
_WINDOW = 64  # recent durations kept per phase
ORPHAN_EXIT = 1  # a rank that outlived its supervisor and could not stop in order
RELAY_WAIT_S = 10.0  # for the node's relay to listen (a Python start on a loaded node), then go direct
_RELAY_RETRY_S = 0.05
MAX_REQUEST_BYTES = 64 * 1024  # what the rank buffers of the supervisor's requests (a dump request is 17 bytes)


@dataclass(frozen=True)
class RelayPlan:
    """This rank's node relay: its node's name, and whether this rank starts it."""

    node: str
    start: bool
    wait_s: float = RELAY_WAIT_S


class Heartbeat:
    """One per rank. Without a supervisor (`link` None) it only records the phases. With
    `orphan_grace_s`, a rank whose supervisor is gone stops itself (STOP_REQUEST_SIGNAL, which the
    train loop's watcher handles) and exits after that many seconds if it has not stopped."""

    def __init__(self, link: SupervisorLink | None, hello: dict[str, Any], interval_s: float,
                 schedule: SaveSchedule, orphan_grace_s: float | None = None, relay: RelayPlan | None = None) -> None:
        self.link, self.hello, self.interval_s, self.schedule = link, hello, interval_s, schedule
        self.orphan_grace_s, self.relay = orphan_grace_s, relay
        self._current = (SETUP, -1, time.monotonic())  # (phase, step, entered at)
        self._start_step: int | None = None
        self._durations: dict[str, collections.deque[float]] = {p: collections.deque(maxlen=_WINDOW) for p in PHASES}
        self._sock: socket.socket | None = None
        self._connected = False  # once: a supervisor that never answered is not one that went away
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        # recovery in place: the supervisor's word for the next generation, and what aborts this
        # process's communicators when it says so (a NCCL collective waits for no dead peer's socket)
        self._rejoin: dict[str, Any] | None = None
        self._rejoined = threading.Event()
        self.on_abort: Callable[[], None] = lambda: None
        self.generation = link.generation if link is not None else 0
        self._thread = threading.Thread(target=self._run, name="mshpc-heartbeat", daemon=True)

    # ---------------------------------------------------------------- the train loop's side

    def phase(self, name: str, step: int) -> None:
        """Enter phase `name` of step `step` (0-based). The checkpoint phase begins only on steps
        that save (a long save is no hang); on the others the step phase goes on to the next
        data phase."""
        if name == CHECKPOINT and not self.schedule.due(step + 1):
            return  # no save after this step: its tail (metrics, the stop check) counts as the step
        now = time.monotonic()
        previous, _, since = self._current
        if previous == SETUP:
            self._start_step = step  # where this attempt resumed: told at once, not in the next beat
            self._send({"type": "started", "start_step": step})
        self._durations[previous].append(now - since)
        self._current = (name, step, now)
        if (previous == SETUP or previous in LONG) and name != SETUP and name not in LONG:
            # told now, not at the next beat: the supervisor leaves a rank silent in set-up or a long
            # phase to that phase's timeout, and a rank frozen right after a save must not look in it
            self._send(self._beat())

    # ---------------------------------------------------------------- recovery in place

    def lost(self, exc: BaseException) -> None:
        """This rank's loop raised (its peers' failure, usually) and it lives on, waiting for the
        supervisor's word to rejoin in a new generation."""
        self._send({"type": "lost", "t": time.time(), "error": type(exc).__name__,
                    "message": str(exc).splitlines()[0] if str(exc) else "", "phase": self._current[0],
                    "step": self._current[1], "generation": self.generation})

    def await_rejoin(self, timeout_s: float) -> dict[str, Any] | None:
        """The supervisor's rejoin message (it may have come before the loop raised), or None
        when none comes within `timeout_s` (or there is no supervisor). Consumed once read."""
        if self.link is None or not self._rejoined.wait(timeout_s):
            return None
        message, self._rejoin = self._rejoin, None
        self._rejoined.clear()
        if message is not None:
            self.generation = int(message["generation"])
        return message

    def restart(self) -> None:
        """A new generation starts: setup again, and its "started" is sent again when it ends."""
        self._current, self._start_step = ("setup", -1, time.monotonic()), None

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> Heartbeat:
        if self.link is not None:
            self._connect()
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._send(self._last_words(exc))
        self._stop.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's select; what was sent still arrives
            except OSError:
                pass
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if sock is not None:
            sock.close()

    def _last_words(self, exc: BaseException | None) -> dict[str, Any]:
        """The exit or failed message, with the start step again (its only carrier when the
        loop never ran)."""
        start = self._start_step
        if start is None and exc is None:
            start = self.schedule.last_step  # the loop never ran: it resumed at the last step
        if exc is None:
            return {"type": "exit", "how": "ok", "start_step": start}
        if isinstance(exc, SystemExit):  # JobStopped: a checkpoint, then a requested stop
            return {"type": "exit", "how": "stopped", "code": exc.code, "start_step": start}
        return {"type": "failed", "t": time.time(), "error": type(exc).__name__,
                "message": str(exc).splitlines()[0] if str(exc) else "", "user_error": isinstance(exc, MshpcError),
                "loss_diverged": isinstance(exc, LossDiverged), "phase": self._current[0], "step": self._current[1],
                "start_step": start}

    def _connect(self) -> None:
        assert self.link is not None
        self._sock = self._connect_relay() if self.relay is not None else None
        if self._sock is None:
            try:
                self._sock = socket.create_connection((self.link.host, self.link.port), timeout=30)
            except OSError as exc:  # training goes on unsupervised rather than not at all
                log.error("cannot reach the supervisor at %s:%d (%s): no heartbeats", self.link.host, self.link.port, exc)
                return
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._connected = True
        self._send({"type": "hello", "token": self.link.token, "pid": os.getpid(), **self.hello})

    def _connect_relay(self) -> socket.socket | None:
        """The node relay's Unix socket (started here if this rank is the node's first), or None
        when it does not listen within the wait: the rank then reports directly."""
        assert self.link is not None and self.relay is not None
        name = socket_name(self.link.token, self.relay.node)
        relay = start_relay(self.relay.node, self.interval_s) if self.relay.start else None
        deadline = time.monotonic() + self.relay.wait_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(name)
                if is_same_user(sock):
                    return sock
                # the name is in every user's view (/proc/net/unix): a relay of another user is none
                log.warning("the heartbeat relay socket of node %s is served by uid %d, not this job's user: this "
                            "rank reports to the supervisor directly", self.relay.node, peer_uid(sock))
                sock.close()
                return None
            except OSError:
                sock.close()
            code = relay.poll() if relay is not None else None
            if code or time.monotonic() > deadline:  # the relay failed (out of reach of the supervisor), or none came
                (log.info if self.relay.wait_s == 0 else log.warning)("no heartbeat relay on node %s (%s): this rank reports to the supervisor directly",
                            self.relay.node, f"it exited with code {code}" if code else
                            f"none listened within {self.relay.wait_s:g} s")
                return None
            time.sleep(_RELAY_RETRY_S)

    def _send(self, message: dict[str, Any]) -> None:
        sock = self._sock  # once: the train loop's thread sends too, and either may drop it
        if sock is None:
            return
        data = (json.dumps(message) + "\n").encode()
        try:
            with self._send_lock:
                sock.sendall(data)
        except OSError:
            self._sock = None  # the supervisor is gone; it will stop us if it comes to that

    # ---------------------------------------------------------------- the side thread

    def _run(self) -> None:
        self._listen()
        if self._connected and not self._stop.is_set():  # it ended while the rank goes on, not by its exit
            self._orphaned()

    def _listen(self) -> None:
        """Beat every interval and answer dump requests until the rank exits or the connection ends."""
        buffered = b""
        while not self._stop.is_set() and (sock := self._sock) is not None:  # the loop's thread may drop it
            self._send(self._beat())
            try:
                ready, _, _ = select.select([sock], [], [], self.interval_s)
                if ready:
                    chunk = sock.recv(4096)
                    if not chunk:
                        return
                    buffered += chunk
            except (OSError, ValueError):
                return
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                message = supervisor_message(line)
                if message is not None:
                    self._command(message)
            if len(buffered) > MAX_REQUEST_BYTES:  # no request is this long: not a supervisor's
                return

    def _command(self, message: dict[str, Any]) -> None:
        """A supervisor's request: a dump; and, addressed to this rank, an abort or a rejoin."""
        kind = message.get("type")
        if kind == "dump":
            self._send(self._dump())
        elif message.get("rank") != self.hello["rank"]:
            return  # a node's relay passes every rank's on to all of its ranks
        elif kind == "abort":
            self.on_abort()
        elif kind == "rejoin":
            self._rejoin = message
            self._rejoined.set()

    def _orphaned(self) -> None:
        """The supervisor is gone: stop as on its stop request (every rank sees its connection
        close and they agree on a step boundary), bounded by the grace; nobody else will stop us."""
        assert self.link is not None
        where = f"{self.link.host}:{self.link.port}"
        if self.orphan_grace_s is None:
            log.error("the supervisor at %s is gone (its heartbeat connection closed)", where)
            return
        log.error("the supervisor at %s is gone (its heartbeat connection closed): stopping after a checkpoint "
                  "at the next step, or in %g s without one", where, self.orphan_grace_s)
        os.kill(os.getpid(), STOP_REQUEST_SIGNAL)  # the main thread's handler sets the stop flag
        if self._stop.wait(self.orphan_grace_s):
            return
        log.error("the supervisor is gone and this rank did not stop within %g s: exiting without a checkpoint",
                  self.orphan_grace_s)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(ORPHAN_EXIT)  # the main thread may be blocked in a collective whose peer is gone

    def _beat(self) -> dict[str, Any]:
        phase, step, since = self._current
        medians = {p: statistics.median(d) for p, d in self._durations.items() if len(d) >= MIN_SAMPLES}
        records = RECORDER.snapshot()
        last = records[-1] if records else None
        return {"type": "beat", "phase": phase, "step": step, "phase_s": time.monotonic() - since,
                "medians": medians, "counts": RECORDER.counts(),
                "last": None if last is None else [last.seq, last.group, last.op, last.nbytes]}

    def _dump(self) -> dict[str, Any]:
        """Every thread's Python stack and the whole flight recorder, for the hang report."""
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            stacks = f.read()
        records = [[r.seq, r.group, r.op, r.nbytes] for r in RECORDER.snapshot()]
        return {"type": "dump", "stacks": stacks, "records": records, "counts": RECORDER.counts()}


def start_heartbeat(link: SupervisorLink | None, rank: int, node: str, *, parallel: ParallelConfig,
                    supervisor: SupervisorConfig, saves: SaveSchedule) -> Heartbeat:
    """The heartbeat of `rank` (use it as a context manager); it talks only when `link` is set.
    `saves` says which steps end in a save (their phase is timed as a save, not a hang)."""
    shape = MeshShape(pp=parallel.pp, dp=parallel.dp, tp=parallel.tp)
    hello = {"rank": rank, "host": node, "coords": str(shape.coords(rank))}
    relay = RelayPlan(node, link.starts_relay) if link is not None and supervisor.node_relay else None
    if relay is not None and link is not None and link.replacement:
        # its node's relay, if its other ranks kept it, else the supervisor directly: a relay
        # started now would add a process start to the recovery
        relay = RelayPlan(node, start=False, wait_s=0.0)
    return Heartbeat(link, hello, supervisor.heartbeat_interval_s, saves,
                     orphan_grace_s=supervisor.stop_grace_s, relay=relay)

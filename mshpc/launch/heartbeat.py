"""The rank's side of supervision: a side thread that reports (rank, host, step, phase, time)
to the supervisor over a TCP socket the supervisor owns, never through a collective.

The train loop only calls `phase(name, step)`: a tuple assignment and a deque append. The
thread does the rest every `heartbeat_interval_s`: per-phase median durations (the supervisor's
timeouts are calibrated from them), the flight recorder's per-group counts and last record, and
on request a dump of every thread's Python stack (faulthandler) and the whole flight recorder.
Messages are JSON lines; nothing received is executed.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import logging
import math
import os
import select
import socket
import statistics
import tempfile
import threading
import time
from types import TracebackType
from typing import Any

from mshpc.config import Config
from mshpc.errors import MshpcError
from mshpc.launch.env import SupervisorLink
from mshpc.parallel.comm import RECORDER
from mshpc.parallel.mesh import MeshShape

log = logging.getLogger(__name__)

PHASES = ("setup", "data", "step", "checkpoint")
MIN_SAMPLES = 3  # a phase's median means something after this many
_WINDOW = 64  # recent durations kept per phase


class LossDiverged(RuntimeError):
    """The global loss is NaN/Inf or above supervisor.loss_limit: raised on every rank alike
    (the loss is all-reduced), before the step can be checkpointed."""


class Heartbeat:
    """One per rank. Without a supervisor (`link` None) it only checks the loss."""

    def __init__(self, link: SupervisorLink | None, hello: dict[str, Any], interval_s: float,
                 loss_limit: float | None, save_every: int = 0, steps: int = 0) -> None:
        self.link, self.hello, self.interval_s, self.loss_limit = link, hello, interval_s, loss_limit
        self.save_every, self.steps = save_every, steps  # which steps end in a checkpoint save
        self._current = ("setup", -1, time.monotonic())  # (phase, step, entered at)
        self._start_step: int | None = None
        self._durations = {p: collections.deque(maxlen=_WINDOW) for p in PHASES}
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mshpc-heartbeat", daemon=True)

    # ---------------------------------------------------------------- the train loop's side

    def phase(self, name: str, step: int, loss: float | None = None) -> None:
        """Enter phase `name` of step `step` (0-based); with `loss`, check it first. The
        checkpoint phase begins only on steps that save (a long save is no hang); on the others
        the step phase goes on to the next data phase."""
        if loss is not None and (not math.isfinite(loss) or (self.loss_limit is not None and loss > self.loss_limit)):
            raise LossDiverged(f"loss {loss} at step {step + 1} (NaN/Inf, or above supervisor.loss_limit="
                               f"{self.loss_limit})")
        if name == "checkpoint" and not self._saves(step):
            return  # no save after this step: its tail (metrics, the stop check) counts as the step
        now = time.monotonic()
        previous, _, since = self._current
        if previous == "setup":
            self._start_step = step  # where this attempt resumed
        self._durations[previous].append(now - since)
        self._current = (name, step, now)

    def _saves(self, step: int) -> bool:
        done = step + 1
        return self.save_every > 0 and (done % self.save_every == 0 or done == self.steps)

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> Heartbeat:
        if self.link is not None:
            self._connect()
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            self._send({"type": "exit", "how": "ok"})
        elif isinstance(exc, SystemExit):  # JobStopped: a checkpoint, then a requested stop
            self._send({"type": "exit", "how": "stopped", "code": exc.code})
        else:
            self._send({"type": "failed", "t": time.time(), "error": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else "",
                        "user_error": isinstance(exc, MshpcError), "loss_diverged": isinstance(exc, LossDiverged),
                        "phase": self._current[0], "step": self._current[1]})
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

    def _connect(self) -> None:
        assert self.link is not None
        try:
            self._sock = socket.create_connection((self.link.host, self.link.port), timeout=30)
        except OSError as exc:  # training goes on unsupervised rather than not at all
            log.error("cannot reach the supervisor at %s:%d (%s): no heartbeats", self.link.host, self.link.port, exc)
            return
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send({"type": "hello", "token": self.link.token, "pid": os.getpid(), **self.hello})

    def _send(self, message: dict[str, Any]) -> None:
        if self._sock is None:
            return
        data = (json.dumps(message) + "\n").encode()
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError:
            self._sock = None  # the supervisor is gone; it will stop us if it comes to that

    # ---------------------------------------------------------------- the side thread

    def _run(self) -> None:
        buffered = b""
        while not self._stop.is_set() and self._sock is not None:
            self._send(self._beat())
            try:
                ready, _, _ = select.select([self._sock], [], [], self.interval_s)
                if ready:
                    chunk = self._sock.recv(4096)
                    if not chunk:
                        return
                    buffered += chunk
            except (OSError, ValueError):
                return
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                if json.loads(line).get("type") == "dump":
                    self._send(self._dump())

    def _beat(self) -> dict[str, Any]:
        phase, step, since = self._current
        medians = {p: statistics.median(d) for p, d in self._durations.items() if len(d) >= MIN_SAMPLES}
        records = RECORDER.snapshot()
        last = records[-1] if records else None
        return {"type": "beat", "phase": phase, "step": step, "start_step": self._start_step, "phase_s": time.monotonic() - since,
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


def start_heartbeat(cfg: Config, link: SupervisorLink | None, rank: int, node: str) -> Heartbeat:
    """The heartbeat of `rank` (use it as a context manager); it talks only when `link` is set."""
    shape = MeshShape(pp=cfg.parallel.pp, dp=cfg.parallel.dp, tp=cfg.parallel.tp)
    hello = {"rank": rank, "host": node, "coords": str(shape.coords(rank))}
    return Heartbeat(link, hello, cfg.supervisor.heartbeat_interval_s, cfg.supervisor.loss_limit,
                     cfg.checkpoint.interval_steps, cfg.train.steps)

"""The logger interface and the fan-out the train loop writes its rows to (rank 0 only).

Each logger takes the same rows (a dict with "step" and numbers: loss, lr, grad norm, tokens/s,
MFU, validation, checkpoint times) and the run's events (stragglers, failures, restarts), which
are read from events.jsonl, whoever wrote them, and handed on once each: the byte offset already
handed on is kept in `.logged-events`, so an attempt after a restart hands on the failure and
restart events the supervisor wrote between attempts, and nothing twice.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from mshpc.config import Config
from mshpc.errors import writing_to
from mshpc.events import EVENTS_FILE
from mshpc.run_dir import MetricsLog

log = logging.getLogger(__name__)

OFFSET_FILE = ".logged-events"


class Logger(Protocol):
    def write(self, row: dict[str, Any]) -> None:
        """One row of numbers (None: not measured) for row["step"]."""
        ...

    def event(self, record: dict[str, Any], step: int) -> None:
        """One events.jsonl record, shown at `step` (the last step logged)."""
        ...

    def close(self) -> None:
        ...


class EventTail:
    """The events.jsonl records appended since the last `new()` (of any attempt of the run)."""

    def __init__(self, run_dir: Path) -> None:
        self.path, self.offset_path = run_dir / EVENTS_FILE, run_dir / OFFSET_FILE
        try:
            self.offset = int(self.offset_path.read_text())
        except (OSError, ValueError):
            self.offset = 0

    def new(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # a new events file: start over
            self.offset = 0
        if size == self.offset:
            return []  # the common case, once per logged step: one stat
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        records = []
        for line in whole.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # torn by a crash
        self.offset += len(whole)
        with writing_to(self.offset_path):
            self.offset_path.write_text(str(self.offset))
        return records


def lower_thread_priority(increment: int) -> None:
    """Raise the calling thread's nice value by `increment` (Linux nice values are per thread and
    inherited by the threads and processes it starts); elsewhere nothing."""
    if increment == 0 or sys.platform != "linux":
        return  # there, PRIO_PROCESS with a thread id would renice the whole process or fail
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))


class BackgroundLogger:
    """Builds a logger on a side thread and runs its writes there, in order: a TensorBoard row
    (protobufs) or a W&B row (a message to its service process) costs milliseconds, which the step
    must not wait for. The thread runs `nice_increment` lower (what the logger starts inherits
    it): a row can wait, a step cannot. An error while building is raised here; one while
    writing, by the next call on the loop's thread."""

    def __init__(self, build: Callable[[], Logger], name: str, nice_increment: int = 0) -> None:
        self.name = name
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._built = threading.Event()  # set once built, or failed to
        self._thread = threading.Thread(target=self._run, args=(build, nice_increment), name=f"mshpc-{name}", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._error is not None:
            self._thread.join()
            self._raise()

    def _run(self, build: Callable[[], Logger], nice_increment: int) -> None:
        try:
            lower_thread_priority(nice_increment)
            self.logger = build()  # here, so that what it starts inherits the lowered priority
        except BaseException as exc:  # raised by the constructor, on the loop's thread
            self._error = exc
            return
        finally:
            self._built.set()
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    getattr(self.logger, item[0])(*item[1])
                except BaseException as exc:  # handed to the loop's thread, raised there
                    self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def write(self, row: dict[str, Any]) -> None:
        self._raise()
        self._queue.put(("write", (row,)))

    def event(self, record: dict[str, Any], step: int) -> None:
        self._raise()
        self._queue.put(("event", (record, step)))

    def close(self) -> None:
        self._queue.put(("close", ()))
        self._queue.put(None)
        self._thread.join()  # a W&B run finishes here: its last rows reach the disk
        self._raise()


class Loggers:
    """Every configured logger; metrics.jsonl first. Events go to the loggers after jsonl (whose
    events are events.jsonl itself)."""

    def __init__(self, jsonl: MetricsLog, others: list[Logger], events: EventTail | None) -> None:
        self.jsonl, self.others, self.events = jsonl, others, events
        self.step = 0

    def write(self, row: dict[str, Any]) -> None:
        self.step = row["step"]
        self.jsonl.write(row)
        for logger in self.others:
            logger.write(row)
        self.forward_events()

    def forward_events(self) -> None:
        if self.events is None:
            return
        for record in self.events.new():
            for logger in self.others:
                logger.event(record, self.step)

    def close(self) -> None:
        try:
            self.forward_events()  # what happened in the last steps (a straggler, a stop request)
            for logger in self.others:
                logger.close()
        finally:
            self.jsonl.close()


def build_loggers(cfg: Config, run_dir: Path, jsonl: MetricsLog, start_step: int) -> Loggers:
    """Start the loggers `run.loggers` names beside `jsonl`; one that cannot start (its package
    missing, its folder unwritable) raises a one-line MshpcError with the fix."""
    others: list[Logger] = []
    nice = cfg.run.logger_nice_increment
    try:  # nothing half-started is left open: the loggers started so far, and metrics.jsonl

        for name in cfg.run.loggers:
            if name == "tensorboard":
                from mshpc.loggers.tensorboard_log import TensorBoardLogger

                others.append(BackgroundLogger(functools.partial(TensorBoardLogger, run_dir / "tb"), name, nice))
            elif name == "wandb":
                from mshpc.loggers.wandb_log import WandbLogger

                others.append(BackgroundLogger(functools.partial(WandbLogger, cfg, run_dir, start_step), name, nice))
    except BaseException:
        for logger in others:
            logger.close()
        jsonl.close()
        raise
    if others:
        log.info("loggers: %s", ", ".join(cfg.run.loggers))
    return Loggers(jsonl, others, EventTail(run_dir) if others else None)


def describe(record: dict[str, Any]) -> str:
    """An event as one line of text: its kind, then its fields."""
    fields = {k: v for k, v in record.items() if k not in ("kind", "time")}
    return f"{record.get('kind', '?')}: {json.dumps(fields, default=str)}"

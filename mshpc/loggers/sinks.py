"""The logger interface and the fan-out the train loop writes its rows to (rank 0 only).

Each logger takes the same rows (a dict with "step" and numbers: loss, lr, grad norm, tokens/s,
MFU, validation, checkpoint times) and the run's events (stragglers, failures, restarts), which
are read from events.jsonl, whoever wrote them, and handed on once each: the byte offset already
handed on is kept in `.logged-events`, so an attempt after a restart hands on the failure and
restart events the supervisor wrote between attempts, and nothing twice.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from mshpc.config import RunConfig
from mshpc.errors import writing_to
from mshpc.events import EVENTS_FILE
from mshpc.full_disk import FullSince
from mshpc.regular_files import open_regular, read_regular, write_own
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
        self._full = FullSince(str(self.offset_path))
        try:
            self.offset = int(read_regular(self.offset_path, 64))
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
        fd = open_regular(self.path)
        try:
            data = os.pread(fd, size - self.offset, self.offset)
        finally:
            os.close(fd)
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        records = []
        for line in whole.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # torn by a crash
        self.offset += len(whole)
        with writing_to(self.offset_path):
            try:
                write_own(self.offset_path, str(self.offset))
            except OSError as exc:  # a full disk under recovery.in_place: the next call writes it
                self._full.refused(exc)
            else:
                self._full.cleared()
        return records


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


def build_loggers(run_dir: Path, jsonl: MetricsLog, start_step: int, *, run: RunConfig,
                  config_record: dict[str, Any]) -> Loggers:
    """Start the loggers `run.loggers` names beside `jsonl`, in their own process
    (`logger_process.py`); one that cannot start (its package missing, its folder unwritable)
    raises a one-line MshpcError with the fix. `config_record`: the resolved config as plain
    data, which W&B records with the run."""
    if set(run.loggers) == {"jsonl"}:
        return Loggers(jsonl, [], None)
    from mshpc.loggers.logger_process import start_logger_process

    try:
        others: list[Logger] = [start_logger_process(run_dir, start_step, run=run, config_record=config_record)]
    except BaseException:
        jsonl.close()  # nothing half-started is left open
        raise
    log.info("loggers: %s (in a process of their own)", ", ".join(run.loggers))
    return Loggers(jsonl, others, EventTail(run_dir))


def describe(record: dict[str, Any]) -> str:
    """An event as one line of text: its kind, then its fields."""
    fields = {k: v for k, v in record.items() if k not in ("kind", "time")}
    return f"{record.get('kind', '?')}: {json.dumps(fields, default=str)}"

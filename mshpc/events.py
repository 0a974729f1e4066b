"""events.jsonl: the run's story (start, failure, detection, restart, eviction, straggler, MFU
decline), one JSON object per line, appended by whichever process saw the event.

Each record is one write() of one line to a file opened O_APPEND, so lines from several
processes (the supervisor, ranks, `mshpc diagnose`) never interleave mid-line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from mshpc.errors import writing_to
from mshpc.full_disk import append_line_shared
from mshpc.regular_files import open_regular, read_text_lines

EVENTS_FILE = "events.jsonl"


def append_event(run_dir: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event `{"time": unix seconds, "kind": kind, **fields}` and return it."""
    record = {"time": time.time(), "kind": kind, **fields}
    line = (json.dumps(record, allow_nan=False, default=str) + "\n").encode()
    path = run_dir / EVENTS_FILE
    with writing_to(path):  # a full disk is the site's, not the node's: one line, exit 2
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = open_for_append(path)
        try:
            append_line_shared(fd, line, str(path))  # held a moment if the disk is full (recovery.in_place)
        finally:
            os.close(fd)
    return record


def open_for_append(path: Path) -> int:
    """An O_APPEND descriptor of `path`, after ending a last line that a crash or a full disk
    tore, so that the next record starts a line of its own instead of joining the torn one (and
    being lost with it to every reader). Two processes that both end it leave an empty line,
    which readers skip like a torn one."""
    fd = open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644, own=True)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            append_line_shared(fd, b"\n", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every whole event in order; a line torn by a crash mid-write is skipped."""
    return read_jsonl(run_dir / EVENTS_FILE)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON line of a file mshpc appends to (none if it is missing); a line torn by
    a crash mid-write is skipped."""
    records = []
    for line in read_text_lines(path):
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records

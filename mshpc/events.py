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

EVENTS_FILE = "events.jsonl"


def append_event(run_dir: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event `{"time": unix seconds, "kind": kind, **fields}` and return it."""
    record = {"time": time.time(), "kind": kind, **fields}
    line = (json.dumps(record, allow_nan=False, default=str) + "\n").encode()
    path = run_dir / EVENTS_FILE
    with writing_to(path):  # a full disk is the site's, not the node's: one line, exit 2
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    return record


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every whole event in order; a line torn by a crash mid-write is skipped."""
    return read_jsonl(run_dir / EVENTS_FILE)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON line of a file mshpc appends to (none if it is missing); a line torn by
    a crash mid-write is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records

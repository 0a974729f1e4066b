"""The run directory: resolved config and per-step metrics, written by rank 0."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from mshpc.config import RunConfig
from mshpc.errors import RunEnvironmentError, writing_to
from mshpc.events import open_for_append, read_jsonl
from mshpc.full_disk import HeldAppend
from mshpc.regular_files import write_own

METRICS_FILE = "metrics.jsonl"
ATTEMPT_KEY = "attempt"  # a marker line's key: {"attempt": n, "start_step": s, "time": t}


def run_path(run: RunConfig) -> Path:
    """<run.out_dir>/<run.name>: where a run's files go."""
    return Path(run.out_dir) / run.name


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/Inf; a diverged loss must still be recorded, as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl's final history: each attempt's marker drops the rows of the
    steps after its start (trained again, or by an earlier run of the same name), so a step's
    row is the one of the attempt whose weights went on. Torn lines are skipped."""
    rows: list[dict[str, Any]] = []
    for record in read_jsonl(path):
        if ATTEMPT_KEY in record:
            rows = [r for r in rows if r.get("step", 0) <= record.get("start_step", 0)]
        elif "step" in record:
            rows.append(record)
    return rows


def read_attempts(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's attempt markers, in order."""
    return [r for r in read_jsonl(path) if ATTEMPT_KEY in r]


class MetricsLog:
    """Appends one JSON object per logged step to metrics.jsonl, written at once so that a
    crash loses nothing already logged. Nothing is ever truncated: each attempt (a restart, a
    resume, a new run of the same name) first appends its marker, which `read_metrics` reads
    the final history by. A full disk is a RunEnvironmentError naming the file (under
    recovery.in_place, after its grace: mshpc/full_disk.py)."""

    def __init__(self, path: Path, start_step: int) -> None:
        self.path, self._failed = path, False
        with writing_to(path):  # a planted link or another user's file: one line, read or written
            self.attempt = len(read_attempts(path)) + 1
            marker = {ATTEMPT_KEY: self.attempt, "start_step": start_step, "time": time.time()}
            # O_APPEND through open_regular: never through a planted link, never another user's file
            self._file = HeldAppend(open_for_append(path), str(path))  # a torn last line ended first
            self._file.write((json.dumps(marker) + "\n").encode())

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n"
        try:
            with writing_to(self.path):
                self._file.write(line.encode())
        except (OSError, RunEnvironmentError):
            self._failed = True
            raise

    def close(self) -> None:
        if self._failed:  # what is held fails again: said once, by write()
            with contextlib.suppress(OSError):
                os.close(self._file.fd)
            return
        with writing_to(self.path):
            self._file.close()


def create_run_dir(path: Path, config_yaml: str, start_step: int = 0) -> MetricsLog:
    """Make the run directory `path`, write the resolved config (`config_yaml`, its YAML text),
    and open the metrics log."""
    with writing_to(path / "config.yaml"):
        path.mkdir(parents=True, exist_ok=True)
        write_own(path / "config.yaml", config_yaml)
    return MetricsLog(path / METRICS_FILE, start_step)

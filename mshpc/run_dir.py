"""The run directory: resolved config and per-step metrics, written by rank 0."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

from mshpc.config import RunConfig
from mshpc.errors import RunEnvironmentError, writing_to
from mshpc.regular_files import open_regular, read_text_lines, write_own


def run_path(run: RunConfig) -> Path:
    """<run.out_dir>/<run.name>: where a run's files go."""
    return Path(run.out_dir) / run.name


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/Inf; a diverged loss must still be recorded, as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _records_up_to(path: Path, step: int) -> list[str]:
    kept = []
    for line in read_text_lines(path, keepends=True):
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:
            continue  # a line torn by a crash mid-write
    return kept


class MetricsLog:
    """Appends one JSON object per logged step to metrics.jsonl, flushed at once so that a
    crash loses nothing already logged. A full disk is a RunEnvironmentError naming the file."""

    def __init__(self, path: Path, start_step: int) -> None:
        # A fresh run starts a fresh file; a resumed one keeps the records up to its checkpoint
        # and drops those of steps it will train again.
        kept = _records_up_to(path, start_step) if start_step > 0 else []
        self.path, self._failed = path, False
        with writing_to(path):
            fd = open_regular(path, os.O_WRONLY | os.O_CREAT, 0o644, own=True)  # not through a planted link
            os.ftruncate(fd, 0)
            self._file: TextIO = os.fdopen(fd, "w")
            self._file.writelines(kept)
            self._file.flush()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n"
        try:
            with writing_to(self.path):
                self._file.write(line)
                self._file.flush()
        except (OSError, RunEnvironmentError):
            self._failed = True
            raise

    def close(self) -> None:
        if self._failed:  # what is left in the buffer fails again: said once, by write()
            with contextlib.suppress(OSError):
                self._file.close()
            return
        with writing_to(self.path):
            self._file.close()


def create_run_dir(path: Path, config_yaml: str, start_step: int = 0) -> MetricsLog:
    """Make the run directory `path`, write the resolved config (`config_yaml`, its YAML text),
    and open the metrics log."""
    with writing_to(path / "config.yaml"):
        path.mkdir(parents=True, exist_ok=True)
        write_own(path / "config.yaml", config_yaml)
    return MetricsLog(path / "metrics.jsonl", start_step)

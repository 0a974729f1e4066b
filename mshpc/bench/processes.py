"""Processes read from /proc, for benchmarks and tests that stop or find what a run started."""

from __future__ import annotations

import os
from pathlib import Path


def parent_of(pid: int) -> int | None:
    """The parent of `pid` (its stat's fourth field, after the command name in parentheses);
    None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, read from /proc."""
    pids = (int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat"))
    return [p for p in pids if parent_of(p) == pid]


def ancestors() -> set[int]:
    """This process and the ones above it."""
    found: set[int] = set()
    pid: int | None = os.getpid()
    while pid is not None and pid > 1 and pid not in found:
        found.add(pid)
        pid = parent_of(pid)
    return found

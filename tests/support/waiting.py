"""Polling helpers shared by the tests that watch a live monitor or process tree."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def wait_until(condition: Callable[[], bool], within_s: float = 10.0, poll_s: float = 0.02) -> float:
    """Seconds until `condition()` held; fails the test past `within_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < within_s, f"not within {within_s} s"
        time.sleep(poll_s)
    return time.monotonic() - start


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found

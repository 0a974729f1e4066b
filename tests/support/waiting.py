"""Polling helpers shared by the tests that watch a live monitor or process tree (its children:
`mshpc.bench.processes`)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], within_s: float = 10.0, poll_s: float = 0.02) -> float:
    """Seconds until `condition()` held; fails the test past `within_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < within_s, f"not within {within_s} s"
        time.sleep(poll_s)
    return time.monotonic() - start

"""SIGTERM and SIGHUP to a local supervisor ask it to stop the run, as `scancel` does under Slurm:
the ranks checkpoint at their next step boundary, the supervisor writes `run_end` and a last line.
Without a handler both signals end the supervisor at once and leave its ranks orphaned.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stop_signals_to(request: Callable[[int], None]) -> Iterator[None]:
    """Call `request(signum)` on SIGTERM or SIGHUP while the block runs (the previous handlers
    come back after it). `request` runs in a signal handler: it should only set flags. Python
    installs handlers from the main thread only; elsewhere (an embedding caller) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        request(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

"""SIGTERM, SIGHUP and SIGINT (Ctrl-C) to a local supervisor ask it to stop the run, as `scancel`
does under Slurm: the ranks checkpoint at their next step boundary, the supervisor writes
`run_end` and a last line; a second one stops them at once. Without a handler these signals end
the supervisor at once (Ctrl-C: exit 130 and no checkpoint) and leave its ranks orphaned.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextmanager
def stop_signals_to(request: Callable[[int], None]) -> Iterator[None]:
    """Call `request(signum)` on SIGTERM, SIGHUP or SIGINT while the block runs (the previous handlers
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

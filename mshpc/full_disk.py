"""A moment of full disk, held rather than fatal, for the run's own files under recovery.in_place.

Without recovery in place a full disk or quota (ENOSPC, EDQUOT) where the run writes ends the
job with one line, exit 2 (errors.writing_to): nothing is lost, and the operator frees space and
reruns from disk. Under recovery.in_place every rank's state is in memory and on its buddy, and a
disk full for a few seconds (another job's scratch, a log burst) would throw that away for a line
of metrics: so the lines of metrics.jsonl, timings/, watch/ and events.jsonl that the disk
refuses wait in this process's memory, in order, and are written when space returns. A disk still
full after `recovery.full_disk_grace_s` fails as before. (Checkpoint saves: checkpoint/train_checkpoint.py
skips a periodic save a full disk fails, under the same switch.)

The grace is process-wide, set once at start by the rank (train.py) and the supervisor: every
writer of the run's files in a process follows the same policy.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable

from mshpc.errors import is_disk_full

log = logging.getLogger(__name__)

RETRY_S = 0.1  # a blocking writer's pause between tries while the disk is full

_grace_s = 0.0  # 0: a full disk fails at once (the default, and without recovery.in_place)


def hold_for(grace_s: float) -> None:
    """Hold refused writes up to `grace_s` seconds of full disk in this process (0: none)."""
    global _grace_s
    _grace_s = grace_s


def grace_s() -> float:
    return _grace_s


class FullSince:
    """When the disk, as one writer saw it, became full: a refusal inside the grace is held (and
    said once), one past it is raised."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._since: float | None = None

    def refused(self, exc: OSError) -> None:
        """Return if the write may wait; raise `exc` otherwise (the caller's writing_to makes it one line)."""
        if not is_disk_full(exc) or _grace_s <= 0:
            raise exc
        now = time.monotonic()
        if self._since is None:
            self._since = now
            log.warning("%s: %s; holding its lines in memory for up to %g s (recovery.full_disk_grace_s)",
                        self.what, os.strerror(exc.errno or 0), _grace_s)
        elif now - self._since > _grace_s:
            raise exc

    def cleared(self) -> None:
        if self._since is not None:
            log.warning("%s: written again after %.1f s of full disk", self.what, time.monotonic() - self._since)
        self._since = None


class HeldAppend:
    """Appends to a file that only this process writes (a rank's timings, rank 0's metrics): bytes
    a full disk refused wait here and go first at the next write, so the file is whole and in order
    once space returns (a partial write is continued, never repeated)."""

    def __init__(self, fd: int, what: str) -> None:
        self.fd = fd
        self.held = bytearray()
        self.full = FullSince(what)

    def write(self, data: bytes) -> None:
        self.held += data
        self.flush()

    def add(self, data: bytes) -> None:
        """Buffer `data` for the next flush (a writer that flushes on a clock)."""
        self.held += data

    def flush(self) -> bool:
        """Write what is held; True when nothing is left (False: the disk is still full, within grace)."""
        while self.held:
            try:
                n = os.write(self.fd, self.held)
            except OSError as exc:
                self.full.refused(exc)
                return False
            del self.held[:n]
        self.full.cleared()
        return True

    def close(self) -> None:
        """Write what is held, waiting for space up to the grace; then close the descriptor."""
        try:
            retry_until_written(self.flush)
        finally:
            os.close(self.fd)


def retry_until_written(attempt: Callable[[], bool]) -> None:
    """Call `attempt` (True: written; False: held, within grace; it raises past the grace) until done."""
    while not attempt():
        time.sleep(RETRY_S)


def append_line_shared(fd: int, line: bytes, what: str) -> None:
    """One line appended, in one write, to a file several processes append to (events.jsonl):
    under a full disk it is tried again until written or past the grace, blocking the caller. A
    part written before the disk filled is ended by a newline on the next try and the line written
    whole after it: readers skip the torn part (events.read_jsonl) and nobody's line is joined."""
    full, torn = FullSince(what), False

    def attempt() -> bool:
        nonlocal torn
        data = b"\n" + line if torn else line
        try:
            n = os.write(fd, data)
        except OSError as exc:
            full.refused(exc)
            return False
        if n == len(data):
            full.cleared()
            return True
        torn = True
        full.refused(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))  # a short write: the disk filled mid-line
        return False

    retry_until_written(attempt)

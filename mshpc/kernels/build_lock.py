"""One builder at a time per build folder, and no wait on a dead one.

torch.utils.cpp_extension marks a build with a `lock` file (its FileBaton) that only the builder
removes: a builder killed mid-way (SIGKILL, a node's OOM killer, a job's time limit) leaves it,
and every later process waits on it forever. mshpc's builders first take an flock on a file of
their own beside it, which the kernel releases when its holder dies: so a baton found while
holding that flock was left by a builder that is gone, and is removed.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mshpc.regular_files import open_regular

log = logging.getLogger(__name__)

BATON = "lock"  # cpp_extension's FileBaton in the build folder
FLOCK = "build.flock"  # ours: never removed, so every builder locks the same inode


@contextmanager
def exclusive_build(folder: Path) -> Iterator[None]:
    """Hold the build folder's flock (waiting for a live builder to finish), clearing a baton a
    dead builder left; every process that builds or loads with cpp_extension there must use it."""
    fd = open_regular(folder / FLOCK, os.O_RDWR | os.O_CREAT, 0o600, own=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        baton = folder / BATON
        if baton.exists():
            log.warning("removing %s, left by a kernel build that died before finishing", baton)
            baton.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock

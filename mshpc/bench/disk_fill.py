"""A file system made full on purpose, for the benchmarks and tests of a full disk (a tmpfs of their own)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


def fill(where: Path) -> Path:
    """Take every free byte of `where`'s file system; returns the filler, whose removal frees them."""
    filler = where / ".filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):  # tmpfs keeps some bytes back: the writes below take the rest
            os.posix_fallocate(fd, 0, max(shutil.disk_usage(where).free - 2**20, 1))
        os.lseek(fd, 0, os.SEEK_END)
        for chunk in (2**16, 2**12, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    return filler

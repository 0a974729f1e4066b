"""Opening files that someone else may have put in place: never through a symbolic link at the
last component, never a FIFO or a device (which would block or be read as data), and, where the
file is the run's own, never one another user owns.

Two kinds of folder need it. A checkpoint or model folder from elsewhere is untrusted input: a
shard that is a link to a private file, or a FIFO, must fail to open, not be read or written as
tensor bytes. A run directory on a shared file system may be writable by others: a link planted
as `metrics.jsonl` must not make the run truncate whatever it points at (O_NOFOLLOW), and a file
another user created there must not be written into (the owner check).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: opening a FIFO returns at once


class NotRegularFile(OSError):
    """The path is a symbolic link, a FIFO, a device or a folder, or (`own`) another user's file."""


def open_regular(path: str | Path, flags: int = os.O_RDONLY, mode: int = 0o644, *, own: bool = False) -> int:
    """A descriptor of the regular file `path`, opened with `flags` without following a link at
    its last component; with `own`, the file must be this user's. Raises NotRegularFile (an
    OSError naming the path and why) for anything else; other OSErrors pass."""
    try:
        fd = os.open(path, flags | _FLAGS, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "a symbolic link (not followed)", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})", str(path))
        if own and st.st_uid != os.geteuid():
            raise NotRegularFile(errno.EPERM, f"owned by uid {st.st_uid}, not this user ({os.geteuid()})",
                                 str(path))
        if own and st.st_nlink > 1:  # a hard link to a file of ours elsewhere, which a write would change
            raise NotRegularFile(errno.EMLINK, f"has {st.st_nlink} hard links", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def write_own(path: str | Path, data: str | bytes, sync: bool = False) -> None:
    """Make `data` the whole content of `path`, this user's regular file (created if missing):
    never through a link, never into another user's file, and truncated only once that is known
    (O_TRUNC would cut whatever the name points at before any check); `sync`: fsync it too."""
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT, 0o644, own=True)
    try:
        os.ftruncate(fd, 0)
        view = memoryview(data.encode() if isinstance(data, str) else data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_regular(path: str | Path, max_bytes: int) -> bytes:
    """The whole regular file `path` (opened as `open_regular` does), refused with a
    NotRegularFile before anything is read when it is larger than `max_bytes`."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise NotRegularFile(errno.EFBIG, f"{size} bytes, more than the {max_bytes} such a file may have",
                                 str(path))
        chunks, got = [], 0
        while got < size and (chunk := os.pread(fd, size - got, got)):
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text_lines(path: str | Path, keepends: bool = False) -> list[str]:
    """The lines of the regular file `path` (opened as `open_regular` does); none when it is missing."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return []
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        return f.read().splitlines(keepends)


def fd_path(fd: int) -> str:
    """A path that opens the very file `fd` is open on (Linux's /proc/self/fd): for libraries
    that take a path (h5py, dlopen), so that what they open is what was checked."""
    return f"/proc/self/fd/{fd}"

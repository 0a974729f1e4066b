"""The run directory's lock: one run at a time in runs/<name>/.

The holder (the supervisor, or rank 0 of a run that has none) keeps an exclusive flock on
runs/<name>/.lock for the whole run and writes its host, PID and start time inside, so a second
run is refused at once with a line naming them. The kernel drops a flock when its holder dies,
so a lock file naming a dead holder is stale and is taken over with a line saying so. While held,
MSHPC_RUN_LOCK names the holder; the ranks the holder starts inherit it and check it against the
file before they write anything (`check_run_lock`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from mshpc.errors import MshpcError
from mshpc.regular_files import open_regular, read_regular

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
HOLDER_MAX_BYTES = 64 * 1024  # a holder is one JSON line
LOCK_ENV = "MSHPC_RUN_LOCK"  # <host>:<pid>:<nonce> of the holder, inherited by the ranks it starts
_READ_TRIES = 5  # a holder writes its line just after it takes the flock: a reader may come between
_READ_RETRY_S = 0.05
# flock on a file system that cannot lock (NFS mounted nolock, some FUSE): host + PID decide alone
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLockError(MshpcError):
    """Another live run holds the run directory, or this rank's run does not hold it."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory: written into its lock file as one JSON object."""

    host: str
    pid: int
    started: str  # UTC, for the message
    proc_start: int | None  # /proc/<pid>/stat start time: tells a reused PID from the holder
    nonce: str  # tells this hold from an earlier one of the same process

    @property
    def token(self) -> str:
        return f"{self.host}:{self.pid}:{self.nonce}"

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} (since {self.started})"

    def alive(self) -> bool | None:
        """Whether the holder still runs; None where that cannot be seen (another host)."""
        if self.host != socket.gethostname():
            return None
        return _pid_alive(self.pid, self.proc_start)


def this_process() -> Holder:
    pid = os.getpid()
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return Holder(socket.gethostname(), pid, started, _proc_start(pid), uuid.uuid4().hex[:12])


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first); None if no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2:].split()  # the name may hold spaces and parentheses


def _proc_start(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None  # field 22 of proc(5): start time in clock ticks


def _pid_alive(pid: int, proc_start: int | None) -> bool:
    if not Path("/proc/self/stat").exists():  # no procfs: a signal 0 is all there is
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):  # a zombie holds no files, hence no lock
        return False
    return proc_start is None or int(fields[19]) == proc_start


def _parse(text: str) -> Holder | None:
    try:
        return Holder(**json.loads(text))
    except (ValueError, TypeError):
        return None


def read_holder(path: Path) -> Holder | None:
    """The holder named in a lock file; None when it names none (released, or never taken)."""
    for _ in range(_READ_TRIES):
        try:
            text = read_regular(path, HOLDER_MAX_BYTES).decode("utf-8", "replace")
        except FileNotFoundError:
            return None
        if not text:
            return None
        holder = _parse(text)
        if holder is not None:
            return holder
        time.sleep(_READ_RETRY_S)  # caught mid-write
    return None


def _try_flock(fd: int, path: Path) -> bool | None:
    """True: ours; False: another process holds it; None: this file system cannot flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_FLOCK:
            raise
        log.warning("%s: this file system cannot flock (%s); the lock rests on its holder's host and PID",
                    path, exc.strerror)
        return None


def _refusal(run_dir: Path, path: Path, holder: Holder | None, why: str = "") -> RunLockError:
    who = holder.describe() if holder else "another process (its lock file names none yet)"
    return RunLockError(f"{run_dir} is in use by another run: {who} holds {path}{why}; "
                        "wait for it to end or choose another run.name")


def _check_previous(run_dir: Path, path: Path, previous: Holder | None, flocked: bool) -> None:
    """With the flock taken, what the file says of a previous holder: alive (the flock did not
    hold across this file system), unknowable, or gone (taken over, said in a line)."""
    if previous is None:
        return
    alive = previous.alive()
    if alive:
        raise _refusal(run_dir, path, previous, " (it is alive though its flock was free)")
    if alive is None and not flocked:
        raise _refusal(run_dir, path, previous, f" (without flock here, its liveness on {previous.host} "
                       "cannot be seen: remove the lock file if that run is gone)")
    log.warning("%s: taking over the stale lock of %s, which is gone", run_dir, previous.describe())


def _write(fd: int, holder: Holder) -> None:
    data = json.dumps(asdict(holder)).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)  # another host reading the file on a shared file system sees it


@dataclass
class RunLock:
    """A held lock; `release` ends it (the kernel does when the process dies)."""

    path: Path
    fd: int
    holder: Holder

    def release(self) -> None:
        os.ftruncate(self.fd, 0)  # names no holder: the next run starts without a stale-lock line
        os.close(self.fd)  # drops the flock


def acquire_run_lock(run_dir: Path) -> RunLock:
    """Take run_dir's lock or raise RunLockError naming its live holder; creates run_dir and
    its lock file, nothing else in it."""
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = open_regular(path, os.O_RDWR | os.O_CREAT, 0o644, own=True)  # O_CLOEXEC: not inherited by the ranks
    except OSError as exc:
        raise RunLockError(f"{path}: cannot create the run directory's lock file ({exc.strerror})") from None
    try:
        flocked = _try_flock(fd, path)
        if flocked is False:
            raise _refusal(run_dir, path, read_holder(path))
        _check_previous(run_dir, path, read_holder(path), flocked is True)
        holder = this_process()
        _write(fd, holder)
    except BaseException:
        os.close(fd)
        raise
    return RunLock(path, fd, holder)


@contextmanager
def hold_run_lock(run_dir: Path) -> Iterator[Holder]:
    """Hold run_dir's lock for the `with` body and name it in MSHPC_RUN_LOCK for the processes
    started there; released (and the variable restored) however the body ends."""
    lock = acquire_run_lock(run_dir)
    before = os.environ.get(LOCK_ENV)
    os.environ[LOCK_ENV] = lock.holder.token
    try:
        yield lock.holder
    finally:
        if before is None:
            os.environ.pop(LOCK_ENV, None)
        else:
            os.environ[LOCK_ENV] = before
        lock.release()


def inherited_token() -> str | None:
    """The lock this process's starter holds for it, if any. This module sets MSHPC_RUN_LOCK, so
    it is the one that reads it (not a launcher variable: launch/env.py does not know it)."""
    return os.environ.get(LOCK_ENV) or None


def check_run_lock(run_dir: Path, token: str) -> Holder:
    """Raise RunLockError unless run_dir's lock is held under `token` (by the run that started
    this process) by a holder that is not known to be dead; returns the holder."""
    path = run_dir / LOCK_FILE
    holder = read_holder(path)
    if holder is None:
        raise RunLockError(f"{run_dir}: the run that started this process ({token}) does not hold {path}")
    if holder.token != token:
        raise RunLockError(f"{run_dir} is in use by another run: {holder.describe()} holds {path}, "
                           f"not the run that started this process ({token})")
    if holder.alive() is False:
        raise RunLockError(f"{run_dir}: the holder of {path}, {holder.describe()}, is gone")
    return holder


def token_digest(token: str) -> int:
    """A 60-bit number for a token: what ranks compare when rank 0's token must reach them through
    an all-reduce (a sum with zeros, exact in int64)."""
    return int(hashlib.sha256(token.encode()).hexdigest()[:15], 16)

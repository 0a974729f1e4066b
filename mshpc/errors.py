"""User-facing errors: one line each, saying what, where and the valid choices."""

from __future__ import annotations

import contextlib
import errno
import reprlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from mshpc.regular_files import NotRegularFile

# What mshpc exits with on any MshpcError: the CLI, the batch script's helpers and the supervisor
# (a rank's user error ends the run with it); a Slurm job that exits with it is not requeued.
USER_ERROR_EXIT = 2


class MshpcError(Exception):
    """Base of every error a user can cause; the CLI prints it as one line and exits USER_ERROR_EXIT."""


class ConfigError(MshpcError):
    """A config key, value or combination is invalid."""


class DataError(MshpcError):
    """Input data is missing, malformed or fails its checksum."""


class LaunchError(MshpcError):
    """The launcher environment is inconsistent or a rank could not be started."""


class CheckpointError(MshpcError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


class InteropError(MshpcError):
    """A model cannot go to or come from another library's format (Hugging Face): an architecture
    or feature with no equivalent, or files that do not fit the config."""


class KernelError(MshpcError):
    """The fused kernels were asked for (model.fused_kernels: on) but cannot be built or loaded."""


class RunEnvironmentError(MshpcError):
    """Where the run writes cannot take it (a full disk, a used-up quota): neither the config nor
    the node is at fault, so the supervisor neither retries nor evicts; the CLI exits 2."""


# A bounded repr: a few items per level, a few levels, long strings cut. A value read from a file
# may be megabytes, or (YAML aliases) a tree whose plain repr would not fit in memory.
_SHOWN = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHOWN.maxlevel = 3
_SHOWN.maxtuple = _SHOWN.maxlist = _SHOWN.maxarray = _SHOWN.maxdict = _SHOWN.maxset = _SHOWN.maxfrozenset = 4
_SHOWN.maxdeque = 4
_SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 60, 40, 60


def shown(value: object, limit: int = 100) -> str:
    """`value`'s repr for an error message, at most `limit` characters whatever its size."""
    try:
        text = _SHOWN.repr(value)
    except ValueError:  # an integer past Python's digit limit for str()
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SilentDataCorruption(RuntimeError):
    """A rank's results differed from its own replays of the same steps again and again
    (mshpc/snapshot/replay.py): its device corrupts data silently. No user error: the supervisor
    classifies it by this name (a node fault) and evicts the rank's node at once."""


class SnapshotsUnusable(RuntimeError):
    """No step of which every rank's in-memory snapshot is whole (mshpc/snapshot/restore.py): a
    recovery in place cannot go on, and the supervisor restarts from the disk checkpoint. No
    user error: a restart from disk is the cure."""


def print_error(exc: MshpcError) -> None:
    """`exc` as the CLI's one line on stderr, in a single write: print() writes the text and its
    newline separately, and under mpiexec two ranks' lines then run together into one."""
    sys.stderr.write(f"mshpc: error: {type(exc).__name__}: {exc}\n")
    sys.stderr.flush()


# A full file system or quota, by errno, with the words the one-line error uses: the one list
# every part that treats a full disk apart (saves, the run's files under recovery.in_place) reads.
_FULL = {errno.ENOSPC: "no space left on its file system", errno.EDQUOT: "the disk quota is used up"}


def is_disk_full(exc: OSError) -> bool:
    """Whether `exc` is a full file system or quota (ENOSPC, EDQUOT)."""
    return exc.errno in _FULL


def _size(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} {units[i]}" if i == 0 else f"{n:.1f} {units[i]}"


def _disk_full(exc: OSError, path: Path) -> RunEnvironmentError | None:
    """The one-line error for `exc` if it is a full disk or quota, naming the path and the free
    space; None for any other OSError."""
    why = _FULL.get(exc.errno or 0)
    if why is None:
        return None
    try:
        usage = shutil.disk_usage(path if path.exists() else path.parent)
        free = f"{_size(usage.free)} free of {_size(usage.total)}"
    except OSError as stat_exc:
        free = f"free space unknown: {stat_exc.strerror}"
    return RunEnvironmentError(f"cannot write {path}: {why} ({free}); free some space or point "
                               "run.out_dir elsewhere")


@contextlib.contextmanager
def writing_to(path: Path) -> Iterator[None]:
    """Around writes to `path`: a full disk or quota becomes a RunEnvironmentError (exit 2, no
    retry, no eviction) instead of an OSError that reads as a broken node; other errors pass."""
    try:
        yield
    except NotRegularFile as exc:  # a link, a FIFO or another user's file where the run writes
        raise RunEnvironmentError(f"cannot write {exc.filename}: {exc.strerror}; the run writes only its own "
                                  "plain files (another user may have put it there: remove it, or choose a "
                                  "run.out_dir only you can write)") from None
    except OSError as exc:
        error = _disk_full(exc, path)
        if error is None:
            raise
        raise error from None

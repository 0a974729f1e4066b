"""watch/rank-N.bin: a compact binary twin of each rank's timings, for rank 0's live straggler
watch only (`mshpc diagnose` reads timings/).

At 12,288 ranks the watch read every rank's JSON lines at every check: 120,000 lines and 1.3
million numbers per check, about 1 s of rank 0's CPU, half of it parsing text. Here each step is
one fixed 40-byte record (step, step seconds, the two blamed categories' seconds, and where the
step's JSON line starts in timings/, for the rare moment a rank is flagged and its phases are
wanted), so a check is one pread per rank of what is new and one `np.frombuffer`, and the
descriptors stay open between checks instead of 12,288 opens each time.

A file is a 4-byte little-endian length, that many bytes of the rank's JSON header (the same
header as its timings file), then records. Each process starts its file afresh: the watch is
as young as the process that runs it, and earlier processes' steps are timings/'s to keep.
Records are written at the timings thread's flush, after the JSON lines they point into.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import struct
from pathlib import Path
from typing import Any

import numpy as np

from mshpc.errors import writing_to

WATCH_DIR = "watch"
RECORD = np.dtype([("step", "<i8"), ("step_s", "<f8"), ("compute", "<f8"), ("data_wait", "<f8"),
                   ("line_offset", "<i8")])
_LENGTH = struct.Struct("<I")
READ_BYTES = 1 << 20
SPARE_FDS = 512  # descriptors left to the process (sockets, checkpoint files) when keeping ours open


def stream_file(run_dir: Path, rank: int) -> Path:
    return run_dir / WATCH_DIR / f"rank-{rank:05d}.bin"


class StreamWriter:
    """One rank's side: `add` buffers a record, `flush` appends what is buffered in one write."""

    def __init__(self, path: Path, head: dict[str, Any]) -> None:
        self.path = path
        with writing_to(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            data = json.dumps(head).encode()
            os.write(self._fd, _LENGTH.pack(len(data)) + data)
        self._buffer = bytearray()

    def add(self, step: int, step_s: float, compute_s: float, data_wait_s: float, line_offset: int) -> None:
        self._buffer += np.array([(step, step_s, compute_s, data_wait_s, line_offset)], RECORD).tobytes()

    def flush(self) -> None:
        if self._buffer:
            os.write(self._fd, self._buffer)  # whole records; a reader keeps a torn tail for later
            self._buffer.clear()

    def close(self) -> None:
        self.flush()
        os.close(self._fd)


class StreamReader:
    """Rank 0's side: `read_new()` returns the whole records every rank appended since the last
    call, as one array, with each record's rank; headers are parsed once per rank."""

    def __init__(self, run_dir: Path, world_size: int) -> None:
        self._paths = [str(stream_file(run_dir, r)) for r in range(world_size)]
        self._fds: list[int | None] = [None] * world_size
        self._offsets = [0] * world_size
        self._partial = [b""] * world_size
        self.heads: list[dict[str, Any] | None] = [None] * world_size
        self._keep_open = keepable_fds(world_size)  # ranks below this keep their descriptor

    def read_new(self) -> tuple[np.ndarray, np.ndarray]:
        """(records, rank of each); ranks in order, each rank's records in step order."""
        parts, counts = [], []
        for rank in range(len(self._paths)):
            chunk = self._read(rank)
            if self.heads[rank] is None:  # a header not written whole yet: wait for the rest
                self._partial[rank] = chunk
                counts.append(0)
                continue
            whole = len(chunk) - len(chunk) % RECORD.itemsize
            self._partial[rank] = chunk[whole:]
            parts.append(chunk[:whole])
            counts.append(whole // RECORD.itemsize)
        records = np.frombuffer(b"".join(parts), dtype=RECORD)
        return records, np.repeat(np.arange(len(self._paths)), counts)

    def _read(self, rank: int) -> bytes:
        fd = self._fds[rank]
        if fd is None:
            try:
                fd = os.open(self._paths[rank], os.O_RDONLY)
            except FileNotFoundError:
                return b""
        try:
            chunk = self._partial[rank] + _read_from(fd, self._offsets[rank])
        finally:
            if rank < self._keep_open:
                self._fds[rank] = fd
            else:
                os.close(fd)
        self._offsets[rank] += len(chunk) - len(self._partial[rank])
        if self.heads[rank] is None and len(chunk) >= _LENGTH.size:
            end = _LENGTH.size + _LENGTH.unpack_from(chunk)[0]
            if len(chunk) >= end:
                self.heads[rank] = json.loads(chunk[_LENGTH.size:end])
                chunk = chunk[end:]
        return chunk

    def close(self) -> None:
        for fd in self._fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds = [None] * len(self._fds)


def keepable_fds(world_size: int) -> int:
    """How many ranks' descriptors rank 0 may keep open: its soft RLIMIT_NOFILE, raised towards
    the hard one, less a spare; the ranks past that are opened at each check (slower, correct)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = world_size + SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return world_size if soft == resource.RLIM_INFINITY else max(0, min(world_size, soft - SPARE_FDS))


def _read_from(fd: int, offset: int) -> bytes:
    """Everything of the file from `offset` on (pread: no seek, no buffered reader to build)."""
    parts = []
    while part := os.pread(fd, READ_BYTES, offset):
        parts.append(part)
        offset += len(part)
        if len(part) < READ_BYTES:
            break
    return b"".join(parts)

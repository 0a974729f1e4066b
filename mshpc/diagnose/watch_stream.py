"""watch/ranks-F.bin: a compact binary twin of the timings of ranks F .. F+G-1 (G =
`diagnose.watch_ranks_per_file`, a node's GPUs), for rank 0's live straggler watch only
(`mshpc diagnose` reads timings/).

At 12,288 ranks a file per rank meant 12,288 preads per check, half of the check's cost; with
a file per node of 8 it is 1,536, and the records of a node's ranks arrive as one array. Every
rank writes only its own fixed places in its node's file (pwrite, never an append, never a
truncation), so a rank that dies mid-write can tear only its own record, which the reader rejects:

- G header slots of HEAD_BYTES: a 4-byte length, the CRC-32 of the JSON header (the rank's
  timings header plus a random `nonce` this process chose), the JSON;
- then a row per step from the process's start step on: G records of RECORD (step, step
  seconds, the two blamed categories' seconds, where the step's JSON line starts in timings/
  for the rare moment a rank is flagged and its phases are wanted, and a check word).

The check word is a hash of the record's fields plus the writer's nonce: a torn record, a hole
nobody wrote (zeros) and a record an earlier process of the same rank left in the file (another
nonce) all fail it. A process rewrites its header slot at its start, before its first step's
collectives, so rank 0's first look (`straggler_check_interval_steps` later) sees the new one.
Records are written at the timings thread's flush, after the JSON lines they point into.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import resource
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mshpc.errors import writing_to
from mshpc.full_disk import FullSince, retry_until_written
from mshpc.regular_files import open_regular

WATCH_DIR = "watch"
RECORD = np.dtype([("step", "<i8"), ("step_s", "<f8"), ("compute", "<f8"), ("data_wait", "<f8"),
                   ("line_offset", "<i8"), ("check", "<u8")])
HEAD_BYTES = 1024  # one rank's header slot: a hostname of 255 characters still fits
_SLOT_HEAD = struct.Struct("<II")  # JSON length, its CRC-32
# odd multipliers (from splitmix64) for the check word: a field left out changes it unless its value is 0
_MIX = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93,
                 0xA0761D6478BD642F], dtype=np.uint64)
MAX_ROWS = 1024  # rows per file and look: bounds a late rank's first read (and its check grid)
SPARE_FDS = 512  # descriptors left to the process (sockets, checkpoint files) when keeping ours open
GAP_CHECKS = 2  # a rank's missing record with later ones present is skipped at the second look


def stream_file(run_dir: Path, rank: int, ranks_per_file: int) -> Path:
    return run_dir / WATCH_DIR / f"ranks-{rank - rank % ranks_per_file:05d}.bin"


def check_words(records: np.ndarray, nonces: np.ndarray | int) -> np.ndarray:
    """Each record's expected check word, given its writer's nonce (wrapping uint64 arithmetic)."""
    words = records.view(np.uint64).reshape(len(records), RECORD.itemsize // 8)[:, :len(_MIX)]
    # a product without the (records, 5) temporary of a multiply-then-sum: 6x faster, the same words
    return words @ _MIX + np.asarray(nonces, dtype=np.uint64)


class StreamWriter:
    """One rank's side: `add` buffers a record, `flush` writes what is buffered into its places."""

    def __init__(self, run_dir: Path, rank: int, head: dict[str, Any], start_step: int, ranks_per_file: int) -> None:
        self.path = stream_file(run_dir, rank, ranks_per_file)
        slot, self._start_step = rank % ranks_per_file, start_step
        self._nonce = int.from_bytes(os.urandom(8), "little") | 1  # never 0: a hole is never valid
        data = json.dumps({**head, "nonce": self._nonce}).encode()
        if len(data) > HEAD_BYTES - _SLOT_HEAD.size:
            raise ValueError(f"watch header of rank {rank} is {len(data)} bytes, over {HEAD_BYTES - _SLOT_HEAD.size}")
        # where this rank's record of step start_step + 1 + i lies: row i, its slot
        self._first = ranks_per_file * HEAD_BYTES + slot * RECORD.itemsize
        self._row_bytes = ranks_per_file * RECORD.itemsize
        with writing_to(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT, 0o644, own=True)  # shared: never truncated
            os.pwrite(self._fd, _SLOT_HEAD.pack(len(data), zlib.crc32(data)) + data, slot * HEAD_BYTES)
        self._buffer: list[tuple[int, float, float, float, int, int]] = []
        self._held: collections.deque[tuple[int, bytes]] = collections.deque()  # encoded, not yet written
        self._full = FullSince(str(self.path))

    def add(self, step: int, step_s: float, compute_s: float, data_wait_s: float, line_offset: int) -> None:
        if step > self._start_step:  # an earlier step is not this process's to record
            self._buffer.append((step, step_s, compute_s, data_wait_s, line_offset, 0))

    def take_encoded(self) -> list[tuple[int, bytes]]:
        """(file offset, bytes) of each buffered record, its check word set; the buffer is emptied."""
        if not self._buffer:
            return []
        records = np.array(self._buffer, RECORD)
        self._buffer.clear()
        records["check"] = check_words(records, self._nonce)
        offsets = self._first + (records["step"] - self._start_step - 1) * self._row_bytes
        return [(int(o), r.tobytes()) for o, r in zip(offsets, records, strict=True)]

    def flush(self) -> bool:
        """Write the buffered records; False while a full disk holds some back (recovery.in_place:
        mshpc/full_disk.py), True when all are written."""
        self._held.extend(self.take_encoded())
        while self._held:
            offset, data = self._held[0]
            try:
                os.pwrite(self._fd, data, offset)  # one record, one write: a torn one fails its check
            except OSError as exc:
                self._full.refused(exc)  # and a torn one is written whole again next time
                return False
            self._held.popleft()
        self._full.cleared()
        return True

    def close(self) -> None:
        try:
            retry_until_written(self.flush)
        finally:
            os.close(self._fd)


class StreamReader:
    """Rank 0's side: `read_new()` returns the records every rank wrote since the last call, each
    exactly once, as one array with each record's rank; headers are parsed once per rank."""

    def __init__(self, run_dir: Path, world_size: int, start_step: int, ranks_per_file: int) -> None:
        self.world_size, self.group, self._start_step = world_size, ranks_per_file, start_step
        n_files = -(-world_size // ranks_per_file)
        self._paths = [str(stream_file(run_dir, g * ranks_per_file, ranks_per_file)) for g in range(n_files)]
        self._fds: list[int | None] = [None] * n_files
        self._keep_open = keepable_fds(n_files)  # files below this keep their descriptor
        self.heads: list[dict[str, Any] | None] = [None] * world_size
        self._have = np.zeros(n_files * ranks_per_file, bool)  # header read (the last file's padding: never)
        self._padding = np.arange(n_files * ranks_per_file) >= world_size
        self._nonces = np.zeros(world_size, np.uint64)
        self._last = np.full(world_size, start_step, np.int64)  # the latest step read of each rank
        self._gaps = np.zeros(world_size, np.int64)  # looks in a row that found a rank's record missing
        self._row_bytes = ranks_per_file * RECORD.itemsize

    def all_started(self) -> bool:
        """Every rank's header is read."""
        return bool((self._have | self._padding).all())

    def missing(self) -> list[int]:
        """Ranks whose header has not been read yet (not started, or not in this run)."""
        return [r for r, h in enumerate(self.heads) if h is None]

    def last_steps(self) -> np.ndarray:
        """(ranks,) the latest step read of each rank (the start step: none yet)."""
        return self._last

    def behind(self, step: int) -> list[int]:
        """Ranks whose records have not reached `step`."""
        return np.flatnonzero(self._last < step).tolist()

    def read_new(self, up_to_step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(records, rank of each): file by file, each rank's in step order. `up_to_step`: read
        no further (rows past it can only be an earlier process's, which a restart left)."""
        waiting = ~(self._have | self._padding)
        if waiting.any():  # until every rank has started: their headers, once each
            for f in np.flatnonzero(waiting.reshape(-1, self.group).any(axis=1)).tolist():
                self._with_file(f, functools.partial(self._read_heads, f))
        chunks, counts = [], np.zeros(len(self._paths), np.int64)
        for g, row in enumerate(self._first_rows().tolist()):
            if row < 0:  # no header of the file read yet: nothing to check its records against
                continue
            chunk = self._with_file(g, functools.partial(self._read_rows, row=row, up_to_step=up_to_step)) or b""
            chunk += bytes(-len(chunk) % self._row_bytes)  # a row whose last slots are unwritten yet
            chunks.append(chunk)
            counts[g] = len(chunk) // RECORD.itemsize
        records = np.frombuffer(b"".join(chunks), dtype=RECORD)
        # rows of G slots, file by file: slot i of file f's row is rank f * G + i
        firsts = np.repeat(np.arange(len(self._paths)) * self.group, counts // self.group)
        ranks = (firsts[:, None] + np.arange(self.group)).ravel()
        keep = self._take(records, ranks)
        if len(keep) == len(records):  # every record new and whole (the usual look): no copy
            return records, ranks
        return records[keep], ranks[keep]

    def _first_rows(self) -> np.ndarray:
        """Each file's first row not yet read by all of its ranks whose header is read (-1: none
        read yet; a late rank's header brings its file back to its row 0, read once more)."""
        have = self._have.reshape(-1, self.group)
        last = np.concatenate([self._last, np.zeros(len(self._have) - self.world_size, np.int64)]).reshape(-1, self.group)
        rows = np.where(have, last - self._start_step, np.iinfo(np.int64).max).min(axis=1)
        return np.where(have.any(axis=1), rows, -1)

    def _take(self, records: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """The indices of the records to return: whole (their check word holds), new, and each
        rank's in an unbroken run from its last step on; a rank's record missing behind later
        ones (torn while being read, or never written) holds those back for GAP_CHECKS looks."""
        ranks = np.minimum(ranks, self.world_size - 1)  # the padding slots of the last file fail the check
        step, last, nonce = records["step"], self._last[ranks], self._nonces[ranks]
        ok = np.flatnonzero((step > last) & (nonce != 0) & (records["check"] == check_words(records, nonce)))
        r, ahead = ranks[ok], step[ok] - last[ok] - 1  # ahead 0: the rank's next step
        seen = np.zeros((int(ahead.max(initial=-1)) + 2, self.world_size), bool)
        seen[ahead, r] = True
        run = seen.argmin(axis=0)  # each rank's unbroken run from its next step
        in_run = ahead < run[r]
        gap = np.zeros(self.world_size, bool)
        gap[r[~in_run]] = True
        self._gaps = np.where(gap, self._gaps + 1, 0)
        self._last += run  # a rank's steps come one after the other: its run ends at last + run
        skip = self._gaps[r] >= GAP_CHECKS  # given up on the missing step: take the later ones too
        if skip.any():
            np.maximum.at(self._last, r[skip], step[ok][skip])
            self._gaps[r[skip]] = 0
        return ok[in_run | skip]

    def _read_heads(self, g: int, fd: int) -> None:
        """The header slots of file g not read yet, those written whole."""
        region = os.pread(fd, self.group * HEAD_BYTES, 0)
        for slot in range(self.group):
            rank = g * self.group + slot
            if rank >= self.world_size or self.heads[rank] is not None:
                continue
            at = slot * HEAD_BYTES
            if len(region) < at + _SLOT_HEAD.size:
                break
            length, crc = _SLOT_HEAD.unpack_from(region, at)
            data = region[at + _SLOT_HEAD.size:at + _SLOT_HEAD.size + length]
            if 0 < length == len(data) and zlib.crc32(data) == crc:  # else not written whole yet
                head = json.loads(data)
                self._nonces[rank] = head.pop("nonce")
                self.heads[rank], self._have[rank] = head, True

    def _read_rows(self, fd: int, row: int, up_to_step: int | None) -> bytes:
        """One pread: the file's rows from `row` on, to `up_to_step`'s row and MAX_ROWS at most."""
        rows = MAX_ROWS if up_to_step is None else min(MAX_ROWS, up_to_step - self._start_step - row)
        return os.pread(fd, max(0, rows) * self._row_bytes, self.group * HEAD_BYTES + row * self._row_bytes)

    def _with_file(self, g: int, use: Callable[[int], bytes | None]) -> bytes | None:
        """use(fd) on file g's descriptor, kept open for the files below the limit (None: no file yet)."""
        fd = self._fds[g]
        if fd is None:
            try:
                fd = open_regular(self._paths[g])
            except FileNotFoundError:
                return None
        try:
            return use(fd)
        finally:
            if g < self._keep_open:
                self._fds[g] = fd
            else:
                os.close(fd)

    def close(self) -> None:
        for fd in self._fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds = [None] * len(self._fds)


def keepable_fds(n_files: int) -> int:
    """How many files' descriptors rank 0 may keep open: its soft RLIMIT_NOFILE, raised towards
    the hard one, less a spare; the files past that are opened at each check (slower, correct)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n_files + SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return n_files if soft == resource.RLIM_INFINITY else max(0, min(n_files, soft - SPARE_FDS))


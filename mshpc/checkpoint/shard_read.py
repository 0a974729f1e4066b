"""Read checkpoint entries from their shard files: each dataset's bytes at the offset the manifest
records, several large reads in flight at once, each entry's checksum computed as its chunks
arrive (beside the reads, not after them).

Why not h5py's per-dataset read, or one large read per dataset: measured on this project's VM
disk, restoring 1 GiB cold (benchmarks/checkpoint.py), one 64 MiB O_DIRECT read at a time took
~1.2 s and the crc32 pass after it another ~0.6 s; four 16 MiB O_DIRECT reads in flight read the
same file in ~0.8-1.0 s, and the checksums (two entries at a time) then hide behind them. O_DIRECT also spares the page
cache (the training data lives there) and a copy; where the file system refuses it (tmpfs) the
same reads go through the page cache.
"""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mshpc.checkpoint.h5_shard import ALIGN_BYTES, check_finite, dataset_offsets, from_bytes, itemsize
from mshpc.checkpoint.manifest import SHARD_FILE, TensorEntry
from mshpc.errors import CheckpointError, shown
from mshpc.regular_files import fd_path, open_regular

READ_CHUNK_BYTES = 16 * 2**20  # a multiple of ALIGN_BYTES
READ_THREADS = 4  # reads in flight
# crc32 runs at ~1.5 GB/s on one core here, slower than a fast parallel file system delivers:
# two entries are checked at once.
CHECKSUM_THREADS = 2


def entry_nbytes(e: TensorEntry) -> int:
    return e.numel * itemsize(e.dtype)


def _round_up(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@dataclass
class ReadStats:
    """What a reader took from the file system (broadcasts from other ranks not included)."""

    bytes_read: int = 0
    entries: list[str] = field(default_factory=list)  # "file:dataset" of each entry read


class ShardFiles:
    """One checkpoint folder's shard files, opened on first use: a buffered descriptor, an
    O_DIRECT one where the file system allows it, and each dataset's data offset."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._fds: dict[str, tuple[int, int | None]] = {}
        self._offsets: dict[str, dict[str, int | None]] = {}

    def fds(self, file: str) -> tuple[int, int | None]:
        """The shard's descriptors: a regular file of this folder, never through a link (the
        manifest's names are checked already; this holds for any caller)."""
        if file not in self._fds:
            path = self.folder / file
            if not SHARD_FILE.fullmatch(file):
                raise CheckpointError(f"{self.folder}: {shown(file)} is not a shard name (shard-NNNNN.h5)")
            try:
                fd = open_regular(path)
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot open shard ({exc.strerror})") from None
            try:  # the same file again, whatever its name points at by now
                direct: int | None = os.open(fd_path(fd), os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError:
                direct = None  # e.g. tmpfs: the page cache path
            self._fds[file] = (fd, direct)
        return self._fds[file]

    def size(self, file: str) -> int:
        return os.fstat(self.fds(file)[0]).st_size

    def offset(self, e: TensorEntry) -> int:
        """Where the entry's bytes start: from the manifest, or (older manifests) from HDF5."""
        if e.offset is not None or e.numel == 0:
            return e.offset or 0
        if e.file not in self._offsets:
            self._offsets[e.file] = dataset_offsets(self.folder / e.file, fd_path(self.fds(e.file)[0]))
        offset = self._offsets[e.file].get(e.dataset)
        if offset is None:
            raise CheckpointError(f"{self.folder / e.file}:{e.dataset}: no contiguous dataset of that name")
        return offset

    def close(self) -> None:
        for fd, direct in self._fds.values():
            os.close(fd)
            if direct is not None:
                os.close(direct)
        self._fds.clear()


def _read_range(fds: tuple[int, int | None], view: memoryview, start: int, stop: int, offset: int) -> None:
    """Bytes [start, stop) of an entry, which begins at file `offset`, into view[start:stop].
    The buffer is page-aligned and padded to whole pages, so a direct read may round `stop` up;
    only the entry's last chunk has an unaligned stop, so no two chunks' reads overlap."""
    fd, direct = fds
    done = start
    while done < stop:
        use_direct = direct is not None and (offset + done) % ALIGN_BYTES == 0 and done % ALIGN_BYTES == 0
        end = _round_up(stop) if use_direct else stop
        try:
            got = os.preadv(direct if use_direct and direct is not None else fd, [view[done:end]], offset + done)
        except OSError as exc:
            if not (use_direct and exc.errno == errno.EINVAL):
                raise
            direct = None  # the file system took O_DIRECT at open but refuses this read
            continue
        if got == 0:
            raise OSError(errno.EIO, f"the file ends {stop - done} bytes early")
        done += got


def read_entries(files: ShardFiles, entries: list[TensorEntry], stats: ReadStats) -> list[memoryview]:
    """Each entry's bytes, verified against its checksum; a CheckpointError names the tensor
    and file of the first that is unreadable or corrupt."""
    sizes = [entry_nbytes(e) for e in entries]
    try:
        where = [(files.fds(e.file), files.offset(e)) for e in entries]
        for e, n, (_, offset) in zip(entries, sizes, where, strict=True):
            if offset + n > files.size(e.file):  # before any buffer is allocated for it
                raise CheckpointError(f"{files.folder / e.file}:{e.dataset}: the tensor's {n} bytes at offset "
                                      f"{offset} lie past the file's end ({files.size(e.file)} bytes)")
    except OSError as exc:
        raise CheckpointError(f"{files.folder}: unreadable shard ({exc})") from None
    buffers = [memoryview(mmap.mmap(-1, _round_up(max(n, 1)))) for n in sizes]
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="mshpc-ckpt-read") as reads, \
            ThreadPoolExecutor(CHECKSUM_THREADS, thread_name_prefix="mshpc-ckpt-crc") as sums:
        # All reads queued in file order; each entry's checksum follows its chunks as they land.
        chunks = [[(lo, hi, reads.submit(_read_range, where[i][0], buffers[i], lo, hi, where[i][1]))
                   for lo in range(0, n, READ_CHUNK_BYTES) for hi in [min(lo + READ_CHUNK_BYTES, n)]]
                  for i, n in enumerate(sizes)]
        checks = [sums.submit(_checksum, buffers[i], chunks[i]) for i in range(len(entries))]
        try:
            crcs = [_result(check, files.folder, e) for check, e in zip(checks, entries, strict=True)]
        finally:
            sums.shutdown(cancel_futures=True)
            reads.shutdown(cancel_futures=True)
    for e, crc, buffer, n in zip(entries, crcs, buffers, sizes, strict=True):
        if crc != e.crc32:
            raise CheckpointError(f"{files.folder / e.file}:{e.dataset}: checksum mismatch for tensor "
                                  f"{e.name!r} (corrupt shard)")
        check_finite(from_bytes(buffer[:n], e.dtype), f"{files.folder / e.file}:{e.dataset}")
    stats.bytes_read += sum(sizes)
    stats.entries += [f"{e.file}:{e.dataset}" for e in entries]
    return [b[:n] for b, n in zip(buffers, sizes, strict=True)]


def _checksum(buffer: memoryview, chunks: list[tuple[int, int, Future[None]]]) -> int:
    crc = 0
    for lo, hi, read in chunks:
        read.result()
        crc = zlib.crc32(buffer[lo:hi], crc)  # releases the GIL: beside the reads and other sums
    return crc


def _result(future: Future[int], folder: Path, e: TensorEntry) -> int:
    try:
        return future.result()
    except OSError as exc:
        raise CheckpointError(f"{folder / e.file}:{e.dataset}: unreadable ({exc})") from None

"""One rank's shard file: an HDF5 file with one dataset per tensor slice.

Datasets keep the slice's own shape (a whole tensor opens in h5ls/h5dump as itself) and carry
attributes `start` and `global_shape`. bfloat16, which HDF5 lacks, is stored as its raw uint16
bits with attribute `dtype = "bfloat16"`.
"""

from __future__ import annotations

import errno
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
import torch

from mshpc.checkpoint.manifest import TensorEntry
from mshpc.errors import CheckpointError
from mshpc.regular_files import fd_path, open_regular
from mshpc.tensor_slice import TensorSlice

# torch dtype name -> (numpy storage dtype, torch dtype)
_CODEC: dict[str, tuple[np.dtype, torch.dtype]] = {
    "float32": (np.dtype("<f4"), torch.float32),
    "float64": (np.dtype("<f8"), torch.float64),
    "float16": (np.dtype("<f2"), torch.float16),
    "bfloat16": (np.dtype("<u2"), torch.bfloat16),
    "int64": (np.dtype("<i8"), torch.int64),
    "int32": (np.dtype("<i4"), torch.int32),
    "uint8": (np.dtype("u1"), torch.uint8),
    "bool": (np.dtype("?"), torch.bool),
}


def dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _CODEC:
        raise CheckpointError(f"tensors of dtype {name} cannot be checkpointed (choose {', '.join(_CODEC)})")
    return name


def check_finite(t: torch.Tensor, where: str) -> None:
    """A one-line CheckpointError when the flat tensor `t` holds a NaN or an infinity: weights or
    optimizer state of a diverged step (or a crafted file), never a state to save or resume from.
    Checked in pieces, so the check allocates a few MiB whatever the tensor's size."""
    if not t.is_floating_point():
        return
    for lo in range(0, t.numel(), FINITE_CHECK_ELEMENTS):
        if not bool(torch.isfinite(t[lo:lo + FINITE_CHECK_ELEMENTS]).all()):
            raise CheckpointError(f"{where}: holds NaN or Inf values (a diverged state, not one to save or "
                                  "resume from)")


def itemsize(name: str) -> int:
    return _CODEC[name][0].itemsize


def torch_dtype(name: str) -> torch.dtype:
    return _CODEC[name][1]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes as numpy, without a copy (bfloat16 as its uint16 bits: the storage
    dtype `check_datasets` expects)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_bytes(data: memoryview, dtype: str) -> torch.Tensor:
    """A flat tensor over an entry's stored bytes, without a copy."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch_dtype(dtype))
    return torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype(dtype))


FINITE_CHECK_ELEMENTS = 2**22
# HDF5 headers and object metadata per dataset, with room to spare (measured: ~1 KiB each).
_OVERHEAD_BYTES = 64 * 1024
_PER_DATASET_BYTES = 4 * 1024
_DIRECT_MIN_BYTES = 64 * 1024
ALIGN_BYTES = 4096  # O_DIRECT alignment of offsets, sizes and buffers


def check_space(path: Path, items: dict[str, TensorSlice]) -> None:
    """Fail cleanly before writing when the file system cannot hold the shard: libhdf5 meeting
    ENOSPC mid-write leaves its objects in a state that crashes the process when freed."""
    need = _OVERHEAD_BYTES + sum(
        p.tensor.numel() * p.tensor.element_size() + _PER_DATASET_BYTES for p in items.values())
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(errno.ENOSPC, f"No space left on device: the shard needs {need / 2**20:.1f} MiB, "
                      f"{free / 2**20:.1f} MiB are free", str(path))


def _create(f: h5py.File, name: str, data: np.ndarray) -> bool:
    """Create the dataset; small ones get their data now (False), large ones only their space
    (True): their bytes are written by `_pwrite_all` with plain positioned writes, which skip
    libhdf5's write path and release the GIL, so the checksum thread runs beside them."""
    if data.nbytes < _DIRECT_MIN_BYTES:
        f.create_dataset(name, data=data)
        return False
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # a fixed file offset now...
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # ...without writing fill values first
    f.create_dataset(name, shape=data.shape, dtype=data.dtype, dcpl=dcpl)
    return True


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor, or None where the file system refuses one (tmpfs)."""
    try:
        return os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def _write_data(path: str, jobs: list[tuple[np.ndarray, int]]) -> None:
    """Write each array at its file offset, then fsync. Page-aligned parts go through O_DIRECT:
    here that is ~3x the buffered path's throughput (which pays for page-cache allocation) and
    keeps a checkpoint from evicting the training data from the cache."""
    fd, direct = os.open(path, os.O_WRONLY), _open_direct(path)
    try:
        for data, offset in jobs:
            view = data.reshape(-1).data.cast("B")
            aligned = len(view) // ALIGN_BYTES * ALIGN_BYTES
            if direct is None or offset % ALIGN_BYTES or data.ctypes.data % ALIGN_BYTES:
                aligned = 0
            if aligned:
                assert direct is not None  # aligned is 0 without it
                _pwrite_all(direct, view[:aligned], offset)
            _pwrite_all(fd, view[aligned:], offset + aligned)
        os.fsync(fd)
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)


def write_shard(path: Path, items: dict[str, TensorSlice]) -> list[TensorEntry]:
    """Write host slices to `path` and fsync it; return their manifest entries with checksums."""
    check_space(path, items)
    arrays = {name: to_numpy(piece.tensor.contiguous()) for name, piece in items.items()}
    # Created here, never through a link or into another user's file; h5py and the writes below
    # open this very file through its descriptor.
    own = open_regular(path, os.O_RDWR | os.O_CREAT, 0o644, own=True)
    try:
        return _write_shard(path, fd_path(own), items, arrays)
    except RuntimeError as exc:
        as_os = _os_error(exc)
        if as_os is None:
            raise
        raise as_os from exc
    finally:
        os.close(own)


_HDF5_ERRNO = re.compile(r"\berrno = (\d+)\b")


def _os_error(exc: RuntimeError) -> OSError | None:
    """HDF5's failed write as the OSError it is: a write failing while HDF5 flushes its metadata
    (closing the file) comes out of h5py as a RuntimeError that carries the errno only in its text
    ("... file write failed: ..., errno = 28, error message = 'No space left on device'"), and a
    full disk must read as one wherever it strikes (the saver skips a periodic save for it). None
    for any other RuntimeError."""
    found = _HDF5_ERRNO.search(str(exc))
    if found is None or int(found.group(1)) == 0:
        return None
    code = int(found.group(1))
    return OSError(code, f"{os.strerror(code)} ({str(exc).splitlines()[0][:200]})")


def _write_shard(path: Path, open_path: str, items: dict[str, TensorSlice],
                 arrays: dict[str, np.ndarray]) -> list[TensorEntry]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        crcs = {name: pool.submit(zlib.crc32, a.data) for name, a in arrays.items()}  # beside the writes
        # Large datasets start on page boundaries, as O_DIRECT needs.
        with h5py.File(open_path, "w", alignment_threshold=_DIRECT_MIN_BYTES, alignment_interval=ALIGN_BYTES) as f:
            deferred = [name for name, a in arrays.items() if _create(f, name, a)]
            offsets = {}
            for name, piece in items.items():
                dset = f[name]
                dset.attrs["start"], dset.attrs["global_shape"] = piece.start, list(piece.global_shape)
                dset.attrs["dtype"] = dtype_name(piece.tensor)
                offsets[name] = dset.id.get_offset()  # None only for an empty dataset
        _write_data(open_path, [(arrays[name], offsets[name]) for name in deferred])
        return [
            TensorEntry(name=name, global_shape=tuple(piece.global_shape), dtype=dtype_name(piece.tensor),
                        file=path.name, dataset=name, start=piece.start, numel=piece.tensor.numel(),
                        crc32=crcs[name].result(), offset=offsets[name])
            for name, piece in items.items()
        ]


def rewrite_dataset(folder: Path, e: TensorEntry, data: np.ndarray) -> None:
    """Overwrite entry `e`'s bytes in its shard with `data`, and fsync: only once the shard's own
    HDF5 metadata says that a contiguous dataset of the entry's name, size and storage dtype
    starts at the entry's offset, so a crafted manifest cannot aim the write anywhere else. The
    shard is opened once, without following a link, and checked and written through that one
    descriptor."""
    path = folder / e.file
    try:
        fd = open_regular(path, os.O_RDWR)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open shard ({exc.strerror})") from None
    try:
        check_datasets(path, [e], fd_path(fd))
        offset = e.offset if e.offset is not None else dataset_offsets(path, fd_path(fd)).get(e.dataset)
        if offset is None or data.nbytes != e.numel * itemsize(e.dtype):
            raise CheckpointError(f"{path}:{e.dataset}: no place of {e.numel} x {e.dtype} to rewrite {e.name!r} in")
        _pwrite_all(fd, data.reshape(-1).data.cast("B"), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_h5(path: Path, open_path: str | None) -> h5py.File:
    try:
        return h5py.File(open_path or path, "r")
    except OSError as exc:
        raise CheckpointError(f"{path}: not a readable HDF5 shard ({exc})") from None


def dataset_offsets(path: Path, open_path: str | None = None) -> dict[str, int | None]:
    """Every dataset of a shard and where its contiguous data starts (None: chunked, compact or
    empty), from the file's own HDF5 metadata; `open_path`: where to open it (a checked
    descriptor's, regular_files.fd_path), `path` for messages."""
    out: dict[str, int | None] = {}

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            out[name] = obj.id.get_offset() if obj.chunks is None else None

    with _open_h5(path, open_path) as f:
        f.visititems(visit)
    return out


def check_datasets(path: Path, entries: list[TensorEntry], open_path: str | None = None) -> None:
    """The shard's HDF5 metadata must describe what the manifest says: each entry a contiguous
    dataset of its size and storage dtype whose data starts at the recorded offset."""
    with _open_h5(path, open_path) as f:
        for e in entries:
            dset = f.get(e.dataset)
            if (not isinstance(dset, h5py.Dataset) or dset.size != e.numel or dset.dtype != _CODEC[e.dtype][0]
                    or dset.chunks is not None):
                raise CheckpointError(f"{path}:{e.dataset}: the HDF5 dataset does not match the manifest's "
                                      f"{e.numel} x {e.dtype} tensor {e.name!r}")
            if e.offset is not None and e.numel and dset.id.get_offset() != e.offset:
                raise CheckpointError(f"{path}:{e.dataset}: HDF5 puts its data at {dset.id.get_offset()}, "
                                      f"the manifest at {e.offset}")

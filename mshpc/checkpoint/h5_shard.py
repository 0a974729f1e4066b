"""One rank's shard file: an HDF5 file with one dataset per tensor slice.

Datasets keep the slice's own shape (a whole tensor opens in h5ls/h5dump as itself) and carry
attributes `start` and `global_shape`. bfloat16, which HDF5 lacks, is stored as its raw uint16
bits with attribute `dtype = "bfloat16"`.
"""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import h5py
import numpy as np
import torch

from mshpc.checkpoint.manifest import TensorEntry
from mshpc.checkpoint.tensor_slice import TensorSlice
from mshpc.errors import CheckpointError

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


def itemsize(name: str) -> int:
    return _CODEC[name][0].itemsize


def torch_dtype(name: str) -> torch.dtype:
    return _CODEC[name][1]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes as numpy, without a copy (bfloat16 as its uint16 bits)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    storage, torch_dtype = _CODEC[dtype]
    t = torch.from_numpy(np.ascontiguousarray(a.view(storage) if a.dtype != storage else a))
    return t.view(torch_dtype) if dtype == "bfloat16" else t


# HDF5 headers and object metadata per dataset, with room to spare (measured: ~1 KiB each).
_OVERHEAD_BYTES = 64 * 1024
_PER_DATASET_BYTES = 4 * 1024


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


def write_shard(path: Path, items: dict[str, TensorSlice]) -> list[TensorEntry]:
    """Write host slices to `path` and fsync it; return their manifest entries with checksums."""
    check_space(path, items)
    entries = []
    with h5py.File(path, "w") as f:
        for name, piece in items.items():
            dtype = dtype_name(piece.tensor)
            data = to_numpy(piece.tensor.contiguous())
            dset = f.create_dataset(name, data=data)
            dset.attrs["start"] = piece.start
            dset.attrs["global_shape"] = list(piece.global_shape)
            dset.attrs["dtype"] = dtype
            entries.append(TensorEntry(
                name=name, global_shape=tuple(piece.global_shape), dtype=dtype, file=path.name,
                dataset=name, start=piece.start, numel=piece.tensor.numel(), crc32=zlib.crc32(data),
            ))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return entries


class ShardReader:
    """Reads and verifies entries from a checkpoint folder's shard files, keeping files open."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[str, h5py.File] = {}

    def _file(self, name: str) -> h5py.File:
        if name not in self._files:
            path = self.folder / name
            try:
                self._files[name] = h5py.File(path, "r")
            except (OSError, FileNotFoundError) as exc:
                raise CheckpointError(f"{path}: cannot open shard ({exc})") from None
        return self._files[name]

    def read(self, e: TensorEntry) -> torch.Tensor:
        """The entry's elements as a flat tensor, after checking its checksum."""
        where = f"{self.folder / e.file}:{e.dataset}"
        try:
            data = self._file(e.file)[e.dataset][()]
        except (KeyError, OSError) as exc:
            raise CheckpointError(f"{where}: unreadable ({exc})") from None
        data = np.ascontiguousarray(data).reshape(-1)
        if data.size != e.numel or zlib.crc32(data) != e.crc32:
            raise CheckpointError(f"{where}: checksum mismatch for tensor {e.name!r} (corrupt shard)")
        return from_numpy(data, e.dtype)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

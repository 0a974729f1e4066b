import dataclasses
import errno

import h5py
import numpy as np
import pytest
import torch

from mshpc.checkpoint import shard_read
from mshpc.checkpoint.h5_shard import _os_error, check_datasets, from_bytes, write_shard
from mshpc.checkpoint.shard_read import ReadStats, ShardFiles, read_entries
from mshpc.tensor_slice import TensorSlice
from mshpc.errors import CheckpointError, is_disk_full


def read_back(folder, entries):
    files = ShardFiles(folder)
    try:
        return [from_bytes(b, e.dtype) for e, b in zip(entries, read_entries(files, entries, ReadStats()))]
    finally:
        files.close()


def test_round_trip_keeps_dtype_shape_and_bits(tmp_path):
    items = {
        "model/w": TensorSlice.whole(torch.randn(3, 4)),
        "model/b16": TensorSlice.whole(torch.randn(5).to(torch.bfloat16)),
        "optim.step/w": TensorSlice.whole(torch.tensor(7.0)),
        "optim.exp_avg/w": TensorSlice(torch.arange(6, dtype=torch.float32), (3, 4), start=6),
        "rng/cpu/rank-0": TensorSlice.whole(torch.get_rng_state()),
    }
    entries = write_shard(tmp_path / "shard-00000.h5", items)
    for e, got in zip(entries, read_back(tmp_path, entries)):
        want = items[e.name].tensor.reshape(-1)
        assert got.dtype == want.dtype and torch.equal(got, want), e.name
        assert e.start == items[e.name].start and e.global_shape == items[e.name].global_shape


def test_plain_h5py_reads_the_shard(tmp_path):
    w = torch.randn(3, 4)
    write_shard(tmp_path / "shard-00000.h5", {"model/w": TensorSlice.whole(w)})
    with h5py.File(tmp_path / "shard-00000.h5", "r") as f:
        assert f["model/w"].shape == (3, 4)
        assert torch.equal(torch.from_numpy(f["model/w"][()]), w)
        assert list(f["model/w"].attrs["global_shape"]) == [3, 4]


def test_bfloat16_is_stored_as_its_uint16_bits_and_verifies(tmp_path):
    t = torch.randn(5).to(torch.bfloat16)
    entries = write_shard(tmp_path / "shard-00000.h5", {"model/b16": TensorSlice.whole(t)})
    check_datasets(tmp_path / "shard-00000.h5", entries)  # what `mshpc ckpt verify` asks of the HDF5 metadata
    with h5py.File(tmp_path / "shard-00000.h5", "r") as f:
        assert f["model/b16"].dtype == np.uint16 and f["model/b16"].attrs["dtype"] == "bfloat16"
        assert torch.equal(torch.from_numpy(f["model/b16"][()].view(np.int16)).view(torch.bfloat16), t)


def test_flipped_byte_is_named(tmp_path):
    entries = write_shard(tmp_path / "shard-00000.h5", {"model/w": TensorSlice.whole(torch.randn(64, 64))})
    with h5py.File(tmp_path / "shard-00000.h5", "r") as f:
        offset = f["model/w"].id.get_offset()
    with open(tmp_path / "shard-00000.h5", "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"shard-00000\.h5:model/w: checksum mismatch for tensor 'model/w'"):
        read_back(tmp_path, entries)


def test_unsupported_dtype_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="complex64 cannot be checkpointed"):
        write_shard(tmp_path / "shard-00000.h5", {"x": TensorSlice.whole(torch.zeros(2, dtype=torch.complex64))})


def test_recorded_offsets_are_hdf5s_own(tmp_path):
    items = {"big": TensorSlice.whole(torch.randn(300, 301)), "small": TensorSlice.whole(torch.arange(5))}
    entries = write_shard(tmp_path / "shard-00000.h5", items)
    with h5py.File(tmp_path / "shard-00000.h5", "r") as f:
        assert {e.name: e.offset for e in entries} == {n: f[n].id.get_offset() for n in items}
    assert entries[0].offset % 4096 == 0  # large datasets start on a page: O_DIRECT reads them


@pytest.mark.parametrize("with_offsets", [True, False])
def test_multi_chunk_reads_of_unaligned_sizes(tmp_path, monkeypatch, with_offsets):
    # small chunks: each entry is read as several O_DIRECT reads in flight plus an unaligned tail
    monkeypatch.setattr(shard_read, "READ_CHUNK_BYTES", 3 * 4096)
    items = {f"t{i}": TensorSlice.whole(torch.randn(n)) for i, n in enumerate([20_000, 16_384, 70_001, 3])}
    entries = write_shard(tmp_path / "shard-00000.h5", items)
    if not with_offsets:  # a manifest from before offsets were recorded: HDF5's metadata says
        entries = [dataclasses.replace(e, offset=None) for e in entries]
    stats = ReadStats()
    files = ShardFiles(tmp_path)
    got = [from_bytes(b, e.dtype) for e, b in zip(entries, read_entries(files, entries, stats))]
    files.close()
    for e, t in zip(entries, got):
        assert torch.equal(t, items[e.name].tensor), e.name
    assert stats.bytes_read == sum(t.tensor.numel() * 4 for t in items.values()) and len(stats.entries) == 4


def test_truncated_shard_names_file_and_dataset(tmp_path):
    entries = write_shard(tmp_path / "shard-00000.h5", {"model/w": TensorSlice.whole(torch.randn(256, 256))})
    with open(tmp_path / "shard-00000.h5", "r+b") as f:
        f.truncate(entries[0].offset + 1000)
    with pytest.raises(CheckpointError, match=r"shard-00000\.h5:model/w: the tensor's \d+ bytes at offset \d+ lie past the file's end"):
        read_back(tmp_path, entries)


def test_hdf5s_failed_flush_on_a_full_disk_reads_as_the_os_error_it_is():
    # what h5py raised in benchmarks/chaos.py when the run directory filled while a shard's file
    # closed (2026-12-07): a RuntimeError whose errno is only in its text
    flushed = RuntimeError(
        "Disable slist on flush dest failure failed (file write failed: time = Mon Dec  7 01:47:55 2026\n"
        ", filename = '/proc/self/fd/86', file descriptor = 87, errno = 28, error message = 'No space left on "
        "device', buf = 0x7f48e415b9b8, total write size = 2008, bytes this sub-write = 2008, offset = 11046912)")
    as_os = _os_error(flushed)
    assert isinstance(as_os, OSError) and as_os.errno == errno.ENOSPC and is_disk_full(as_os)
    assert str(as_os).startswith("[Errno 28] No space left on device (Disable slist on flush dest failure failed")
    assert _os_error(RuntimeError("Unable to synchronously open object (component not found)")) is None
    assert _os_error(RuntimeError("... errno = 0, error message = 'Success' ...")) is None

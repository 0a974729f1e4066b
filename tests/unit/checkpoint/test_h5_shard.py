import h5py
import pytest
import torch

from mshpc.checkpoint.h5_shard import ShardReader, write_shard
from mshpc.checkpoint.tensor_slice import TensorSlice
from mshpc.errors import CheckpointError


def test_round_trip_keeps_dtype_shape_and_bits(tmp_path):
    items = {
        "model/w": TensorSlice.whole(torch.randn(3, 4)),
        "model/b16": TensorSlice.whole(torch.randn(5).to(torch.bfloat16)),
        "optim.step/w": TensorSlice.whole(torch.tensor(7.0)),
        "optim.exp_avg/w": TensorSlice(torch.arange(6, dtype=torch.float32), (3, 4), start=6),
        "rng/cpu/rank-0": TensorSlice.whole(torch.get_rng_state()),
    }
    entries = write_shard(tmp_path / "shard-00000.h5", items)
    reader = ShardReader(tmp_path)
    for e in entries:
        got = reader.read(e)
        want = items[e.name].tensor.reshape(-1)
        assert got.dtype == want.dtype and torch.equal(got, want), e.name
        assert e.start == items[e.name].start and e.global_shape == items[e.name].global_shape
    reader.close()


def test_plain_h5py_reads_the_shard(tmp_path):
    w = torch.randn(3, 4)
    write_shard(tmp_path / "s.h5", {"model/w": TensorSlice.whole(w)})
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert f["model/w"].shape == (3, 4)
        assert torch.equal(torch.from_numpy(f["model/w"][()]), w)
        assert list(f["model/w"].attrs["global_shape"]) == [3, 4]


def test_flipped_byte_is_named(tmp_path):
    entries = write_shard(tmp_path / "s.h5", {"model/w": TensorSlice.whole(torch.randn(64, 64))})
    with h5py.File(tmp_path / "s.h5", "r") as f:
        offset = f["model/w"].id.get_offset()
    with open(tmp_path / "s.h5", "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"s\.h5:model/w: checksum mismatch for tensor 'model/w'"):
        ShardReader(tmp_path).read(entries[0])


def test_unsupported_dtype_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="complex64 cannot be checkpointed"):
        write_shard(tmp_path / "s.h5", {"x": TensorSlice.whole(torch.zeros(2, dtype=torch.complex64))})

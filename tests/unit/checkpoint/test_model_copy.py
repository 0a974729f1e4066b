"""The model/ copy's check and its rebuild from the masters, on checkpoints written here (the
supervised resume that runs them is tests/faults/test_checkpoint_and_data_faults.py)."""

import dataclasses
import json

import h5py
import pytest
import torch
from support.ckpt_runs import sharded_checkpoint

from mshpc.checkpoint.manifest import read_manifest
from mshpc.checkpoint.model_copy import check_model_copy, fix_checksums, read_model_copy, repair
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.relayout import SPLITS_KEY, splits_extra
from mshpc.checkpoint.tools import verify
from mshpc.errors import CheckpointError
from mshpc.parallel.tp_split import qkv_split

W = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))  # an fp32 master
B = torch.randn(32, generator=torch.Generator().manual_seed(1))


def checkpoint(folder):
    """Masters flat over 2 shards; the model copy whole, `w` in bf16 (a bf16 run's weights)."""
    return sharded_checkpoint(folder, {"master/w": W, "master/b": B}, n_shards=2,
                              whole={"model/w": (W.to(torch.bfloat16), 1), "model/b": (B, 0)})


def flip_byte(folder, shard, dataset, at=5):
    with h5py.File(folder / shard, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(folder / shard, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)
        f.seek(offset + at)
        f.write(bytes([byte[0] ^ 0x10]))


def repaired(folder):
    reader = CheckpointReader(folder, read_manifest(folder))
    try:
        return repair(reader, [e for e in reader.manifest.tensors if e.name.startswith("model/")])
    finally:
        reader.close()


def test_a_corrupt_model_tensor_is_named_and_rebuilt_bitwise_from_the_masters(tmp_path):
    m = checkpoint(tmp_path)
    check_model_copy(tmp_path)  # a sound copy passes
    flip_byte(tmp_path, "shard-00001.h5", "model/w")
    with pytest.raises(CheckpointError, match=r"shard-00001\.h5:model/w: checksum mismatch for tensor 'model/w'"):
        check_model_copy(tmp_path)
    assert verify(tmp_path)[1]  # and `mshpc ckpt verify` rejects it
    [r] = repaired(tmp_path)
    assert (r.tensor, r.file, r.error) == ("model/w", "shard-00001.h5", None)
    assert "checksum mismatch" in r.problem
    assert r.crc32 == next(e.crc32 for e in m.tensors if e.name == "model/w")  # the very bytes saved
    assert fix_checksums(tmp_path, m, [r]) is None and read_manifest(tmp_path).tensors == m.tensors
    check_model_copy(tmp_path)
    assert verify(tmp_path)[1] == []
    with h5py.File(tmp_path / "shard-00001.h5", "r") as f:
        assert f["model/w"].attrs["dtype"] == "bfloat16"


def test_a_wrong_recorded_checksum_is_rewritten_in_the_manifest(tmp_path):
    checkpoint(tmp_path)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    entry = next(t for t in raw["tensors"] if t["name"] == "model/b")
    entry["crc32"] ^= 1  # the bytes are sound; the manifest's record of them is not
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    m = read_manifest(tmp_path)
    [r] = repaired(tmp_path)
    assert r.crc32 == entry["crc32"] ^ 1
    assert fix_checksums(tmp_path, m, [r]) is None
    assert read_manifest(tmp_path) == dataclasses.replace(m, tensors=tuple(
        dataclasses.replace(e, crc32=r.crc32) if e.name == "model/b" else e for e in m.tensors))
    assert verify(tmp_path)[1] == []


def test_without_its_masters_a_bad_copy_is_reported_not_rebuilt(tmp_path):
    sharded_checkpoint(tmp_path, {"master/b": B}, n_shards=2, whole={"model/w": (W, 0)})
    flip_byte(tmp_path, "shard-00000.h5", "model/w")
    [r] = repaired(tmp_path)
    assert r.crc32 is None and "has no tensor 'master/w'" in r.error
    with pytest.raises(CheckpointError, match="model/w: checksum mismatch"):
        check_model_copy(tmp_path)


def test_read_model_copy_joins_tp_parts_by_the_manifests_rule_and_keeps_dtypes(tmp_path):
    # a grouped-query qkv (4 q heads, 2 kv heads of 2 rows) saved as tp=2 parts, one per shard,
    # a replicated bf16 norm once: read whole, by parameter name, as export and generate need it
    split = qkv_split(4, 2, 2)
    qkv = torch.randn(16, 3, generator=torch.Generator().manual_seed(2))
    norm = torch.randn(3).to(torch.bfloat16)
    whole = {f"model/qkv@tp{r}": (split.part(qkv, r, 2), r) for r in range(2)}
    sharded_checkpoint(tmp_path, {"master/norm": norm.float()}, n_shards=2, tp=2,
                       whole={**whole, "model/norm": (norm, 0)}, extras={SPLITS_KEY: splits_extra({"qkv": split})})
    got = read_model_copy(tmp_path)
    assert got.keys() == {"qkv", "norm"}
    assert torch.equal(got["qkv"], qkv) and got["norm"].dtype == torch.bfloat16 and torch.equal(got["norm"], norm)

import dataclasses
import json

import pytest
import torch

from support.ckpt_runs import sharded_checkpoint
from mshpc.checkpoint.manifest import read_manifest
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.errors import CheckpointError


def test_reader_reshards_any_range(tmp_path):
    full = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    sharded_checkpoint(tmp_path, {"optim.exp_avg/w": full}, n_shards=3)
    reader = CheckpointReader(tmp_path, read_manifest(tmp_path))
    assert torch.equal(reader.read_whole("optim.exp_avg/w"), full)
    # a dp=4 rank's range crosses the dp=3 shard boundaries
    for start, numel in [(0, 8), (8, 7), (7, 5), (18, 12), (29, 1)]:
        assert torch.equal(reader.read("optim.exp_avg/w", start, numel), full.reshape(-1)[start:start + numel])
    with pytest.raises(CheckpointError, match="has no tensor 'model/x'"):
        reader.read_whole("model/x")


def test_manifest_round_trip_and_tiling_errors(tmp_path):
    m = sharded_checkpoint(tmp_path, {"optim.exp_avg/w": torch.zeros(4, 4)}, n_shards=2)
    assert read_manifest(tmp_path) == dataclasses.replace(m, created_unix=read_manifest(tmp_path).created_unix)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    raw["tensors"] = raw["tensors"][:1]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="tensor 'optim.exp_avg/w' covers 8 of 16 elements"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json: unreadable"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        read_manifest(tmp_path)

"""The manifest's index: a reader parses the entries of the tensors it asks for and no others,
and a checkpoint without a (usable) index is read whole, as before."""

import dataclasses

import pytest
import torch

from support.ckpt_runs import sharded_checkpoint
from mshpc.checkpoint.catalog import open_catalog
from mshpc.checkpoint.manifest import INDEX_FILE, MANIFEST_FILE, grouped_by_name, read_manifest, render
from mshpc.checkpoint.model_copy import Repair, fix_checksums
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.errors import CheckpointError

TENSORS = {name: torch.arange(600, dtype=torch.float32).reshape(20, 30) + k
           for k, name in enumerate(["master/a", "master/b", "optim.exp_avg/a", "optim.exp_avg/b"])}


def write(folder):
    return sharded_checkpoint(folder, TENSORS, n_shards=3, whole={"model/a": (TENSORS["master/a"].bfloat16(), 1)})


def break_lines_of(folder, name):
    """Make every manifest line of tensor `name` unparseable as an entry, keeping the file's size."""
    path = folder / MANIFEST_FILE
    lines = path.read_text().split("\n")
    broken = [line.replace('"numel":', '"numbl":') if f'"name":"{name}"' in line else line for line in lines]
    assert broken != lines
    path.write_text("\n".join(broken))


def test_a_reader_parses_only_the_entries_of_what_it_reads(tmp_path):
    write(tmp_path)
    break_lines_of(tmp_path, "optim.exp_avg/b")  # another rank's tensor, say
    with pytest.raises(CheckpointError, match="malformed"):
        read_manifest(tmp_path)  # read whole, as before the index, the manifest is unusable
    catalog = open_catalog(tmp_path)
    assert catalog.indexed and catalog.names() == ["master/a", "master/b", "model/a", "optim.exp_avg/a",
                                                   "optim.exp_avg/b"]
    reader = CheckpointReader(tmp_path, catalog)
    before = catalog.bytes_parsed  # the index and the manifest's head
    for name in ("master/a", "optim.exp_avg/a"):
        assert torch.equal(reader.read_whole(name), TENSORS[name])
    lines = [line for line in (tmp_path / MANIFEST_FILE).read_text().split("\n") if '"name":"' in line]
    mine = [line for line in lines if '"name":"master/a"' in line or '"name":"optim.exp_avg/a"' in line]
    assert len(mine) == 6  # three shards each
    assert catalog.bytes_parsed - before == sum(len(line.rstrip(",")) for line in mine)
    assert catalog.bytes_parsed < (tmp_path / MANIFEST_FILE).stat().st_size
    with pytest.raises(CheckpointError, match="malformed"):
        reader.read_whole("optim.exp_avg/b")  # its own tensor's bad line still fails, naming the file
    reader.close()


def test_a_checkpoint_without_an_index_is_read_whole(tmp_path):
    write(tmp_path)
    (tmp_path / INDEX_FILE).unlink()  # as an older mshpc wrote it
    catalog = open_catalog(tmp_path)
    assert not catalog.indexed and catalog.bytes_parsed == (tmp_path / MANIFEST_FILE).stat().st_size
    reader = CheckpointReader(tmp_path, catalog)
    assert all(torch.equal(reader.read_whole(n), t) for n, t in TENSORS.items())
    reader.close()


@pytest.mark.parametrize("damage", ["stale", "garbage"])
def test_an_index_that_does_not_describe_the_manifest_is_ignored(tmp_path, damage):
    m = write(tmp_path)
    if damage == "stale":  # the manifest grew under it: every byte range after the change is off
        text = (tmp_path / MANIFEST_FILE).read_text()
        (tmp_path / MANIFEST_FILE).write_text(text.replace('"config_hash": "abc"', '"config_hash": "abcdef"'))
    else:
        (tmp_path / INDEX_FILE).write_text('{"format": "mshpc-checkpoint-index", "version": 1, "names": 7}')
    catalog = open_catalog(tmp_path)
    assert not catalog.indexed
    reader = CheckpointReader(tmp_path, catalog)
    assert all(torch.equal(reader.read_whole(n), t) for n, t in TENSORS.items())
    assert catalog.manifest().tensors == m.tensors
    reader.close()


def test_an_index_whose_ranges_hold_other_entries_falls_back_to_the_whole_manifest(tmp_path):
    write(tmp_path)
    path = tmp_path / MANIFEST_FILE
    text = path.read_text()  # two names of equal length swapped: same size, wrong ranges
    path.write_text(text.replace('"master/a"', '"master/X"').replace('"master/b"', '"master/a"')
                    .replace('"master/X"', '"master/b"'))
    catalog = open_catalog(tmp_path)
    assert catalog.indexed
    reader = CheckpointReader(tmp_path, catalog)
    assert reader.global_shape("master/a") == (20, 30)
    assert not catalog.indexed  # found out on first use, and read whole
    reader.close()


def test_a_rewritten_manifest_gets_a_matching_index(tmp_path):
    m = write(tmp_path)
    entry = next(e for e in m.tensors if e.name == "model/a")
    # a checksum of another length: every later entry line moves, so the old index would be wrong
    rewritten = Repair("model/a", entry.file, entry.dataset, "checksum mismatch", 7)
    assert len(str(rewritten.crc32)) != len(str(entry.crc32))
    assert fix_checksums(tmp_path, m, [rewritten]) is None
    catalog = open_catalog(tmp_path)
    assert catalog.indexed and [e.crc32 for e in catalog.entries("model/a")] == [7]
    assert catalog.manifest().by_name() == read_manifest(tmp_path).by_name()
    assert catalog.indexed  # every name parsed from its ranges, none fell back


def test_grouped_entries_give_each_name_one_range(tmp_path):
    m = write(tmp_path)  # written shard by shard: each ZeRO tensor's entries lie apart
    _, index = render(m)
    assert max(len(runs) for runs in index["names"].values()) == 3
    _, index = render(dataclasses.replace(m, tensors=grouped_by_name(list(m.tensors))))
    assert [len(runs) for runs in index["names"].values()] == [1] * 5  # as the saver writes them

"""Reading a checkpoint at another tp or pp layout, on synthetic checkpoints: tp parts joined
and re-cut by the rule the manifest carries, the tied head found under the embedding's name."""

import math

import pytest
import torch

from support.ckpt_runs import sharded_checkpoint
from mshpc.checkpoint.manifest import read_manifest
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.relayout import SPLITS_KEY, Relayout, splits_extra
from mshpc.errors import CheckpointError
from mshpc.parallel.tp_split import COLUMNS, QKV_ROWS, ROWS, qkv_split

QKV = torch.arange(18 * 4, dtype=torch.float32).reshape(18, 4)  # [q; k; v] of 6 rows each
PROJ = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) + 100
NORM = torch.ones(4)
SPLITS = {"qkv": QKV_ROWS, "proj": COLUMNS, "tok_embeddings.weight": ROWS}


def _reader(folder, tensors, tp, extras=None):
    sharded_checkpoint(folder, tensors, n_shards=2, tp=tp, extras=extras)
    return CheckpointReader(folder, read_manifest(folder))


def _tp2_checkpoint(folder):
    cut = [("qkv", QKV, QKV_ROWS), ("proj", PROJ, COLUMNS)]
    tensors = {f"master/{n}@tp{r}": split.part(w, r, 2) for n, w, split in cut for r in range(2)}
    return _reader(folder, {**tensors, "master/norm": NORM}, tp=2, extras={SPLITS_KEY: splits_extra(SPLITS)})


def _read_whole(relayout, reader, name):
    shape = relayout.shape(reader, name)
    return relayout.reader(reader)(name, 0, math.prod(shape)).reshape(shape)


def test_tp2_parts_join_for_tp1_and_recut_for_tp3(tmp_path):
    reader = _tp2_checkpoint(tmp_path)
    one = Relayout.build(reader, new_tp=1, new_rank=0, current={}, tied=frozenset())
    assert torch.equal(_read_whole(one, reader, "master/qkv"), QKV)
    assert torch.equal(_read_whole(one, reader, "master/proj"), PROJ)
    assert torch.equal(_read_whole(one, reader, "master/norm"), NORM)  # replicated: passes through
    for r in range(3):
        three = Relayout.build(reader, new_tp=3, new_rank=r, current=SPLITS, tied=frozenset())
        assert torch.equal(_read_whole(three, reader, f"master/qkv@tp{r}"), QKV_ROWS.part(QKV, r, 3))
        assert three.shape(reader, f"master/proj@tp{r}") == (4, 2)
    # a ZeRO range of the re-cut part, as a dp=2 rank at tp=1 asks for it
    assert torch.equal(one.reader(reader)("master/proj", 5, 9), PROJ.reshape(-1)[5:14])
    # every old part of a re-cut weight is requested whole; a replicated one only its range
    assert one.requests(reader, ("master/qkv", 3, 4)) == [("master/qkv@tp0", 0, 36), ("master/qkv@tp1", 0, 36)]
    assert one.requests(reader, ("master/norm", 1, 2)) == [("master/norm", 1, 2)]


def test_tp1_checkpoint_cut_with_this_runs_rule(tmp_path):
    reader = _reader(tmp_path, {"master/qkv": QKV}, tp=1)
    r1 = Relayout.build(reader, new_tp=2, new_rank=1, current=SPLITS, tied=frozenset())
    # rows 3-5 of each of the q, k and v blocks
    assert torch.equal(_read_whole(r1, reader, "master/qkv@tp1"), QKV[[3, 4, 5, 9, 10, 11, 15, 16, 17]])


def test_same_layout_is_the_identity(tmp_path):
    reader = _tp2_checkpoint(tmp_path)
    same = Relayout.build(reader, new_tp=2, new_rank=0, current=SPLITS, tied=frozenset())
    assert same.source("master/qkv@tp0") is None
    assert same.requests(reader, ("master/qkv@tp0", 2, 3)) == [("master/qkv@tp0", 2, 3)]


def test_tied_head_is_read_under_the_embeddings_name_when_missing(tmp_path):
    # a pp=1 checkpoint holds the tied weight once; a pp=2 last stage holds it as lm_head.weight
    emb = torch.randn(7, 4)
    reader = _reader(tmp_path, {"master/tok_embeddings.weight": emb}, tp=1)
    last = Relayout.build(reader, new_tp=1, new_rank=0, current={}, tied=frozenset({"lm_head.weight"}))
    assert torch.equal(_read_whole(last, reader, "master/lm_head.weight"), emb)
    at_tp2 = Relayout.build(reader, new_tp=2, new_rank=1, current={"lm_head.weight": ROWS},
                            tied=frozenset({"lm_head.weight"}))
    assert torch.equal(_read_whole(at_tp2, reader, "master/lm_head.weight@tp1"), emb[3:])


def test_tp_checkpoint_without_its_rules_is_refused_with_the_reason(tmp_path):
    reader = _reader(tmp_path, {"master/qkv@tp0": QKV, "master/qkv@tp1": QKV}, tp=2)
    with pytest.raises(CheckpointError, match="written at parallel.tp=2 without its tp split rules"):
        Relayout.build(reader, new_tp=1, new_rank=0, current={}, tied=frozenset())


@pytest.mark.parametrize("kv,old,new", [(1, 2, 1), (1, 4, 2), (2, 2, 1), (2, 4, 1), (2, 1, 4)])
def test_grouped_query_qkv_reshards_through_the_manifests_rule(tmp_path, kv, old, new):
    # 4 q heads and kv kv heads of 2 rows; saved at tp=old with the rule in the manifest's
    # extras (JSON, as a save writes it), read at tp=new: the parts the new ranks would have cut
    split = qkv_split(4, kv, 2)
    whole = torch.randn((4 + 2 * kv) * 2, 3)
    tensors = {"master/qkv": whole} if old == 1 else {f"master/qkv@tp{r}": split.part(whole, r, old) for r in range(old)}
    reader = _reader(tmp_path, tensors, tp=old, extras={SPLITS_KEY: splits_extra({"qkv": split})} if old > 1 else None)
    for r in range(new):
        name = "master/qkv" if new == 1 else f"master/qkv@tp{r}"
        relayout = Relayout.build(reader, new_tp=new, new_rank=r, current={"qkv": split}, tied=frozenset())
        assert torch.equal(_read_whole(relayout, reader, name), split.part(whole, r, new))

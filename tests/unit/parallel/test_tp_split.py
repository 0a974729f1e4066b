"""The tp cutting rule that apply_tp splits with and checkpoints reshard with."""

import pytest
import torch

from mshpc.parallel.tp_split import COLUMNS, QKV_ROWS, ROWS, TpSplit, chunk_bounds, qkv_split


def test_chunk_bounds_cover_the_range_once():
    assert chunk_bounds(6, 4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2)]  # more chunks than rows: empty ones dropped


def test_rows_columns_and_qkv_blocks_cut_as_megatron_does():
    w = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(ROWS.part(w, 1, 2), w[3:])
    assert torch.equal(COLUMNS.part(w, 0, 2), w[:, :2])
    # [q; k; v] of 2 rows each: rank 1 keeps the second row of each block
    assert torch.equal(QKV_ROWS.part(w, 1, 2), w[[1, 3, 5]])


@pytest.mark.parametrize("split", [ROWS, COLUMNS, QKV_ROWS], ids=["rows", "columns", "qkv"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_join_inverts_part_and_parts_reshard_between_sizes(split, size):
    w = torch.randn(12, 12)
    parts = [split.part(w, r, size) for r in range(size)]
    assert torch.equal(split.join(parts), w)
    # what a checkpoint does at another tp: join the old parts, cut the new one
    assert torch.equal(split.part(split.join(parts), 1, 2), split.part(w, 1, 2))


def test_uneven_vocabulary_rows_join_back():
    w = torch.randn(7, 3)  # 7 rows over 2 ranks: 3 and 4
    parts = [ROWS.part(w, r, 2) for r in range(2)]
    assert [p.shape[0] for p in parts] == [3, 4] and torch.equal(ROWS.join(parts), w)


def test_json_round_trip():
    assert TpSplit.from_json(QKV_ROWS.to_json()) == QKV_ROWS


def test_grouped_query_qkv_splits_kv_heads_when_at_least_tp_and_copies_them_when_fewer():
    # 4 q heads and 2 kv heads of 1 row each: rows [q0 q1 q2 q3 | k0 k1 | v0 v1]
    w = torch.arange(8.0)[:, None]
    split = qkv_split(4, 2, 1)
    assert split.part(w, 1, 2).flatten().tolist() == [2, 3, 5, 7]  # q2 q3 k1 v1
    # tp=4 > 2 kv heads: rank r keeps q r and a copy of kv head r // 2 (Megatron's rule)
    assert [split.part(w, r, 4).flatten().tolist() for r in range(4)] == [
        [0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]]
    # the copies: ranks 0 and 2 own kv heads 0 and 1 (a join reads theirs; the clip norm counts them)
    assert [[(c.lo, c.hi, c.unit, c.owner) for c in split.copies(r, 4)] for r in (0, 1)] == [
        [(1, 2, 0, True), (2, 3, 0, True)], [(1, 2, 0, False), (2, 3, 0, False)]]
    assert split.copies(0, 2) == []  # split, not replicated


@pytest.mark.parametrize("kv", [1, 2, 4])
@pytest.mark.parametrize("old,new", [(1, 2), (2, 4), (4, 2), (4, 1), (2, 1)])
def test_grouped_query_qkv_reshards_between_tp_sizes(kv, old, new):
    split = qkv_split(4, kv, 3)
    w = torch.randn((4 + 2 * kv) * 3, 5)
    parts = [split.part(w, r, old) for r in range(old)]
    assert torch.equal(split.join(parts), w)
    assert all(torch.equal(split.part(split.join(parts), r, new), split.part(w, r, new)) for r in range(new))


def test_multi_head_qkv_keeps_the_three_equal_blocks():
    assert qkv_split(4, 4, 8) == QKV_ROWS


def test_json_round_trip_with_sections_and_old_manifests_still_load():
    split = qkv_split(8, 2, 16)
    assert TpSplit.from_json(split.to_json()) == split
    assert TpSplit.from_json([0, 3]) == QKV_ROWS  # written before sections existed

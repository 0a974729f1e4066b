"""The tp cutting rule that apply_tp splits with and checkpoints reshard with."""

import pytest
import torch

from mshpc.parallel.tp_split import COLUMNS, GATE_UP_ROWS, QKV_ROWS, ROWS, TpSplit, chunk_bounds


def test_chunk_bounds_cover_the_range_once():
    assert chunk_bounds(6, 4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2)]  # more chunks than rows: empty ones dropped


def test_rows_columns_and_qkv_blocks_cut_as_megatron_does():
    w = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(ROWS.part(w, 1, 2), w[3:])
    assert torch.equal(COLUMNS.part(w, 0, 2), w[:, :2])
    # [q; k; v] of 2 rows each: rank 1 keeps the second row of each block
    assert torch.equal(QKV_ROWS.part(w, 1, 2), w[[1, 3, 5]])
    # SwiGLU's [gate; up] of 3 rows each: rank 0 keeps gate rows 0 and up rows 0 (3 + 0)
    assert torch.equal(GATE_UP_ROWS.part(w, 0, 2), w[[0, 3]])
    assert torch.equal(GATE_UP_ROWS.part(w, 1, 2), w[[1, 2, 4, 5]])


@pytest.mark.parametrize("split", [ROWS, COLUMNS, QKV_ROWS, GATE_UP_ROWS], ids=["rows", "columns", "qkv", "gate-up"])
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
    assert TpSplit.from_json(GATE_UP_ROWS.to_json()) == GATE_UP_ROWS

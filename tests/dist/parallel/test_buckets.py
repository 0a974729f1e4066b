"""Bucket layout: every parameter element is owned by exactly one dp rank, buckets respect their
size and follow backward order, and only the shard cuts depend on dp."""

import pytest

from mshpc.parallel.buckets import build_buckets

NUMELS = [640, 64, 3072, 1024, 7, 4096, 4096, 64, 1]  # embedding first, as registered


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_each_element_is_owned_once(dp):
    owned = [[0] * n for n in NUMELS]
    for layout in build_buckets(NUMELS, bucket_numel=4096, dp=dp):
        assert layout.numel % dp == 0 and layout.numel - sum(s.numel for s in layout.slots) < dp
        for rank in range(dp):
            for piece in layout.pieces(rank):
                assert 0 <= piece.shard_offset and piece.shard_offset + piece.numel <= layout.shard_numel
                for k in range(piece.param_start, piece.param_start + piece.numel):
                    owned[piece.index][k] += 1
    assert all(count == 1 for counts in owned for count in counts)


def test_buckets_follow_backward_order_and_their_size():
    layouts = build_buckets(NUMELS, bucket_numel=4096, dp=2)
    order = [s.index for layout in layouts for s in layout.slots]
    assert order == list(reversed(range(len(NUMELS))))
    for layout in layouts:
        used = sum(s.numel for s in layout.slots)
        assert used <= 4096 or len(layout.slots) == 1  # a larger parameter goes alone
    cuts = [[s.index for s in layout.slots] for layout in layouts]
    assert cuts == [[s.index for s in layout.slots] for layout in build_buckets(NUMELS, 4096, dp=4)]


def test_a_tied_weight_gets_a_bucket_of_its_own():
    # the embedding (index 0) and a small parameter in the middle (index 4) go alone; the rest pack as before
    layouts = build_buckets(NUMELS, bucket_numel=4096, dp=2, alone=frozenset({0, 4}))
    cuts = [[s.index for s in layout.slots] for layout in layouts]
    assert [0] in cuts and [4] in cuts
    assert [s.index for layout in layouts for s in layout.slots] == list(reversed(range(len(NUMELS))))
    assert all(len(c) == 1 or not {0, 4} & set(c) for c in cuts)

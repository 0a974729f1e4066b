"""Which tp rank holds each token's row: the routing every rank computes alike from the token
ids, so that the embedding's uneven all-to-all needs no sizes exchanged."""

import torch

from mshpc.parallel.tp_split import chunk_bounds
from mshpc.parallel.vocab_embedding import vocab_owner


def test_each_token_goes_to_the_rank_whose_part_of_the_table_holds_it():
    for vocab, tp in ((7, 2), (7, 4), (257, 2), (50304, 8)):
        idx = torch.arange(vocab).view(1, -1)
        owner = vocab_owner(idx, vocab, tp)[0]
        for rank, (lo, hi) in enumerate(chunk_bounds(vocab, tp)):
            assert (owner[lo:hi] == rank).all(), (vocab, tp, rank)


def test_an_id_outside_the_vocabulary_goes_nowhere():
    owner = vocab_owner(torch.tensor([[-1, 0, 6, 7, 100]]), 7, 2)
    assert owner.tolist() == [[-1, 0, 1, -1, -1]]

"""Which dp rank saves which whole weight: every weight once, the bytes spread evenly."""

from mshpc.checkpoint.state import model_slices, spread
from mshpc.config import ModelConfig
from mshpc.model.gpt import GPT


def test_spread_gives_each_size_one_owner_largest_first():
    assert spread([10, 1, 7, 4], 2) == [0, 0, 1, 1]  # 10 + 1 | 7 + 4
    assert spread([5, 5, 5], 1) == [0, 0, 0]
    assert spread([3], 4) == [0]


def test_dp_ranks_share_the_model_weights_each_saved_once():
    model = GPT(ModelConfig(n_layer=4, d_model=64, n_head=2, seq_len=16))
    whole = model_slices(model)
    for dp in (2, 3, 8):
        parts = [model_slices(model, dp_rank=r, dp=dp) for r in range(dp)]
        names = [n for p in parts for n in p]
        assert sorted(names) == sorted(whole)  # each weight by exactly one rank
        loads = [sum(s.tensor.numel() * s.tensor.element_size() for s in p.values()) for p in parts]
        largest = max(s.tensor.numel() * s.tensor.element_size() for s in whole.values())
        # greedy largest-first: no rank is more than one weight above the mean
        assert max(loads) - sum(loads) / dp <= largest, (dp, loads)

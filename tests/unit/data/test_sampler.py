"""The sampler: deterministic, resumable without replay, partitioned over dp, epoch-complete."""

from __future__ import annotations

import numpy as np
import pytest

from mshpc.data.sampler import SequenceSampler
from mshpc.errors import DataError

SEQ = 16
N_TOKENS = 1000 * SEQ + 1  # exactly 1000 windows


def test_same_arguments_same_batches_other_seed_differs() -> None:
    a, b = SequenceSampler(N_TOKENS, SEQ, 8, seed=1), SequenceSampler(N_TOKENS, SEQ, 8, seed=1)
    c = SequenceSampler(N_TOKENS, SEQ, 8, seed=2)
    for step in (0, 1, 124, 125, 999):
        np.testing.assert_array_equal(a.starts(step, 0, 1), b.starts(step, 0, 1))
    assert not np.array_equal(np.r_[[a.starts(s, 0, 1) for s in range(5)]],
                              np.r_[[c.starts(s, 0, 1) for s in range(5)]])


def test_starts_are_window_aligned_and_in_bounds() -> None:
    sampler = SequenceSampler(N_TOKENS + 7, SEQ, 8, seed=0)  # a ragged tail is left unused
    assert sampler.n_windows == 1000
    starts = np.concatenate([sampler.starts(s, 0, 1) for s in range(300)])
    assert starts.dtype == np.int64 and np.all(starts % SEQ == 0)
    assert starts.min() >= 0 and starts.max() + SEQ + 1 <= N_TOKENS


def test_resume_needs_no_history() -> None:
    walked = SequenceSampler(N_TOKENS, SEQ, 24, seed=3)
    history = [walked.starts(step, 0, 1) for step in range(130)]  # crosses three epochs
    for k in (0, 41, 42, 129):
        fresh = SequenceSampler(N_TOKENS, SEQ, 24, seed=3)
        np.testing.assert_array_equal(fresh.starts(k, 0, 1), history[k])


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_ranks_partition_the_global_batch(dp: int) -> None:
    sampler = SequenceSampler(N_TOKENS, SEQ, 8, seed=5)
    for step in (0, 7, 124, 125):  # 125 * 8 = 1000: the first batch of epoch 1
        ranks = [sampler.starts(step, r, dp) for r in range(dp)]
        assert all(len(r) == 8 // dp for r in ranks)
        np.testing.assert_array_equal(np.concatenate(ranks), sampler.starts(step, 0, 1))


def test_each_epoch_covers_every_window_once() -> None:
    n_windows, batch = 10, 4  # batches straddle epoch boundaries
    sampler = SequenceSampler(n_windows * SEQ + 1, SEQ, batch, seed=9)
    seen = np.concatenate([sampler.windows(step, 0, 1) for step in range(10)])  # 4 epochs
    epochs = seen.reshape(4, n_windows)
    for perm in epochs:
        np.testing.assert_array_equal(np.sort(perm), np.arange(n_windows))
    assert len({tuple(p) for p in epochs}) > 1  # reshuffled per epoch
    assert [sampler.epoch_of(s) for s in (0, 2, 3, 5, 9)] == [0, 0, 1, 2, 3]


def test_dataset_smaller_than_one_window_is_rejected() -> None:
    with pytest.raises(DataError, match="fewer than one window of seq_len \\+ 1 = 17"):
        SequenceSampler(SEQ, SEQ, 1, seed=0)
    SequenceSampler(SEQ + 1, SEQ, 1, seed=0)  # exactly one window is enough


def test_unshuffled_sampler_walks_the_windows_in_order() -> None:
    # the validation windows: batch b of every evaluation is windows b*G .. b*G + G - 1, each dp
    # rank its contiguous share, wrapping around a split smaller than the batches asked for
    s = SequenceSampler(n_tokens=10 * 4 + 1, seq_len=4, global_batch=4, seed=7, shuffle=False)
    assert s.windows(0, 0, 1).tolist() == [0, 1, 2, 3]
    assert s.windows(1, 1, 2).tolist() == [6, 7]
    assert s.windows(2, 0, 1).tolist() == [8, 9, 0, 1]

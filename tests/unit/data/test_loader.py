"""The background batch loader: right batches, resumable, dp-partitioned, failing and closing cleanly."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mshpc.data.loader import BatchLoader, build_loader
from mshpc.data.sampler import SequenceSampler
from mshpc.data.shards import TokenDataset
from mshpc.errors import DataError

SEQ, BATCH, SEED = 32, 8, 7


def take(loader: BatchLoader, n: int) -> list[torch.Tensor]:
    """The next `n` batches of `loader`, which is closed afterwards."""
    with loader:
        return [next(loader) for _ in range(n)]


def test_batches_are_the_sampled_windows(random_dataset: TokenDataset) -> None:
    loader = build_loader(random_dataset, SEQ, BATCH, 0, 1, SEED, 0, prefetch_batches=2)
    batches = take(loader, 3)
    assert loader.step == 3 and loader.wait_s >= 0.0
    sampler = SequenceSampler(random_dataset.n_tokens, SEQ, BATCH, SEED)
    for step, batch in enumerate(batches):
        assert batch.dtype == torch.int64 and batch.shape == (BATCH, SEQ + 1)
        want = [random_dataset.tokens(int(s), SEQ + 1) for s in sampler.starts(step, 0, 1)]
        np.testing.assert_array_equal(batch.numpy(), np.stack(want))


def test_loader_started_at_k_matches_loader_from_zero(random_dataset: TokenDataset) -> None:
    from_zero = take(build_loader(random_dataset, SEQ, BATCH, 0, 1, SEED, 0, 2), 23)
    resumed = take(build_loader(random_dataset, SEQ, BATCH, 0, 1, SEED, 20, 2), 3)
    for a, b in zip(from_zero[20:], resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dp", [2, 4])
def test_rank_batches_concatenate_to_the_global_batch(random_dataset: TokenDataset, dp: int) -> None:
    whole = take(build_loader(random_dataset, SEQ, BATCH, 0, 1, SEED, 5, 1), 2)
    parts = [take(build_loader(random_dataset, SEQ, BATCH, r, dp, SEED, 5, 1), 2) for r in range(dp)]
    for i in range(2):
        assert all(p[i].shape == (BATCH // dp, SEQ + 1) for p in parts)
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])


def test_thread_exception_reaches_the_consumer(random_dataset: TokenDataset) -> None:
    with build_loader(random_dataset, SEQ, BATCH, 0, 1, SEED, 0, prefetch_batches=1) as loader:
        random_dataset.close()  # the thread's next read fails
        with pytest.raises(DataError, match="is closed"):
            for _ in range(4):  # at most the queued batch and the one in hand come first
                next(loader)
        with pytest.raises(DataError, match="is closed"):
            next(loader)  # and it stays failed


def test_close_is_prompt_even_with_a_full_queue(random_dataset: TokenDataset) -> None:
    loader = build_loader(random_dataset, SEQ, BATCH, 0, 1, SEED, 0, prefetch_batches=2)
    time.sleep(0.2)  # let the thread fill the queue and block on it
    t0 = time.perf_counter()
    loader.close()
    assert time.perf_counter() - t0 < 1.0
    assert not loader._thread.is_alive()
    with pytest.raises(StopIteration):
        next(loader)

"""The background loaders (torch and DALI): the sampled windows, resumable, dp-partitioned, equal
to each other, ready ahead of a slower step, and failing and closing cleanly."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mshpc.batch import Batch, segment_ids
from mshpc.config import DataConfig
from mshpc.data.loader import BatchLoader
from mshpc.data.pipeline import build_loader
from mshpc.data.sampler import SequenceSampler
from mshpc.data.shards import TokenDataset
from mshpc.errors import DataError
from support.token_data import wait_until_full

SEQ, BATCH, SEED = 32, 8, 7


@pytest.fixture(params=["torch", "dali"])
def loader(request: pytest.FixtureRequest) -> str:
    """Each loader by name; DALI's only where it runs (see the `dali` fixture)."""
    if request.param == "dali":
        request.getfixturevalue("dali")
    return request.param


def start(dataset: TokenDataset, loader: str = "torch", dp_rank: int = 0, dp: int = 1, step: int = 0,
          prefetch: int = 2, doc_mask: bool = False) -> BatchLoader:
    cfg = DataConfig(loader=loader, seed=SEED, prefetch_batches=prefetch, doc_mask=doc_mask)
    return build_loader(cfg, dataset, SEQ, BATCH, dp_rank, dp, step)


def take(loader: BatchLoader, n: int) -> list[Batch]:
    """The next `n` batches of `loader`, which is closed afterwards."""
    with loader:
        return [next(loader) for _ in range(n)]


def test_batches_are_the_sampled_windows(random_dataset: TokenDataset, loader: str) -> None:
    source = start(random_dataset, loader)
    assert source.description.startswith(f"{loader} (data.loader={loader})")
    batches = take(source, 3)
    assert source.step == 3 and source.wait_s >= 0.0
    sampler = SequenceSampler(random_dataset.n_tokens, SEQ, BATCH, SEED)
    for step, batch in enumerate(batches):
        assert batch.tokens.dtype == torch.int64 and batch.tokens.shape == (BATCH, SEQ + 1)
        assert batch.segments is None
        want = [random_dataset.tokens(int(s), SEQ + 1) for s in sampler.starts(step, 0, 1)]
        np.testing.assert_array_equal(batch.tokens.numpy(), np.stack(want))


def test_loader_started_at_k_matches_loader_from_zero(random_dataset: TokenDataset, loader: str) -> None:
    from_zero = take(start(random_dataset, loader), 23)
    resumed = take(start(random_dataset, loader, step=20), 3)
    for a, b in zip(from_zero[20:], resumed):
        assert a.equal(b)


@pytest.mark.parametrize("dp", [2, 4])
def test_rank_batches_concatenate_to_the_global_batch(random_dataset: TokenDataset, dp: int) -> None:
    whole = take(start(random_dataset, step=5, prefetch=1), 2)
    parts = [take(start(random_dataset, dp_rank=r, dp=dp, step=5, prefetch=1), 2) for r in range(dp)]
    for i in range(2):
        assert all(p[i].tokens.shape == (BATCH // dp, SEQ + 1) for p in parts)
        assert torch.equal(torch.cat([p[i].tokens for p in parts]), whole[i].tokens)


@pytest.mark.usefixtures("dali")
@pytest.mark.parametrize("doc_mask", [False, True])
def test_dali_yields_the_torch_loaders_batches(random_dataset: TokenDataset, doc_mask: bool) -> None:
    for dp, dp_rank, first in [(1, 0, 0), (2, 1, 3), (4, 2, 11)]:
        args = dict(dp_rank=dp_rank, dp=dp, step=first, doc_mask=doc_mask)
        torch_batches = take(start(random_dataset, "torch", **args), 6)
        dali_batches = take(start(random_dataset, "dali", **args), 6)
        for a, b in zip(torch_batches, dali_batches):
            assert a.equal(b), (dp, dp_rank, first)
            assert (b.segments is not None) == doc_mask


def test_segments_count_the_documents_before_each_position() -> None:
    eos = 9
    inputs = torch.tensor([[1, 2, eos, 3, eos, eos, 4], [eos, 5, 6, 7, 8, 1, 2]])
    want = torch.tensor([[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]], dtype=torch.int32)
    assert torch.equal(segment_ids(inputs, eos), want)


def test_doc_mask_segments_follow_the_datasets_document_starts(random_dataset: TokenDataset) -> None:
    batches = take(start(random_dataset, doc_mask=True), 4)
    sampler = SequenceSampler(random_dataset.n_tokens, SEQ, BATCH, SEED)
    doc_starts = random_dataset.doc_starts()
    for step, batch in enumerate(batches):
        for row, first in enumerate(sampler.starts(step, 0, 1)):
            positions = first + np.arange(SEQ)
            # document index of each stream position, relative to that of the row's first token
            doc = np.searchsorted(doc_starts, positions, side="right")
            np.testing.assert_array_equal(batch.segments[row].numpy(), doc - doc[0])
    assert any(int(b.segments.max()) > 0 for b in batches)  # some rows do cross a document


def test_a_step_slower_than_the_loader_never_waits(random_dataset: TokenDataset, loader: str) -> None:
    """The step here ends only once the loader is full, so it is slower by construction; then
    no `next()` may find its batch missing. Counted, not timed: load cannot make it flake."""
    with start(random_dataset, loader, prefetch=3, doc_mask=True) as source:
        for _ in range(10):
            wait_until_full(source, 3)
            batch = next(source)
            assert batch.segments is not None
        assert source.stalls == 0


def test_thread_exception_reaches_the_consumer(random_dataset: TokenDataset, loader: str) -> None:
    with start(random_dataset, loader, prefetch=1) as source:
        random_dataset.close()  # the thread's next read fails
        with pytest.raises(DataError, match="is closed"):
            for _ in range(8):  # at most the queued batches and the one in hand come first
                next(source)
        with pytest.raises(DataError, match="is closed"):
            next(source)  # and it stays failed


def test_close_is_prompt_even_with_a_full_queue(random_dataset: TokenDataset) -> None:
    loader = start(random_dataset)
    time.sleep(0.2)  # let the thread fill the queue and block on it
    t0 = time.perf_counter()
    loader.close()
    assert time.perf_counter() - t0 < 1.0
    assert not loader._thread.is_alive()
    with pytest.raises(StopIteration):
        next(loader)

"""Weighted blends of token sources (`data.sources`), Megatron's weighting made a pure function.

Megatron's BlendedDataset gives global sample i to the source whose count lags its weight most
(helpers.cpp, build_blending_indices: argmax over d of w_d * max(i, 1) - count_d), over an index
it builds for the whole run. Here that rule lays out one block of PLAN_BLOCK samples once; block
b repeats it, so global sample g = b * PLAN_BLOCK + i is source src[i]'s sample
b * count[src[i]] + rank[i]: the same interleaving, computed for any g without an index or a
replay, so a resumed run reads exactly the windows an uninterrupted one reads. Each source's k-th
sample is its own shuffled window (data/sampler.py, seeded with (seed, source, epoch)), so each
source walks its epochs on its own. A share differs from its weight by under 1/PLAN_BLOCK.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mshpc.data.sampler import SequenceSampler, samples

PLAN_BLOCK = 10_000


def block_plan(weights: Sequence[float], block: int = PLAN_BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source of each sample of a block, its number among that source's samples in the block,
    each source's samples per block), by Megatron's greedy rule; weights are normalized here."""
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    counts = np.zeros(len(w), dtype=np.int64)
    src = np.empty(block, dtype=np.int64)
    rank = np.empty(block, dtype=np.int64)
    for i in range(block):
        d = int(np.argmax(w * max(i, 1) - counts))
        src[i], rank[i] = d, counts[d]
        counts[d] += 1
    return src, rank, counts


class BlendSampler:
    """Maps (step, dp rank) to (source, window) pairs of a blend; a pure function of its
    arguments, the weights and the seed."""

    def __init__(self, n_tokens: Sequence[int], weights: Sequence[float], seq_len: int, global_batch: int,
                 seed: int, shuffle: bool = True) -> None:
        assert len(n_tokens) == len(weights) >= 1, (n_tokens, weights)
        self.seq_len, self.global_batch = seq_len, global_batch
        self.weights = [float(x) / float(sum(weights)) for x in weights]
        self.samplers = [SequenceSampler(n, seq_len, global_batch, seed, shuffle, key=(d,))
                         for d, n in enumerate(n_tokens)]
        self._src, self._rank, self.per_block = block_plan(weights)

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, the source's own sample number) of global samples `g`."""
        block, i = np.divmod(g, PLAN_BLOCK)
        src = self._src[i]
        return src, block * self.per_block[src] + self._rank[i]

    def source_windows(self, step: int, dp_rank: int, dp_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of each sequence of rank `dp_rank`'s batch at `step`."""
        src, k = self.locate(samples(step, dp_rank, dp_size, self.global_batch))
        windows = np.empty(len(k), dtype=np.int64)
        for d in np.unique(src):
            mask = src == d
            windows[mask] = self.samplers[int(d)].window_of(k[mask])
        return src, windows

    def epochs(self, steps: int) -> list[float]:
        """How many epochs of each source `steps` steps read."""
        total = steps * self.global_batch
        drawn = [total // PLAN_BLOCK * int(n) for n in self.per_block]
        rest, _ = self.locate(np.arange(total // PLAN_BLOCK * PLAN_BLOCK, total, dtype=np.int64))
        drawn = [n + int((rest == d).sum()) for d, n in enumerate(drawn)]
        return [n / s.n_windows for n, s in zip(drawn, self.samplers, strict=True)]

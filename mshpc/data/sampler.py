"""Resumable sampling: which token windows each data-parallel rank trains on at each step."""

from __future__ import annotations

import numpy as np

from mshpc.errors import DataError


class SequenceSampler:
    """Maps (step, dp rank) to window start offsets; a pure function of its arguments and the seed.

    The stream is cut into N = (n_tokens - 1) // seq_len windows of seq_len + 1 tokens, window i
    starting at i * seq_len (neighbours share one token: the last target of i is the first input of
    i + 1). Global sample g = step * global_batch + j is window perm_e[g % N] of epoch e = g // N,
    where perm_e is a permutation drawn from PCG64 seeded with (seed, e). Resuming needs no replay.
    With `shuffle` False every epoch is in order: the validation windows, the same every time.
    """

    def __init__(self, n_tokens: int, seq_len: int, global_batch: int, seed: int,
                 shuffle: bool = True, key: tuple[int, ...] = ()) -> None:
        assert seq_len >= 1 and global_batch >= 1, (seq_len, global_batch)
        self.n_windows = (n_tokens - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"dataset has {n_tokens} tokens, fewer than one window of seq_len + 1 = "
                            f"{seq_len + 1} (use a bigger corpus or a smaller model.seq_len)")
        if seed < 0:
            raise DataError(f"data.seed={seed} must be >= 0")
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.key = key  # mixed into the seed: a blend's source number (data/blend.py)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            # Keep two epochs: a batch that straddles an epoch boundary needs both.
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, *self.key, epoch]))
                self._perms[epoch] = rng.permutation(self.n_windows)
            else:
                self._perms[epoch] = np.arange(self.n_windows)
        return self._perms[epoch]

    def epoch_of(self, step: int) -> int:
        """The epoch that the first sample of `step` belongs to."""
        return step * self.global_batch // self.n_windows

    def windows(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """Window numbers (int64) of rank `dp_rank`'s contiguous chunk of the global batch of `step`."""
        return self.window_of(samples(step, dp_rank, dp_size, self.global_batch))

    def window_of(self, g: np.ndarray) -> np.ndarray:
        """Window numbers (int64) of global samples `g` (int64) of this stream."""
        epochs, slots = np.divmod(g, self.n_windows)
        out = np.empty(len(g), dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._perm(int(epoch))[slots[mask]]
        return out

    def starts(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """Token start offsets (int64) of rank `dp_rank`'s local batch at `step`."""
        return self.windows(step, dp_rank, dp_size) * self.seq_len

    def source_windows(self, step: int, dp_rank: int, dp_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of each sequence of rank `dp_rank`'s batch: the one source is 0."""
        windows = self.windows(step, dp_rank, dp_size)
        return np.zeros(len(windows), dtype=np.int64), windows


def samples(step: int, dp_rank: int, dp_size: int, global_batch: int) -> np.ndarray:
    """Global sample numbers (int64) of rank `dp_rank`'s contiguous chunk of the batch of `step`."""
    assert step >= 0 and dp_size >= 1 and 0 <= dp_rank < dp_size, (step, dp_rank, dp_size)
    assert global_batch % dp_size == 0, (global_batch, dp_size)
    local = global_batch // dp_size
    return step * global_batch + dp_rank * local + np.arange(local, dtype=np.int64)

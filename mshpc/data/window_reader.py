"""The one function that builds a step's `Batch` from the token sources.

Every loader (the torch thread, DALI, the per-node reader and its clients) yields exactly the
`Batch` that `WindowReader.batch` builds for the same (seed, step, dp rank, dp size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from mshpc.batch import Batch, with_segments
from mshpc.errors import DataError


class TokenSource(Protocol):
    """A token stream training reads windows of: a prepared dataset (data/shards.py) or a
    Megatron .bin/.idx pair (data/indexed.py)."""

    @property
    def path(self) -> object: ...

    @property
    def n_tokens(self) -> int: ...

    @property
    def dtype(self) -> np.dtype: ...

    def tokens(self, start: int, length: int) -> np.ndarray: ...

    def close(self) -> None: ...


class WindowSampler(Protocol):
    seq_len: int
    global_batch: int

    def source_windows(self, step: int, dp_rank: int, dp_size: int) -> tuple[np.ndarray, np.ndarray]: ...


class WindowReader:
    """Reads the packed, shuffled token windows of any dp rank's batch straight from the sources.

    Packing is the sampler's: each sequence is a window of one source's concatenated document
    stream; shuffling is its per-epoch permutation; a blend's sampler also picks the source
    (data/blend.py). `eos_id` None leaves out the segment ids. Every id is checked against
    `vocab_size`, so a source whose ids do not fit the model stops with one line.
    """

    def __init__(self, sources: TokenSource | Sequence[TokenSource], sampler: WindowSampler, dp_size: int,
                 eos_id: int | None, vocab_size: int | None = None) -> None:
        assert sampler.global_batch % dp_size == 0, (sampler.global_batch, dp_size)
        self.sources = list(sources) if isinstance(sources, Sequence) else [sources]
        self.sampler = sampler
        self.dp_size = dp_size
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self.dtype = max((s.dtype for s in self.sources), key=lambda d: d.itemsize)

    @property
    def dataset(self) -> TokenSource:
        """The first source (the only one outside a blend)."""
        return self.sources[0]

    @property
    def local_batch(self) -> int:
        return self.sampler.global_batch // self.dp_size

    def windows(self, step: int, dp_rank: int) -> np.ndarray:
        """(b, s + 1) tokens in `dtype` (what DALI takes in)."""
        width = self.sampler.seq_len + 1
        src, windows = self.sampler.source_windows(step, dp_rank, self.dp_size)
        out = np.empty((len(windows), width), dtype=self.dtype)
        for row, (d, w) in enumerate(zip(src.tolist(), windows.tolist(), strict=True)):
            out[row] = self.sources[d].tokens(w * self.sampler.seq_len, width)
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            row = int(np.argmax(out.max(axis=1) >= self.vocab_size))
            raise DataError(f"{self.sources[int(src[row])].path}: token id {int(out[row].max())} in window "
                            f"{int(windows[row])} is >= model.vocab_size={self.vocab_size} (was it made "
                            "with another tokenizer? set data.tokenizer or model.vocab_size)")
        return out

    def batch(self, step: int, dp_rank: int) -> Batch:
        return with_segments(torch.from_numpy(self.windows(step, dp_rank).astype(np.int64)), self.eos_id)

    def close(self) -> None:
        for source in self.sources:
            source.close()

"""The one function that builds a step's `Batch` from the shards.

Every loader (the torch thread, DALI, the per-node reader and its clients) yields exactly the
`Batch` that `WindowReader.batch` builds for the same (seed, step, dp rank, dp size).
"""

from __future__ import annotations

import numpy as np
import torch

from mshpc.batch import Batch, with_segments
from mshpc.data.sampler import SequenceSampler
from mshpc.data.shards import TokenDataset


class WindowReader:
    """Reads the packed, shuffled token windows of any dp rank's batch straight from the shards.

    Packing is the sampler's: each sequence is a window of the concatenated document stream;
    shuffling is its per-epoch permutation. `eos_id` None leaves out the segment ids.
    """

    def __init__(self, dataset: TokenDataset, sampler: SequenceSampler, dp_size: int,
                 eos_id: int | None) -> None:
        assert sampler.global_batch % dp_size == 0, (sampler.global_batch, dp_size)
        self.dataset = dataset
        self.sampler = sampler
        self.dp_size = dp_size
        self.eos_id = eos_id

    @property
    def local_batch(self) -> int:
        return self.sampler.global_batch // self.dp_size

    def windows(self, step: int, dp_rank: int) -> np.ndarray:
        """(b, s + 1) tokens in the dataset's own dtype (what DALI takes in)."""
        width = self.sampler.seq_len + 1
        starts = self.sampler.starts(step, dp_rank, self.dp_size)
        return np.stack([self.dataset.tokens(int(s), width) for s in starts])

    def batch(self, step: int, dp_rank: int) -> Batch:
        return with_segments(torch.from_numpy(self.windows(step, dp_rank).astype(np.int64)), self.eos_id)

"""What a loader yields for one step: packed token windows and their document segments.

A leaf value (torch only), so the pipeline schedule and the train loop can take a `Batch` without
importing the data loaders; `mshpc.data.window_reader` builds it from the shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    """One rank's batch of a step: packed token windows and, with document masks, segment ids.

    tokens (b, s + 1) int64: inputs are tokens[:, :-1], targets tokens[:, 1:]. segments (b, s)
    int32 or None: the document number of each input position, counted from 0 in each row.
    """

    tokens: torch.Tensor
    segments: torch.Tensor | None = None

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1]  # (b, s)

    @property
    def targets(self) -> torch.Tensor:
        return self.tokens[:, 1:]  # (b, s)

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        segments = None if self.segments is None else self.segments.to(device, non_blocking=non_blocking)
        return Batch(self.tokens.to(device, non_blocking=non_blocking), segments)

    def pin(self) -> Batch:
        """A copy in page-locked memory, when on the host (a device batch is returned as is)."""
        if self.tokens.is_cuda:
            return self
        segments = None if self.segments is None else self.segments.pin_memory()
        return Batch(self.tokens.pin_memory(), segments)

    def split(self, rows: int) -> list[Batch]:
        """Micro-batches of `rows` sequences each (views, no copy)."""
        tokens = self.tokens.split(rows)
        if self.segments is None:
            return [Batch(t) for t in tokens]
        return [Batch(t, s) for t, s in zip(tokens, self.segments.split(rows), strict=True)]

    def equal(self, other: Batch) -> bool:
        """Same tokens and same segments (both None counts as the same)."""
        mine, theirs = self.segments, other.segments
        if mine is None or theirs is None:
            same_segments = mine is None and theirs is None
        else:
            same_segments = torch.equal(mine.cpu(), theirs.cpu())
        return same_segments and torch.equal(self.tokens.cpu(), other.tokens.cpu())


def segment_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document number (int32) of each position of `inputs` (b, s): the count of eos tokens
    strictly before it in its row. An eos closes its own document (Megatron-LM's
    reset_attention_mask convention), so the next document starts after it."""
    is_eos = (inputs == eos_id).to(torch.int32)
    return is_eos.cumsum(dim=-1, dtype=torch.int32) - is_eos


def with_segments(tokens: torch.Tensor, eos_id: int | None) -> Batch:
    """The Batch of int64 `tokens` (b, s + 1); segments are computed when `eos_id` is given."""
    return Batch(tokens, None if eos_id is None else segment_ids(tokens[:, :-1], eos_id))

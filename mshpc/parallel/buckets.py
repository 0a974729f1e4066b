"""Bucket layout for the ZeRO engine: which parameters share one collective, and which flat range
of each bucket every dp rank owns.

Pure arithmetic on parameter sizes, so every rank derives the same layout without talking. A
bucket is the flat concatenation of its parameters, padded to a multiple of dp; dp rank r owns
elements [r * shard_numel, (r + 1) * shard_numel) of it (Megatron's distributed optimizer
layout): the reduce-scatter output and the all-gather input are then one contiguous shard.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One parameter's place in its bucket."""

    index: int  # position in the engine's parameter list
    offset: int  # first element in the bucket's flat buffer
    numel: int


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that one dp rank owns: a flat range of the parameter."""

    index: int  # position in the engine's parameter list
    param_start: int  # first element within the flattened parameter
    numel: int
    shard_offset: int  # first element within the rank's shard of the bucket


@dataclass(frozen=True)
class BucketLayout:
    slots: tuple[Slot, ...]
    numel: int  # padded: a multiple of dp
    dp: int

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp

    def pieces(self, rank: int) -> list[Piece]:
        """The non-empty parts of this bucket's parameters that dp rank `rank` owns."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for slot in self.slots:
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                out.append(Piece(slot.index, start - slot.offset, end - start, start - lo))
        return out


def build_buckets(numels: list[int], bucket_numel: int, dp: int,
                  alone: frozenset[int] = frozenset()) -> list[BucketLayout]:
    """Pack parameters (given in registration order) into buckets in reverse order, the order in
    which backward produces their gradients: each bucket holds at most `bucket_numel` elements,
    except that a larger parameter gets a bucket of its own, as does every index in `alone` (a
    tied weight, whose shard must cover the same elements on every rank that holds a copy).
    Boundaries do not depend on dp (only the padding does), so a checkpoint's slices differ
    across dp only in where shards cut."""
    buckets: list[list[Slot]] = [[]] if numels else []
    filled = 0
    for index in reversed(range(len(numels))):
        current = buckets[-1]
        if current and (filled + numels[index] > bucket_numel or index in alone or current[-1].index in alone):
            buckets.append([])
            filled = 0
        buckets[-1].append(Slot(index, filled, numels[index]))
        filled += numels[index]
    layouts = []
    for slots in buckets:
        used = sum(s.numel for s in slots)
        layouts.append(BucketLayout(tuple(slots), -(-used // dp) * dp, dp))
    return layouts

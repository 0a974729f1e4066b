"""How tensor parallelism cuts a weight, as data: the one rule `apply_tp` splits a model with
and a checkpoint reshards with, so a weight saved at one tp joins and re-splits exactly at
another (Megatron's dist-ckpt does the same from its sharded-tensor metadata)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `chunks` near-equal pieces of range(length); empty pieces dropped."""
    cuts = [length * c // chunks for c in range(chunks + 1)]
    return [(lo, hi) for lo, hi in pairwise(cuts) if hi > lo]


@dataclass(frozen=True)
class TpSplit:
    dim: int  # 0: rows (column- and vocab-parallel weights), 1: columns (row-parallel weights)
    blocks: int = 1  # equal blocks along `dim`, each cut alike: [q; k; v] keeps a rank's heads together

    def part(self, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s part of `whole` among `size` ranks (near-equal: the vocabulary may be uneven)."""
        w = whole.unflatten(self.dim, (self.blocks, -1))
        lo, hi = chunk_bounds(w.shape[self.dim + 1], size)[rank]
        return w.narrow(self.dim + 1, lo, hi - lo).flatten(self.dim, self.dim + 1).clone()

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole weight from every rank's part, in tp-rank order: `part`'s inverse."""
        blocks = [p.unflatten(self.dim, (self.blocks, -1)) for p in parts]
        return torch.cat(blocks, dim=self.dim + 1).flatten(self.dim, self.dim + 1)

    def to_json(self) -> list[int]:
        return [self.dim, self.blocks]

    @staticmethod
    def from_json(raw: list[int]) -> TpSplit:
        return TpSplit(dim=int(raw[0]), blocks=int(raw[1]))


ROWS = TpSplit(0)
QKV_ROWS = TpSplit(0, blocks=3)
GATE_UP_ROWS = TpSplit(0, blocks=2)  # SwiGLU's fc [gate; up]: each rank keeps matching gate and up rows
COLUMNS = TpSplit(1)

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
class Section:
    """A run of `rows` along a split's dim made of `units` indivisible pieces (attention heads).
    With units >= tp the units are split over the ranks; with fewer, each rank keeps a copy of
    one unit, rank r unit r * units // tp (Megatron's rule for kv heads fewer than tp)."""

    rows: int
    units: int

    def local_units(self, rank: int, size: int) -> tuple[int, int]:
        """[lo, hi) of the units rank `rank` of `size` keeps."""
        if self.units >= size:
            return chunk_bounds(self.units, size)[rank]
        return rank * self.units // size, rank * self.units // size + 1

    def owner(self, unit: int, size: int) -> int:
        """The first rank that keeps `unit`: the one whose copy a join takes."""
        return next(r for r in range(size) if self.local_units(r, size)[0] <= unit < self.local_units(r, size)[1])


@dataclass(frozen=True)
class RowCopy:
    """Rows [lo, hi) of a rank's part along the split's dim: its copy of replicated `unit`;
    `owner`: whether this rank is the one a join reads it from (and the clip norm counts)."""

    lo: int
    hi: int
    unit: int
    units: int
    owner: bool


@dataclass(frozen=True)
class TpSplit:
    dim: int  # 0: rows (column- and vocab-parallel weights), 1: columns (row-parallel weights)
    blocks: int = 1  # equal blocks along `dim`, each cut alike: [q; k; v] keeps a rank's heads together
    # Unequal blocks instead (grouped-query qkv: [q heads; kv heads; kv heads]), each cut by its
    # units; empty: `blocks` equal blocks
    sections: tuple[Section, ...] = ()

    def part(self, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s part of `whole` among `size` ranks (near-equal: the vocabulary may be uneven)."""
        if self.sections:
            pieces = whole.split([sec.rows for sec in self.sections], self.dim)
            return torch.cat([self._units(p, sec, *sec.local_units(rank, size))
                              for p, sec in zip(pieces, self.sections, strict=True)], dim=self.dim)
        w = whole.unflatten(self.dim, (self.blocks, -1))
        lo, hi = chunk_bounds(w.shape[self.dim + 1], size)[rank]
        return w.narrow(self.dim + 1, lo, hi - lo).flatten(self.dim, self.dim + 1).clone()

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole weight from every rank's part, in tp-rank order: `part`'s inverse (a
        replicated unit is read from its first owner)."""
        if self.sections:
            return self._join_sections(parts)
        blocks = [p.unflatten(self.dim, (self.blocks, -1)) for p in parts]
        return torch.cat(blocks, dim=self.dim + 1).flatten(self.dim, self.dim + 1)

    def copies(self, rank: int, size: int) -> list[RowCopy]:
        """The replicated units in rank `rank`'s part: their gradients must be summed over the
        ranks that share them, and only their owner counts them once in the clip norm."""
        out, at = [], 0
        for sec in self.sections:
            lo, hi = sec.local_units(rank, size)
            n = (hi - lo) * sec.rows // sec.units
            if sec.units < size:
                out.append(RowCopy(at, at + n, lo, sec.units, sec.owner(lo, size) == rank))
            at += n
        return out

    def _units(self, piece: torch.Tensor, sec: Section, lo: int, hi: int) -> torch.Tensor:
        return piece.unflatten(self.dim, (sec.units, -1)).narrow(self.dim, lo, hi - lo).flatten(self.dim, self.dim + 1)

    def _join_sections(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        size = len(parts)
        spans = [[sec.local_units(r, size) for sec in self.sections] for r in range(size)]
        # each part split into its sections' local rows
        split = [p.split([(hi - lo) * sec.rows // sec.units for (lo, hi), sec in zip(spans[r], self.sections, strict=True)],
                         self.dim) for r, p in enumerate(parts)]
        joined = []
        for i, sec in enumerate(self.sections):
            owners = range(size) if sec.units >= size else [sec.owner(u, size) for u in range(sec.units)]
            joined += [split[r][i] for r in owners]
        return torch.cat(joined, dim=self.dim)

    def to_json(self) -> list:
        # [dim, blocks] as before sections existed, so older mshpc reads what it can
        head: list = [self.dim, self.blocks]
        return head + [[[sec.rows, sec.units] for sec in self.sections]] if self.sections else head

    @staticmethod
    def from_json(raw: list) -> TpSplit:
        sections = tuple(Section(int(r), int(u)) for r, u in raw[2]) if len(raw) > 2 else ()
        return TpSplit(dim=int(raw[0]), blocks=int(raw[1]), sections=sections)


ROWS = TpSplit(0)
QKV_ROWS = TpSplit(0, blocks=3)
COLUMNS = TpSplit(1)


def qkv_split(n_head: int, n_kv_head: int, head_dim: int) -> TpSplit:
    """How tp cuts the fused [q; k; v] rows: by head in each third for multi-head attention;
    with fewer kv heads, q heads and kv heads each by their own count (kv heads replicated
    when fewer than tp)."""
    if n_kv_head == n_head:
        return QKV_ROWS
    kv = Section(n_kv_head * head_dim, n_kv_head)
    return TpSplit(0, sections=(Section(n_head * head_dim, n_head), kv, kv))
